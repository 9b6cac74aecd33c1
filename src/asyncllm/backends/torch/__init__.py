"""The ``torch`` attention backend: the reference (explicit slots and masks, SDPA), on any device."""

from asyncllm.backends.torch._backend import TorchAttentionBackend

__all__ = ["TorchAttentionBackend"]
