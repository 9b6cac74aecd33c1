"""Triton kernels for the GPU path, one kernel and its launcher per module.

- ``reshape_and_cache``: write a step's new K/V into the paged cache through the slot mapping.
- ``paged_attention``: attention for one flat mixed batch (prefill chunks and decode tokens).
- ``split_kv_decode``: the same attention with each sequence's context split over several programs
  (flash-decoding) and a reduce kernel; pays for long contexts at small batch.
- ``rms_norm``: RMSNorm with an optional fused residual add.
- ``rotary``: rotary embedding applied in place to q and k.
- ``fused_moe``: the Mixture-of-Experts feed-forward (grouped gate/up with SiLU-and-mul, grouped down
  with the routing weight) over a block-aligned per-expert layout.

Importing this package does not import triton; each kernel module does. On a machine without a GPU
the kernels run under triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported),
which is how the tests check them on the CPU.
"""

from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    """Whether triton can be imported (it ships with CUDA builds of torch; CPU builds lack it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
