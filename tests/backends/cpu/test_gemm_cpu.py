"""The panel GEMM's micro-kernels (asyncllm.backends.cpu._gemm): AVX2's gives AVX-512's bits; AVX2's bfloat16.

The library is built a second time with AVX-512 switched off (``-mno-avx512f``), which compiles the AVX2
micro-kernel on any x86 CPU with AVX2 and FMA; on an AVX2-only machine both builds are that one. Both builds'
float32 outputs, and the AVX2 build's bfloat16 ones, are checked bit for bit against a scalar chain of C's
``fmaf``.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu import _native as native

pytestmark = pytest.mark.skipif(
    not gemm_cpu.available() or not {"avx2", "fma"} <= native.cpu_flags(),
    reason="needs the panel GEMM on x86 with AVX2 and FMA",
)


def _avx2_library() -> ctypes.CDLL:
    library = gemm_cpu._avx2_library()  # the build AVX-512 without BF16 takes its bfloat16 panels from
    assert library is not None
    return library


@pytest.mark.parametrize(
    ("flags", "build"),
    [
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"}, "native"),  # Zen 4, Sapphire Rapids
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"}, "avx2"),  # Cascade Lake, Ice Lake
        ({"avx2", "fma"}, "native"),  # Zen 1-3, client cores
        ({"avx2"}, None),
        (set(), None),
    ],
)
def test_bfloat16_panels_come_from_the_build_that_has_them(flags: set[str], build: str | None) -> None:
    assert gemm_cpu.bfloat16_build(flags) == build


_REFERENCE_SOURCE = r"""
#include <math.h>
#include <stdint.h>
/* out[r, n] = the float32 fused multiply-add chain over the inputs in order, one rounding per step (C's fmaf). */
void reference_matmul(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows,
                      int64_t out_features, int64_t in_features) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < out_features; ++n) {
            float acc = 0.0f;
            for (int64_t k = 0; k < in_features; ++k) acc = fmaf(x[r * x_stride + k], weight[n * in_features + k], acc);
            out[r * out_features + n] = acc;
        }
}
"""


def _reference(x: torch.Tensor, x_stride: int, weight: torch.Tensor) -> torch.Tensor:
    """The exact outputs either micro-kernel must give: each one's FMA chain, scalar."""
    ptr, i64 = native.PTR, native.I64
    signatures: native.Signatures = {"reference_matmul": ([ptr, i64, ptr, ptr, i64, i64, i64], None)}
    library = native.load("panel_reference", _REFERENCE_SOURCE, signatures, ("-ffp-contract=off",))
    assert library is not None
    rows, (out_features, in_features) = x.shape[0], weight.shape
    out = torch.empty(rows, out_features)
    library.reference_matmul(x.data_ptr(), x_stride, weight.data_ptr(), out.data_ptr(), rows, out_features, in_features)
    return out


