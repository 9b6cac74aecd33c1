"""The ``torch`` attention backend: the reference (``layers.attention``), on any device, no fused kernels."""

from __future__ import annotations

from typing import NoReturn

import torch

from asyncllm.input_batch import StepInputs
from asyncllm.layers import attention
from asyncllm.layers.attention import AttentionMetadata

__all__ = ["TorchAttentionBackend"]


class TorchAttentionBackend:
    """Explicit slots and masks per step, the cache gathered and attended with SDPA.

    Args:
        device: Where the model runs (its metadata is copied there).
        sliding_window: The model's sliding window, or None.
    """

    name = "torch"
    rotates_in_kernel = False
    fuses_norms = False
    runs_lean_forward = False
    captures_graphs = False

    def __init__(self, *, device: torch.device | None = None, sliding_window: int | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.sliding_window = sliding_window

    def build_metadata(self, step: StepInputs) -> AttentionMetadata:
        """The step's slots and masks (``layers.attention.build_metadata``)."""
        return attention.build_metadata(step, sliding_window=self.sliding_window, device=self.device)

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """``index_copy_`` of the new keys and values into their slots."""
        attention.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """``layers.attention.paged_attention`` (reads the cache only)."""
        return attention.paged_attention(q, k_cache, v_cache, meta, scale)

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> NoReturn:
        """Not here: the projection rotates with torch ops (``rotates_in_kernel`` is False)."""
        raise NotImplementedError("the torch attention backend has no in-place rotary kernel")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> NoReturn:
        """Not here: the model runs its torch norms (``fuses_norms`` is False)."""
        raise NotImplementedError("the torch attention backend has no fused RMSNorm kernel")

    def kv_splits(self, num_seqs: int, max_seq_len: int) -> int:
        """1: no split-KV kernels."""
        return 1

    def graph_inputs(self, *, max_batch: int, max_blocks: int, block_size: int, device: torch.device) -> NoReturn:
        """Not here: CUDA graphs need the triton backend's metadata (``captures_graphs`` is False)."""
        raise NotImplementedError("CUDA graphs need the triton attention backend")
