"""What an attention backend is: the calls the model and the runner make (``asyncllm.backends``)."""

from __future__ import annotations

import abc
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from asyncllm.backends.torch import _attention as attention
from asyncllm.worker._input_batch import StepInputs

__all__ = ["AttentionBackend", "DecodeGraphInputs", "KVCache", "SlotMapped"]

KVCache = tuple[Tensor, Tensor]
"""A layer's (key cache, value cache), each [slots, kv_heads, head_dim]."""


class SlotMapped(Protocol):
    """What every backend's metadata has: where each of the step's new tokens goes in the cache."""

    @property
    def slot_mapping(self) -> Tensor:
        """[tokens] the cache slot each new token's key and value are written to."""
        ...


MetadataT = TypeVar("MetadataT", bound=SlotMapped)
MetadataT_co = TypeVar("MetadataT_co", bound=SlotMapped, covariant=True)


class DecodeGraphInputs(Protocol[MetadataT_co]):
    """A decode batch's metadata in static device buffers, which captured CUDA graphs read."""

    def fill(self, step: StepInputs) -> None:
        """Write a decode-only step into the host side of the buffers (padding the rows it leaves)."""
        ...

    def upload(self, non_blocking: bool) -> None:
        """Copy the host side to the device buffers."""
        ...

    def metadata(self, size: int, splits: int) -> MetadataT_co:
        """The metadata of ``size`` sequences with ``splits`` KV splits, as views into the device buffers."""
        ...


class AttentionBackend(abc.ABC, Generic[MetadataT]):
    """What the model and the runner call for attention; ``MetadataT`` is the backend's own metadata.

    Every backend builds metadata and attends; it writes the KV cache the reference way
    (``index_copy_`` into ``meta.slot_mapping``) unless it has a kernel of its own. The capabilities say which
    optional hooks the model may call besides; here they say none, and the hooks raise
    NotImplementedError: ``rotary_`` where ``rotates_in_kernel`` or ``fuses_norms``, ``rms_norm``
    where ``fuses_norms``, and ``graph_inputs`` where ``captures_graphs``.
    """

    name: str = "abstract"
    """"torch", "cpu" or "triton": the ``attention_backend`` option that picks it."""
    rotates_in_kernel: bool = False
    """Eager layers leave the rotation of q and k to ``rotary_`` (in place), not the projection's torch ops."""
    fuses_norms: bool = False
    """``rms_norm`` runs (one kernel per norm with the residual add fused in): the model's fused-norm path."""
    runs_lean_forward: bool = False
    """The model's lean forward (``backends.cpu._lean_forward``, the layer stack as direct C calls) reads this
    backend's metadata, so the model may run it in place of its modules."""
    captures_graphs: bool = False
    """``graph_inputs`` runs: the runner may capture CUDA graphs of decode steps."""
    runs_fused_moe: bool = False
    """The model's Mixture-of-Experts blocks compute their experts with the fused Triton kernels
    (``backends.triton._kernels.fused_moe``) instead of the torch grouped path (``models._moe``)."""

    @abc.abstractmethod
    def build_metadata(self, step: StepInputs) -> MetadataT:
        """The step's metadata, built once per step and shared by every layer."""

    def write_kv(self, kv_cache: KVCache, k: Tensor, v: Tensor, meta: MetadataT) -> None:
        """Store the step's new keys and values ([tokens, kv_heads, head_dim]) at their slots of the layer's
        cache: ``index_copy_`` (``layers.attention.write_kv``) here."""
        attention.write_kv(*kv_cache, k, v, meta.slot_mapping)

    @abc.abstractmethod
    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: KVCache,
        meta: MetadataT,
        scale: float,
        *,
        sliding: bool = True,
        softcap: float | None = None,
    ) -> Tensor:
        """[tokens, heads, head_dim] attention of every query (rotated) against its sequence's cache.

        ``write_kv`` wrote the step's keys and values ``k`` and ``v`` already; some backends read a
        fresh prompt's from ``k`` and ``v`` rather than the cache. ``scale`` is the softmax scale.
        ``sliding`` False: this layer attends to the whole context even though the backend has a
        sliding window (a global layer of a model that alternates them, gemma). ``softcap``: the scores
        become ``softcap * tanh(scores / softcap)`` before the softmax (gemma2); None: not.
        """

    def rotary_(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Rotate q and k ([tokens, heads, head_dim]) in place by cos/sin of [tokens, head_dim]."""
        raise NotImplementedError(f"the {self.name} attention backend has no in-place rotary kernel")

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None) -> Tensor:
        """``weight * rmsnorm(x)`` as one kernel; with ``residual``, of ``x + residual``, which it is
        overwritten with (the sum rounded as ``residual + x`` would be)."""
        raise NotImplementedError(f"the {self.name} attention backend has no fused RMSNorm kernel")

    def kv_splits(self, num_seqs: int, max_seq_len: int) -> int:
        """The parts a decode-only batch's context is split into (split-KV kernels); 1: none."""
        return 1

    def graph_inputs(
        self, *, max_batch: int, max_blocks: int, block_size: int, device: torch.device
    ) -> DecodeGraphInputs[MetadataT]:
        """Static metadata buffers for decode batches of up to ``max_batch`` sequences, for CUDA graphs."""
        raise NotImplementedError(f"CUDA graphs need the triton attention backend, not {self.name}")