@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(100, 37), (48, 1), (47, 8), (1000, 576), (576, 1536)],  # partial panels and strips, a 1-wide input
)
def test_avx2_kernel_gives_the_same_bits_as_the_default_build(out_features: int, in_features: int) -> None:
    avx2, default = _avx2_library(), gemm_cpu._library()
    assert default is not None
    generator = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    padded = -(-out_features // gemm_cpu.PANEL_COLUMNS) * gemm_cpu.PANEL_COLUMNS
    panels = {name: torch.empty(padded * in_features) for name in ("avx2", "default")}
    avx2.asyncllm_panel_pack(weight.data_ptr(), panels["avx2"].data_ptr(), out_features, in_features)
    default.asyncllm_panel_pack(weight.data_ptr(), panels["default"].data_ptr(), out_features, in_features)
    assert torch.equal(panels["avx2"], panels["default"])
    for rows in (1, 5, 6, 7, 29, 30, 31, 32, 64, 257):  # around the row blocks, the 30-row groups, the 256-row pass
        x_stride = in_features + 3  # rows of a wider tensor, as a fused projection's output slices them
        x = torch.randn(rows, x_stride, generator=generator)
        exact = _reference(x, x_stride, weight)
        outs = {name: torch.full((rows, out_features + 3), 7.0) for name in panels}  # 3 columns past the outputs
        for name, library in (("avx2", avx2), ("default", default)):
            library.asyncllm_panel_matmul(
                x.data_ptr(), x_stride, panels[name].data_ptr(), outs[name].data_ptr(), out_features + 3,
                rows, out_features, in_features,
            )  # fmt: skip
            assert torch.equal(outs[name][:, :out_features], exact), (name, rows)
        assert (outs["avx2"][:, out_features:] == 7.0).all()  # nothing written past the last column
        for valid in (out_features, max(1, out_features - 40)):
            tokens = torch.empty(rows, dtype=torch.int64)
            ok = avx2.asyncllm_panel_argmax(
                x.data_ptr(), x_stride, panels["avx2"].data_ptr(), tokens.data_ptr(), rows, out_features,
                in_features, valid,
            )  # fmt: skip
            assert ok == 1
            assert torch.equal(tokens, exact[:, :valid].argmax(-1)), (rows, valid)


def test_avx2_argmax_reports_nan_and_takes_the_first_of_equal_columns() -> None:
    library = _avx2_library()
    weight = torch.zeros(100, 4)
    weight[[10, 40, 60, 70], 0] = 1.0  # four columns with the largest output: two strips of one panel, two panels
    panels = torch.empty(-(-100 // gemm_cpu.PANEL_COLUMNS) * gemm_cpu.PANEL_COLUMNS * 4)
    library.asyncllm_panel_pack(weight.data_ptr(), panels.data_ptr(), 100, 4)
    x = torch.tensor([[2.0, 0.0, 0.0, 0.0], [2.0, float("nan"), 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    tokens = torch.empty(3, dtype=torch.int64)
    assert library.asyncllm_panel_argmax(x.data_ptr(), 4, panels.data_ptr(), tokens.data_ptr(), 3, 100, 4, 100) == 1
    assert tokens.tolist() == [10, -1, 0]  # the first of equal maxima; NaN outputs (NaN x 0); the first 0
    weight[:, 0] = -1.0
    library.asyncllm_panel_pack(weight.data_ptr(), panels.data_ptr(), 100, 4)
    x = torch.tensor([[float("inf"), 0.0, 0.0, 0.0]])  # every output -inf
    assert library.asyncllm_panel_argmax(x.data_ptr(), 4, panels.data_ptr(), tokens.data_ptr(), 1, 100, 4, 100) == 1
    assert tokens[0].item() == 0  # as torch.argmax: the first column


SMALLEST_NORMAL = 2.0**-126


def _as_avx512_bf16_reads(values: torch.Tensor) -> torch.Tensor:
    """``values`` rounded to bfloat16 (to nearest even) and back, subnormal values (before and after) as zero."""
    values = torch.where(values.abs() < SMALLEST_NORMAL, values * 0.0, values)
    rounded = values.bfloat16().float()
    return torch.where(rounded.abs() < SMALLEST_NORMAL, rounded * 0.0, rounded)


@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(100, 37), (48, 1), (47, 8), (1000, 576), (576, 1536)],  # partial panels and strips, odd widths (padded pairs)
)
def test_avx2_bfloat16_panels_chain_the_rounded_products(out_features: int, in_features: int) -> None:
    library = _avx2_library()
    generator = torch.Generator().manual_seed(out_features * 5 + in_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    weight[0, 0] = 1e-39  # subnormal in float32 and in bfloat16: read as zero
    weight[-1, -1] = -3e-39
    weight[1, 0] = torch.tensor(0x007FFFFF, dtype=torch.int32).view(torch.float32)  # rounds up to 2**-126: still zero
    padded = -(-out_features // gemm_cpu.PANEL_COLUMNS) * gemm_cpu.PANEL_COLUMNS
    panels = torch.empty(padded * 2 * -(-in_features // 2), dtype=torch.bfloat16)
    library.asyncllm_panel_pack_bf16(weight.data_ptr(), panels.data_ptr(), out_features, in_features)
    assert panels.view(torch.int16)[1].item() == 0  # AVX2's layout: input 0 of column 1, the subnormal float32 weight
    # A bfloat16 weight packs as its values given in float32 (2**-126, which 0x007FFFFF rounds to, is normal there).
    source = weight.bfloat16()
    source_values = source.float()
    as_float32, from_bfloat16 = torch.empty_like(panels), torch.empty_like(panels)
    library.asyncllm_panel_pack_bf16_from_bf16(source.data_ptr(), from_bfloat16.data_ptr(), out_features, in_features)
    library.asyncllm_panel_pack_bf16(source_values.data_ptr(), as_float32.data_ptr(), out_features, in_features)
    assert torch.equal(as_float32.view(torch.int16), from_bfloat16.view(torch.int16))
    rounded_weight = _as_avx512_bf16_reads(weight)
    for rows in (1, 5, 6, 7, 31, 32, 64, 257):  # around the row blocks, the 30-row groups, the 256-row pass
        x_stride = in_features + 3
        x = torch.randn(rows, x_stride, generator=generator)
        x[0, 0] = 2e-39  # a subnormal input: read as zero
        exact = _reference(_as_avx512_bf16_reads(x).contiguous(), x_stride, rounded_weight)
        out = torch.full((rows, out_features + 3), 7.0)
        assert library.asyncllm_panel_matmul_bf16(
            x.data_ptr(), x_stride, panels.data_ptr(), out.data_ptr(), out_features + 3, rows, out_features,
            in_features,
        ) == 1  # fmt: skip
        assert torch.equal(out[:, :out_features], exact), rows
        assert (out[:, out_features:] == 7.0).all()
        tokens = torch.empty(rows, dtype=torch.int64)
        assert library.asyncllm_panel_argmax_bf16(
            x.data_ptr(), x_stride, panels.data_ptr(), tokens.data_ptr(), rows, out_features, in_features,
            out_features,
        ) == 1  # fmt: skip
        assert torch.equal(tokens, exact.argmax(-1)), rows


def test_avx2_bfloat16_rounding_keeps_nan_and_infinity() -> None:
    library = _avx2_library()
    weight = torch.ones(48, 20)
    panels = torch.empty(48 * 20, dtype=torch.bfloat16)
    library.asyncllm_panel_pack_bf16(weight.data_ptr(), panels.data_ptr(), 48, 20)
    x = torch.zeros(4, 20)
    x[1, 3], x[2, 17] = float("nan"), float("inf")  # in the vector part and in the scalar tail of a row
    x[3, :] = 3.4e38  # rounds up to infinity in bfloat16
    out = torch.empty(4, 48)
    assert library.asyncllm_panel_matmul_bf16(x.data_ptr(), 20, panels.data_ptr(), out.data_ptr(), 48, 4, 48, 20) == 1
    assert bool((out[0] == 0).all()) and bool(out[1].isnan().all())
    assert bool((out[2] == float("inf")).all()) and bool((out[3] == float("inf")).all())
