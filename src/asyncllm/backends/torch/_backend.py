"""The ``torch`` attention backend: the reference (``backends.torch._attention``), on any device, no fused kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from asyncllm.backends._base import AttentionBackend, KVCache
from asyncllm.backends.torch import _attention as attention
from asyncllm.backends.torch._attention import AttentionMetadata
from asyncllm.worker._input_batch import StepInputs

__all__ = ["TorchAttentionBackend"]


class TorchAttentionBackend(AttentionBackend[AttentionMetadata]):
    """Explicit slots and masks per step; the cache gathered and attended with SDPA; nothing fused.

    Args:
        device: Where the model runs (its metadata is copied there).
        sliding_window: The model's sliding window, or None.
    """

    name = "torch"

    def __init__(self, *, device: torch.device | None = None, sliding_window: int | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.sliding_window = sliding_window

    def build_metadata(self, step: StepInputs) -> AttentionMetadata:
        """The step's slots and masks (``backends.torch._attention.build_metadata``)."""
        return attention.build_metadata(step, self.sliding_window, self.device)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding: bool = True,
        softcap: float | None = None,
    ) -> Tensor:
        """``backends.torch._attention.paged_attention`` (reads the cache only)."""
        return attention.paged_attention(q, *kv_cache, meta, scale, sliding=sliding, softcap=softcap)
