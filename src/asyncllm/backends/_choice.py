"""Which attention backend runs: the option's name resolved, and the backend object created for a model."""

from __future__ import annotations

import logging

import torch

from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.cpu._backend import CpuAttentionBackend
from asyncllm.backends.torch._backend import TorchAttentionBackend
from asyncllm.backends.triton._backend import TritonAttentionBackend

logger = logging.getLogger("asyncllm")

__all__ = ["create_backend", "resolve_attention_backend"]


def resolve_attention_backend(backend: str, device: torch.device, *, cpu_kernel: bool = False) -> str:
    """``"auto"`` is triton on CUDA when triton is installed; on the CPU cpu if ``cpu_kernel``, else torch.

    The runner asks for ``cpu_kernel`` and still falls back from cpu to torch where the kernel
    cannot run (``create_backend``).

    Raises:
        ValueError: Unknown backend, or triton or cpu asked for where it cannot run.
    """
    from asyncllm.backends.triton._kernels import interpreting, triton_available
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "cpu" if cpu_kernel else "torch"
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, not on {device.type}")
        return backend
    if backend == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs triton installed (pip install 'asyncllm[gpu]')")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"attention_backend='triton' runs on CUDA; on {device.type} only in triton's interpreter "
                "(TRITON_INTERPRET=1, slow, for tests)"
            )
        return backend
    if backend != "torch":
        raise ValueError(f"attention_backend must be 'auto', 'torch', 'cpu' or 'triton', got {backend!r}")
    return backend


def create_backend(
    name: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    num_kv_heads: int,
    sliding_window: int | None,
    requested: bool = False,
    attn_softcap: float | None = None,
) -> TorchAttentionBackend | CpuAttentionBackend | TritonAttentionBackend:
    """The backend object of a resolved name (``resolve_attention_backend``) for one model.

    cpu falls back to torch where its kernels cannot run: a dtype other than float32, or no C
    compiler to build the decode kernel for ``head_dim``.

    Args:
        name: "torch", "cpu" or "triton".
        device: Where the model runs.
        dtype: The model's dtype.
        head_dim: The model's head size (the cpu kernel is built per head size).
        num_kv_heads: The model's KV heads (the triton split-KV decision).
        sliding_window: The model's sliding window, or None.
        requested: The backend was asked for by name: a fallback is logged as a warning, not a note.
        attn_softcap: The model soft-caps its attention scores (gemma2): every backend applies it (triton
            compiles its soft-capped kernel variants at warm-up).

    Raises:
        ValueError: ``name`` is not a backend.
    """
    if name == "cpu":
        report = logger.warning if requested else logger.info
        if dtype != torch.float32:
            report("the cpu attention backend runs float32 only; using torch attention for %s", dtype)
        elif not attention_cpu.native_decode_available(head_dim):
            report("the cpu attention kernel is unavailable (no C compiler?); using torch attention")
        else:
            return CpuAttentionBackend(sliding_window=sliding_window)
        name = "torch"
    if name == "torch":
        return TorchAttentionBackend(device=device, sliding_window=sliding_window)
    if name == "triton":
        return TritonAttentionBackend(
            device=device, num_kv_heads=num_kv_heads, sliding_window=sliding_window, softcap=attn_softcap
        )
    raise ValueError(f"no attention backend is called {name!r}; resolve the option first")
