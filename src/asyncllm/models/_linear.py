"""Linear layers whose weights are packed once for a CPU GEMM: column panels, or MKL's layout.

``F.linear`` on the CPU calls MKL's ``sgemm``, which repacks the whole weight matrix into its
internal panel layout on every call. At the batch sizes of decoding (a few to a few hundred rows)
that repacking costs about as much as the multiplication, so the weights are packed once, at load.
Two packed layouts, used alone or together:

- ``"panels"`` (x86 with AVX-512, or AVX2 with FMA): ``asyncllm.backends.cpu._gemm``'s own kernel and layout, which
  fetches the next part of the weight while it computes: the faster one at decode row counts, where
  the weights come from memory;
- ``"mkl"``: MKL's ``cblas_sgemm_pack`` / ``cblas_sgemm_compute``. torch's CPU builds for x86 link
  MKL statically and export those symbols from ``libtorch_cpu.so``, so they are reached with
  ``ctypes``. The faster one for prefill-sized inputs, where the arithmetic decides;
- ``"both"``: a copy in each layout, each input on the better one by its row count
  (``PANEL_MAX_ROWS``); the default on Intel CPUs with AVX-512 where both run and the second copy fits
  comfortably in memory. Elsewhere (AMD) MKL runs its generic kernels, which the panels beat at every row
  count, and without AVX-512 MKL's AVX2 kernels only tie the panels' at prefill, so the panels serve alone
  there (``mkl_wins_prefill``).

Either call releases the GIL and runs on torch's OpenMP threads, so ``torch.set_num_threads``
governs it like any other op. Neither layout depends on the row count: one packed copy serves
every batch size. Each is checked once per process against ``F.linear`` (``gemm_cpu.available``,
``packed_gemm_available``) and left unused if it disagrees or is missing. Packing is for float32 on
the CPU; everything else runs ``F.linear`` as before. Under ``torch.compile`` the multiplication is
the custom operator ``asyncllm::packed_linear``, which inductor keeps as an opaque call between the
kernels it fuses (the packed weights are module buffers, so one graph still serves every layer).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu import _native as native
from asyncllm.backends.cpu._native import F32, I32, PTR
from asyncllm.backends.cpu._pool import KernelPool
from asyncllm.worker._memory import host_available_bytes, mapped_tensor

logger = logging.getLogger("asyncllm")

__all__ = [
    "BOTH_FORMATS_MEMORY_SHARE",
    "PANEL_MAX_ROWS",
    "Linear",
    "PackedFormat",
    "PackedWeight",
    "best_packed_format",
    "format_available",
    "mkl_wins_prefill",
    "on_panels",
    "packed_gemm_available",
    "packed_linear",
    "packed_matmul",
    "packed_matmul_into",
]

# CBLAS constants (mkl_cblas.h).
_ROW_MAJOR = 101
_NO_TRANS = 111
_TRANS = 112
_PACKED = 151
_B_MATRIX = 162


_MKL_SIGNATURES: native.Signatures = {
    "cblas_sgemm_pack_get_size": ([I32] * 4, ctypes.c_size_t),
    "cblas_sgemm_pack": ([I32] * 6 + [F32, PTR, I32, PTR], None),
    "cblas_sgemm_compute": ([I32] * 6 + [PTR, I32, PTR, I32, F32, PTR, I32], None),
}


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    library = native.torch_cpu_library()
    if not torch.backends.mkl.is_available() or library is None:
        return None
    try:
        return native.declare(library, _MKL_SIGNATURES)
    except AttributeError:  # a build without MKL's packed GEMM
        return None


class PackedWeight:
    """A float32 [out_features, in_features] weight in MKL's packed GEMM layout (CPU only)."""

    def __init__(self, weight: torch.Tensor) -> None:
        library = _mkl()
        if library is None:
            raise RuntimeError("MKL's packed GEMM is unavailable in this torch build")
        source = gemm_cpu.packing_source(weight)
        self.out_features, self.in_features = (int(size) for size in weight.shape)
        # The row count given here does not change the layout (the size is the same for any m);
        # 64 is a typical decode batch. Pages past what pack writes are never touched, so the
        # resident cost is about the weight's own size although the reservation is larger. Huge
        # pages where the kernel gives them: every step streams every weight.
        size = library.cblas_sgemm_pack_get_size(_B_MATRIX, 64, self.out_features, self.in_features)
        self.buffer = mapped_tensor(size, torch.uint8)
        library.cblas_sgemm_pack(
            _ROW_MAJOR, _B_MATRIX, _TRANS, 64, self.out_features, self.in_features,
            1.0, source.data_ptr(), self.in_features, self.buffer.data_ptr(),
        )  # fmt: skip

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` from the packed weight; ``x`` is [..., in_features] float32."""
        gemm_cpu.check_input(x, self.in_features)
        return packed_matmul(x, self.buffer, bias, self.out_features)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with ``weight`` packed by ``PackedWeight`` into ``packed`` (no checks)."""
    return gemm_cpu.matmul_with(packed_matmul_into, x, packed, bias, out_features)


def packed_matmul_into(
    x: int, x_stride: int, rows: int, packed: int, out: int, out_stride: int, out_features: int, in_features: int
) -> None:
    """MKL's packed GEMM on raw addresses: ``out[:rows, :out_features] = x[:rows, :in_features] @ weight.T``.

    ``packed`` is the address of a ``PackedWeight`` buffer of that weight; strides count floats. No
    checks (``packed_matmul`` is the checked entry): for callers that own every layout they pass
    (``asyncllm.backends.cpu._lean_forward``). ``rows`` must be positive.
    """
    library = _mkl()
    if library is None:  # a packed weight exists only where packing was available
        raise RuntimeError("MKL's packed GEMM is unavailable in this torch build")
    library.cblas_sgemm_compute(
        _ROW_MAJOR, _NO_TRANS, _PACKED, rows, out_features, in_features,
        x, x_stride, packed, out_features, 0.0, out, out_stride,
    )  # fmt: skip


PANEL_MAX_ROWS = 64
"""With both packed formats, inputs of up to this many rows go to the panel GEMM, larger ones to MKL's.

The panel GEMM wins where the weights' memory traffic decides (decode batches); MKL's wins where the
arithmetic does (prefill). Measurements: docs/performance-log.md, "Fifth round"."""


def on_panels(has_panels: bool, has_packed: bool, rows: int) -> bool:
    """Whether an input of ``rows`` rows runs on the panel GEMM, given which packed copies a layer has."""
    return has_panels and (not has_packed or rows <= PANEL_MAX_ROWS)


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor | None,
    panels: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` from whichever packed copies the layer has (at least one; no checks)."""
    if panels is not None and on_panels(True, packed is not None, x.shape[:-1].numel()):
        return gemm_cpu.panel_matmul(x, panels, bias, out_features)
    assert packed is not None
    return packed_matmul(x, packed, bias, out_features)


# What compiled graphs call: the foreign call stays opaque to dynamo and inductor, and the row count
# (dynamic under compile) picks the kernel at run time. Eager code calls ``packed_linear`` itself (a
# custom operator's dispatch would cost microseconds per call).
_packed_linear_op = torch.library.custom_op("asyncllm::packed_linear", packed_linear, mutates_args=())
# The shape of the result, for tracing (same arguments as the operator).
_packed_linear_op.register_fake(
    lambda x, packed, panels, bias, out_features: x.new_empty((*x.shape[:-1], out_features))
)


@functools.cache
def packed_gemm_available() -> bool:
    """Whether MKL's packed GEMM is reachable and agrees with ``F.linear`` (checked once per process)."""
    if _mkl() is None:
        logger.info("MKL's packed GEMM is not exported by this torch build: linear layers use F.linear")
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=generator)
    packed = PackedWeight(weight)
    for count in (1, 5, 64, 131):
        x = torch.randn(count, 80, generator=generator)
        if not torch.allclose(packed.linear(x), F.linear(x, weight), rtol=1e-4, atol=1e-4):
            logger.warning("MKL's packed GEMM disagrees with F.linear at %d rows: linear layers use F.linear", count)
            return False
    return True


