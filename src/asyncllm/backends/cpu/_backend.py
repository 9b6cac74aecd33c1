"""The ``cpu`` attention backend: float32 on the CPU, C kernels (``backends.cpu._attention``, ``elementwise_cpu``)."""

from __future__ import annotations

from torch import Tensor

from asyncllm.backends._base import AttentionBackend, KVCache
from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.cpu import _elementwise as elementwise_cpu
from asyncllm.backends.cpu._attention import CpuAttentionMetadata
from asyncllm.worker._input_batch import StepInputs

__all__ = ["CpuAttentionBackend"]


class CpuAttentionBackend(AttentionBackend[CpuAttentionMetadata]):
    """Decode and fresh-prompt attention as C kernels that read the cache in place; rotary and the
    residual-add RMSNorm as C kernels too. The model's lean forward reads its metadata.

    ``create_backend`` makes one only where the decode kernel could be built for the model's head
    size and the model runs float32.

    Args:
        sliding_window: The model's sliding window, or None.
    """

    name = "cpu"
    runs_lean_forward = True
    # rotates_in_kernel stays False: eager layers off the fused-norm path rotate with torch ops. The KV
    # write is the reference ``index_copy_`` (the lean forward writes in C: the same bytes).

    def __init__(self, *, sliding_window: int | None = None) -> None:
        self.sliding_window = sliding_window
        self.fuses_norms = elementwise_cpu.available()  # they need the compiler the attention kernels did

    def build_metadata(self, step: StepInputs) -> CpuAttentionMetadata:
        """The step's metadata (``backends.cpu._attention.build_metadata``: tensors over the step's arrays)."""
        return attention_cpu.build_metadata(step, sliding_window=self.sliding_window)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: KVCache,
        meta: CpuAttentionMetadata,
        scale: float,
        *,
        sliding: bool = True,
        softcap: float | None = None,
    ) -> Tensor:
        """``backends.cpu._attention.paged_attention``: fresh prompts read their own ``k`` and ``v``."""
        return attention_cpu.paged_attention(q, k, v, *kv_cache, meta, scale, sliding=sliding, softcap=softcap)

    def rotary_(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
        """``backends.cpu._elementwise.rotary_``: bit for bit the torch rotation."""
        elementwise_cpu.rotary_(q, k, cos, sin)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None) -> Tensor:
        """``backends.cpu._elementwise.rms_norm``."""
        return elementwise_cpu.rms_norm(x, weight, eps, residual=residual)
