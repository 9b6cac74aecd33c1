"""The ``triton`` attention backend: the Triton kernels (``_kernels``), their launchers and the
static metadata CUDA graphs replay."""

from asyncllm.backends.triton._backend import TritonAttentionBackend

__all__ = ["TritonAttentionBackend"]