PackedFormat = Literal["both", "panels", "mkl"]
"""How a ``Linear`` holds its packed weight: ``gemm_cpu``'s column panels, MKL's packed layout, or both
(twice the weight's memory; inputs of up to ``PANEL_MAX_ROWS`` rows run on the panels, larger ones on MKL's)."""

BOTH_FORMATS_MEMORY_SHARE = 0.25
"""``best_packed_format`` keeps both copies only while the second one takes at most this share of the
memory the host has available: a large model gets the panels alone."""


@functools.cache
def mkl_wins_prefill() -> bool:
    """Whether MKL's packed GEMM beats the panels on prefill-sized inputs on this CPU: on Intel's with AVX-512.

    MKL picks its AVX-512 kernels on Intel CPUs alone; on others (AMD's) it runs its generic ones, which
    the panel GEMM outpaces at every row count (docs/performance-log.md, "Seventeenth session"), so a
    second, MKL-packed copy of the weights there costs memory for nothing. Without AVX-512 MKL's AVX2
    kernels tie the panels' AVX2 ones from 256 rows up and lose below (measured on AMD's Zen 3,
    "Twenty-seventh session"): the panels alone.
    """
    return native.cpu_vendor() == "GenuineIntel" and "avx512f" in native.cpu_flags()


def best_packed_format(weight_bytes: int) -> PackedFormat | None:
    """The packed format to use here for ``weight_bytes`` of float32 weights.

    Both where both kernels run, MKL's is the faster for prefill (``mkl_wins_prefill``) and a second
    copy of the weights fits comfortably (see ``BOTH_FORMATS_MEMORY_SHARE``); else the panels (x86 with
    AVX-512, or AVX2 with FMA); else MKL's; else None (``F.linear``).
    """
    panels, mkl = gemm_cpu.available(), packed_gemm_available()
    roomy = weight_bytes <= BOTH_FORMATS_MEMORY_SHARE * host_available_bytes()
    if panels and mkl and mkl_wins_prefill() and roomy:
        return "both"
    if panels:
        return "panels"
    if mkl:
        return "mkl"
    return None


