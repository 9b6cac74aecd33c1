"""The ``cpu`` attention backend: float32 on the CPU, C kernels (``layers.attention_cpu``, ``elementwise_cpu``)."""

from __future__ import annotations

from typing import NoReturn

import torch

from asyncllm.input_batch import StepInputs
from asyncllm.layers import attention, attention_cpu, elementwise_cpu
from asyncllm.layers.attention_cpu import CpuAttentionMetadata

__all__ = ["CpuAttentionBackend"]


class CpuAttentionBackend:
    """The decode and fresh-prompt attention as C kernels reading the cache in place; rotary and the
    fused residual-add RMSNorm as C kernels too. The model's lean forward reads its metadata.

    The runner creates it only where the decode kernel could be built for the model's head size
    and the model runs float32 (``create_backend``).

    Args:
        sliding_window: The model's sliding window, or None.
    """

    name = "cpu"
    rotates_in_kernel = False  # eager layers on the unfused path rotate with torch ops, as the reference
    runs_lean_forward = True
    captures_graphs = False

    def __init__(self, *, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window

    @property
    def fuses_norms(self) -> bool:
        """Whether the element-wise C kernels could be built (they need the compiler the attention did)."""
        return elementwise_cpu.available()

    def build_metadata(self, step: StepInputs) -> CpuAttentionMetadata:
        """The step's metadata (``layers.attention_cpu.build_metadata``: tensors over the step's arrays)."""
        return attention_cpu.build_metadata(step, sliding_window=self.sliding_window)

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: CpuAttentionMetadata,
    ) -> None:
        """``index_copy_`` of the new keys and values into their slots (the lean forward writes them in C)."""
        attention.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: CpuAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """``layers.attention_cpu.paged_attention``: fresh prompts read their own ``k`` and ``v``."""
        return attention_cpu.paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """``layers.elementwise_cpu.rotary_``: bit for bit the torch rotation."""
        elementwise_cpu.rotary_(q, k, cos, sin)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """``layers.elementwise_cpu.rms_norm``."""
        return elementwise_cpu.rms_norm(x, weight, eps, residual=residual)

    def kv_splits(self, num_seqs: int, max_seq_len: int) -> int:
        """1: the decode kernel splits its work over sequences and KV heads itself."""
        return 1

    def graph_inputs(self, *, max_batch: int, max_blocks: int, block_size: int, device: torch.device) -> NoReturn:
        """Not here: CUDA graphs need the triton attention backend (``captures_graphs`` is False)."""
        raise NotImplementedError("CUDA graphs need the triton attention backend")
