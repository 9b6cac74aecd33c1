"""The attention backend protocol: what the model and the runner call (``asyncllm.backends``)."""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from asyncllm.input_batch import StepInputs

__all__ = ["AttentionBackend", "DecodeGraphInputs"]

MetadataT = TypeVar("MetadataT")
MetadataT_co = TypeVar("MetadataT_co", covariant=True)


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


class AttentionBackend(Protocol[MetadataT]):
    """What the model and the runner call for attention; ``MetadataT`` is the backend's own metadata.

    The capabilities say which optional hooks the model may call: ``rotary_`` where
    ``rotates_in_kernel`` or ``fuses_norms``, ``rms_norm`` where ``fuses_norms``, and
    ``graph_inputs`` where ``captures_graphs``; elsewhere they raise NotImplementedError.
    """

    @property
    def name(self) -> str:
        """ "torch", "cpu" or "triton": the ``attention_backend`` option that picks it."""
        ...

    @property
    def rotates_in_kernel(self) -> bool:
        """Eager layers leave the rotation of q and k to ``rotary_`` (in place), not the projection's torch ops."""
        ...

    @property
    def fuses_norms(self) -> bool:
        """``rms_norm`` runs (one kernel per norm with the residual add fused in): the model's fused-norm path."""
        ...

    @property
    def runs_lean_forward(self) -> bool:
        """The model's lean forward (``models.lean_cpu``, the layer stack as direct C calls) reads this
        backend's metadata, so the model may run it in place of its modules."""
        ...

    @property
    def captures_graphs(self) -> bool:
        """``graph_inputs`` runs: the runner may capture CUDA graphs of decode steps."""
        ...

    def build_metadata(self, step: StepInputs) -> MetadataT:
        """The step's metadata, built once per step and shared by every layer."""
        ...

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: MetadataT
    ) -> None:
        """Store the step's new keys and values ([tokens, kv_heads, head_dim]) at their cache slots."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: MetadataT,
        scale: float,
    ) -> torch.Tensor:
        """[tokens, heads, head_dim] attention of every query against its sequence's cache (written already).

        ``k`` and ``v`` are the step's own keys and values (some backends read a fresh prompt's from there).
        """
        ...

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate q and k ([tokens, heads, head_dim]) in place by cos/sin of [tokens, head_dim]."""
        ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> torch.Tensor:
        """``weight * rmsnorm(x)`` as one kernel; with ``residual``, of ``x + residual``, which it is
        overwritten with (the sum rounded as ``residual + x`` would be)."""
        ...

    def kv_splits(self, num_seqs: int, max_seq_len: int) -> int:
        """The parts a decode-only batch's context is split into (split-KV kernels); 1 for none."""
        ...

    def graph_inputs(
        self, *, max_batch: int, max_blocks: int, block_size: int, device: torch.device
    ) -> DecodeGraphInputs[MetadataT]:
        """Static metadata buffers for decode batches of up to ``max_batch`` sequences, for CUDA graphs."""
        ...