def format_available(packed_format: PackedFormat) -> bool:
    """Whether ``packed_format`` runs on this machine with this torch build."""
    panels, mkl = gemm_cpu.available(), packed_gemm_available()
    return {"both": panels and mkl, "panels": panels, "mkl": mkl}[packed_format]


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) that can run from a packed weight.

    ``pack()`` packs the weight once (float32, CPU), into ``gemm_cpu``'s column panels, MKL's packed
    layout or both, and, with ``release=True``, drops the unpacked copy; until then, and wherever
    packing is unavailable, it is a plain ``nn.Linear``. The packed weights are non-persistent
    buffers (not in the state dict), so ``torch.compile`` sees them as graph inputs like the weight
    they replace.
    """

    packed_weight: torch.Tensor | None
    """MKL's packed layout, or None."""
    panel_weight: torch.Tensor | None
    """``gemm_cpu``'s column panels, or None."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("packed_weight", None, persistent=False)
        self.register_buffer("panel_weight", None, persistent=False)
        self.pool: KernelPool | None = None
        """The kernel pool its panel GEMM runs on meanwhile (``backends.cpu._pool``), or None for OpenMP's
        threads: the runner sets it on the head for the steps it runs on the pool."""

    @property
    def packed_format(self) -> PackedFormat | None:
        """Which packed copies the layer has; None while unpacked."""
        mkl, panels = self.packed_weight is not None, self.panel_weight is not None
        return "both" if mkl and panels else "mkl" if mkl else "panels" if panels else None

    @property
    def packed(self) -> bool:
        """Whether the layer runs from a packed weight."""
        return self.packed_weight is not None or self.panel_weight is not None

    def pack(self, release: bool, packed_format: PackedFormat | None = None, *, bfloat16: bool = False) -> bool:
        """Pack the weight; return whether it is now packed.

        Args:
            release: Replace the unpacked weight by an empty tensor to give its memory back. Only
                for a weight nothing else shares (not a tied embedding) and when nothing will read
                it again (no CUDA graphs).
            packed_format: "both", "panels" or "mkl"; None takes ``best_packed_format`` for this
                weight alone. A format this machine lacks leaves the layer unpacked.
            bfloat16: Pack bfloat16 panels (``gemm_cpu.PanelWeight``) from a float32 or bfloat16 weight: the
                layer's matmuls then multiply in bfloat16 and sum in float32, on float32 inputs and outputs.
                Only as "panels" (or None), where ``gemm_cpu.bfloat16_available``; elsewhere the layer stays
                unpacked.
        """
        weight = self.weight
        if weight.dtype not in ((torch.float32, torch.bfloat16) if bfloat16 else (torch.float32,)):
            return False
        if weight.device.type != "cpu":
            return False
        if bfloat16:
            if packed_format not in (None, "panels") or not gemm_cpu.bfloat16_available():
                return False
            self.panel_weight = gemm_cpu.PanelWeight(weight, bfloat16=True).buffer
            if release:
                self.release()
            return True
        chosen = packed_format or best_packed_format(weight.numel() * weight.element_size())
        if chosen is None or not format_available(chosen):
            return False
        if chosen in ("both", "mkl"):
            self.packed_weight = PackedWeight(weight).buffer
        if chosen in ("both", "panels"):
            self.panel_weight = gemm_cpu.PanelWeight(weight).buffer
        if release:
            self.release()
        return True

    def release(self) -> None:
        """Replace the unpacked weight by an empty tensor, giving its memory back (once packed; see ``pack``)."""
        if not self.packed:
            raise RuntimeError("release() before pack(): the layer would have no weight left")
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, panels = self.packed_weight, self.panel_weight
        if packed is None and panels is None:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            result: torch.Tensor = torch.ops.asyncllm.packed_linear(x, packed, panels, self.bias, self.out_features)
            return result
        if self.pool is not None and panels is not None and on_panels(True, packed is not None, x.shape[:-1].numel()):
            return gemm_cpu.panel_matmul(x, panels, self.bias, self.out_features, self.pool)
        return packed_linear(x, packed, panels, self.bias, self.out_features)
