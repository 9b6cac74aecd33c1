"""Linear layers whose weights are packed once for a CPU GEMM: column panels, or MKL's layout.

``F.linear`` on the CPU calls MKL's ``sgemm``, which repacks the whole weight matrix into its
internal panel layout on every call. At the batch sizes of decoding (a few to a few hundred rows)
that repacking costs as much as the multiplication: measured on this project's 2-core machine, a
[3072 x 512] weight runs at 28-77 GFLOPS for 16-32 rows through ``F.linear`` and at 66-101 GFLOPS
from a weight packed once; whole decode steps of the benchmark model are 1.2-1.33x faster
(docs/performance.md). Two packed formats:

- ``"panels"`` (x86 with AVX-512): ``asyncllm.layers.gemm_cpu``'s own kernel and layout, which
  fetches the next part of the weight while it computes; 1.1-1.5x MKL's packed GEMM at 4-32 rows
  with the weights coming from memory, as they do in a decode step, and level elsewhere;
- ``"mkl"``: MKL's ``cblas_sgemm_pack`` / ``cblas_sgemm_compute``. torch's CPU builds for x86 link
  MKL statically and export those symbols from ``libtorch_cpu.so``, so they are reached with
  ``ctypes``.

Either call releases the GIL and runs on torch's OpenMP threads, so ``torch.set_num_threads``
governs it like any other op. Neither layout depends on the row count: one packed copy serves
every batch size. Each is checked once per process against ``F.linear`` (``gemm_cpu.available``,
``packed_gemm_available``) and left unused if it disagrees or is missing. Packing is for float32 on
the CPU; everything else runs ``F.linear`` as before. Under ``torch.compile`` the multiplication is
the custom operator ``asyncllm::panel_linear`` or ``asyncllm::packed_linear``, which inductor keeps
as an opaque call between the kernels it fuses (the packed weight is a module buffer, so one graph
still serves every layer).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers import gemm_cpu
from asyncllm.memory import anonymous_mapping

logger = logging.getLogger("asyncllm")

__all__ = [
    "Linear",
    "PackedFormat",
    "PackedWeight",
    "best_packed_format",
    "format_available",
    "packed_gemm_available",
    "packed_matmul",
]

# CBLAS constants (mkl_cblas.h).
_ROW_MAJOR = 101
_NO_TRANS = 111
_TRANS = 112
_PACKED = 151
_B_MATRIX = 162


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    library_path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not torch.backends.mkl.is_available() or not library_path.exists():
        return None
    try:
        library = ctypes.CDLL(str(library_path))
        get_size, pack, compute = (
            library.cblas_sgemm_pack_get_size,
            library.cblas_sgemm_pack,
            library.cblas_sgemm_compute,
        )
    except (OSError, AttributeError):
        return None
    i32, pointer = ctypes.c_int, ctypes.c_void_p
    get_size.restype = ctypes.c_size_t
    get_size.argtypes = [i32, i32, i32, i32]
    pack.restype = None
    pack.argtypes = [i32, i32, i32, i32, i32, i32, ctypes.c_float, pointer, i32, pointer]
    compute.restype = None
    compute.argtypes = [i32, i32, i32, i32, i32, i32, pointer, i32, pointer, i32, ctypes.c_float, pointer, i32]
    return library


class PackedWeight:
    """A float32 [out_features, in_features] weight in MKL's packed GEMM layout (CPU only)."""

    def __init__(self, weight: torch.Tensor) -> None:
        library = _mkl()
        if library is None:
            raise RuntimeError("MKL's packed GEMM is unavailable in this torch build")
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"packing needs a 2-D float32 CPU weight, not {weight.dtype} {tuple(weight.shape)}")
        self.out_features, self.in_features = (int(size) for size in weight.shape)
        source = weight.detach().contiguous()
        # The row count given here does not change the layout (the size is the same for any m);
        # 64 is a typical decode batch. Pages past what pack writes are never touched, so the
        # resident cost is about the weight's own size although the reservation is larger. Huge
        # pages where the kernel gives them: every step streams every weight.
        size = library.cblas_sgemm_pack_get_size(_B_MATRIX, 64, self.out_features, self.in_features)
        self.buffer = torch.frombuffer(anonymous_mapping(size), dtype=torch.uint8, count=size)
        library.cblas_sgemm_pack(
            _ROW_MAJOR, _B_MATRIX, _TRANS, 64, self.out_features, self.in_features,
            1.0, source.data_ptr(), self.in_features, self.buffer.data_ptr(),
        )  # fmt: skip

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` from the packed weight; ``x`` is [..., in_features] float32."""
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != self.in_features:
            raise ValueError(f"expected [..., {self.in_features}] float32 CPU input, got {x.dtype} {tuple(x.shape)}")
        return packed_matmul(x, self.buffer, bias, self.out_features)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with ``weight`` packed by ``PackedWeight`` into ``packed`` (no checks)."""
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features).contiguous()
    count = rows.shape[0]
    out = torch.empty(count, out_features, dtype=torch.float32)
    library = _mkl()
    if library is None:  # a packed weight exists only where packing was available
        raise RuntimeError("MKL's packed GEMM is unavailable in this torch build")
    if count:
        library.cblas_sgemm_compute(
            _ROW_MAJOR, _NO_TRANS, _PACKED, count, out_features, in_features,
            rows.data_ptr(), in_features, packed.data_ptr(), out_features,
            0.0, out.data_ptr(), out_features,
        )  # fmt: skip
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out_features)


@torch.library.custom_op("asyncllm::packed_linear", mutates_args=())
def _packed_linear_op(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    # What compiled graphs call: the foreign call stays opaque to dynamo and inductor.
    return packed_matmul(x, packed, bias, out_features)


@_packed_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("asyncllm::panel_linear", mutates_args=())
def _panel_linear_op(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return gemm_cpu.panel_matmul(x, panels, bias, out_features)


@_panel_linear_op.register_fake
def _(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


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


PackedFormat = Literal["panels", "mkl"]
"""How a ``Linear`` holds its packed weight: ``gemm_cpu``'s column panels, or MKL's packed layout."""


def best_packed_format() -> PackedFormat | None:
    """The packed format to use here: panels (x86 with AVX-512), else MKL's, else None (``F.linear``)."""
    if gemm_cpu.available():
        return "panels"
    if packed_gemm_available():
        return "mkl"
    return None


def format_available(packed_format: PackedFormat) -> bool:
    """Whether ``packed_format`` runs on this machine with this torch build."""
    return gemm_cpu.available() if packed_format == "panels" else packed_gemm_available()


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) that can run from a packed weight.

    ``pack()`` packs the weight once (float32, CPU), into ``gemm_cpu``'s column panels or MKL's
    packed layout, and, with ``release=True``, drops the unpacked copy; until then, and wherever
    packing is unavailable, it is a plain ``nn.Linear``. The packed weight is a non-persistent
    buffer (not in the state dict), so ``torch.compile`` sees it as a graph input like the weight
    it replaces.
    """

    packed_weight: torch.Tensor | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("packed_weight", None, persistent=False)
        self.packed_format: PackedFormat | None = None
        """The layout of ``packed_weight``; None while unpacked."""

    @property
    def packed(self) -> bool:
        """Whether the layer runs from its packed weight."""
        return self.packed_weight is not None

    def pack(self, release: bool, packed_format: PackedFormat | None = None) -> bool:
        """Pack the weight; return whether it is now packed.

        Args:
            release: Replace the unpacked weight by an empty tensor to give its memory back. Only
                for a weight nothing else shares (not a tied embedding) and when nothing will read
                it again (no CUDA graphs).
            packed_format: "panels" or "mkl"; None takes ``best_packed_format()``. A format this
                machine lacks leaves the layer unpacked.
        """
        weight = self.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            return False
        chosen = packed_format or best_packed_format()
        if chosen is None or not format_available(chosen):
            return False
        self.packed_weight = (gemm_cpu.PanelWeight(weight) if chosen == "panels" else PackedWeight(weight)).buffer
        self.packed_format = chosen
        if release:
            self.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        panels = self.packed_format == "panels"
        if torch.compiler.is_compiling():
            op = torch.ops.asyncllm.panel_linear if panels else torch.ops.asyncllm.packed_linear
            result: torch.Tensor = op(x, packed, self.bias, self.out_features)
            return result
        # Eager: the plain functions (a custom operator's dispatch would cost microseconds per call).
        if panels:
            return gemm_cpu.panel_matmul(x, packed, self.bias, self.out_features)
        return packed_matmul(x, packed, self.bias, self.out_features)
