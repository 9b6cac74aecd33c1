"""Attention backends: one object per backend, picked by the runner at load and called by the model.

A backend owns what differs between the ways attention can run: the step's metadata (built once per
step by the runner, and over static buffers for the CUDA graphs), the KV write, the attention itself,
and the kernels it fuses around them (rotary in place, the residual add fused into the RMSNorm). The
model holds its backend (``DecoderForCausalLM.backend``) and calls it; it never looks at metadata,
which is whatever its backend's ``build_metadata`` made. So a new backend is a new object, not a
new branch in the model, and a test can hand the model one that records its calls.

- ``torch`` (``TorchAttentionBackend``, the reference): explicit slots and masks, SDPA; any device.
- ``cpu`` (``CpuAttentionBackend``): float32 on the CPU, the C kernels of ``backends.cpu._attention``
  and ``backends.cpu._elementwise``; the lean forward (``backends.cpu._lean_forward``) reads its metadata.
- ``triton`` (``TritonAttentionBackend``): the Triton kernels of ``backends.triton._kernels``; it alone builds
  the static metadata CUDA graphs replay.
"""

from __future__ import annotations

# No code here: the submodule ``torch`` is this package's attribute ``torch``, which would shadow the
# library in this module's namespace.
from asyncllm.backends._base import AttentionBackend, DecodeGraphInputs
from asyncllm.backends._choice import create_backend, resolve_attention_backend
from asyncllm.backends.cpu._backend import CpuAttentionBackend
from asyncllm.backends.torch._backend import TorchAttentionBackend
from asyncllm.backends.triton._backend import TritonAttentionBackend

__all__ = [
    "AttentionBackend",
    "CpuAttentionBackend",
    "DecodeGraphInputs",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
    "create_backend",
    "resolve_attention_backend",
]
