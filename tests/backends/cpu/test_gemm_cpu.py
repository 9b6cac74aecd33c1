"""The panel GEMM's two micro-kernels (asyncllm.backends.cpu._gemm): AVX2's gives AVX-512's bits.

The library is built a second time with AVX-512 switched off (``-mno-avx512f``), which compiles the AVX2
micro-kernel on any x86 CPU with AVX2 and FMA; on an AVX2-only machine both builds are that one.
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
    library = native.load("panel_gemm_avx2", gemm_cpu._SOURCE, gemm_cpu._SIGNATURES, ("-mno-avx512f",))
    assert library is not None
    return library


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
    for rows in (1, 5, 6, 7, 29, 30, 31, 64, 257):  # around the 6-row block, the 30-row group, the 256-row pass
        x = torch.randn(rows, in_features, generator=generator)
        outs = {name: torch.full((rows, out_features + 3), 7.0) for name in panels}  # 3 columns past the outputs
        for name, library in (("avx2", avx2), ("default", default)):
            library.asyncllm_panel_matmul(
                x.data_ptr(), in_features, panels[name].data_ptr(), outs[name].data_ptr(), out_features + 3,
                rows, out_features, in_features,
            )  # fmt: skip
        assert torch.equal(outs["avx2"], outs["default"]), rows
        assert (outs["avx2"][:, out_features:] == 7.0).all()  # nothing written past the last column
        torch.testing.assert_close(outs["avx2"][:, :out_features], x @ weight.T, rtol=1e-4, atol=1e-4)
        for valid in (out_features, max(1, out_features - 40)):
            tokens = torch.empty(rows, dtype=torch.int64)
            ok = avx2.asyncllm_panel_argmax(
                x.data_ptr(), in_features, panels["avx2"].data_ptr(), tokens.data_ptr(), rows, out_features,
                in_features, valid,
            )  # fmt: skip
            assert ok == 1
            assert torch.equal(tokens, outs["default"][:, :valid].argmax(-1)), (rows, valid)


def test_avx2_argmax_reports_nan_and_takes_the_first_of_equal_columns() -> None:
    library = _avx2_library()
    weight = torch.zeros(100, 4)
    weight[[10, 60, 70], 0] = 1.0  # three columns with the largest output, in two panels
    panels = torch.empty(-(-100 // gemm_cpu.PANEL_COLUMNS) * gemm_cpu.PANEL_COLUMNS * 4)
    library.asyncllm_panel_pack(weight.data_ptr(), panels.data_ptr(), 100, 4)
    x = torch.tensor([[2.0, 0.0, 0.0, 0.0], [2.0, float("nan"), 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]])
    tokens = torch.empty(3, dtype=torch.int64)
    assert library.asyncllm_panel_argmax(x.data_ptr(), 4, panels.data_ptr(), tokens.data_ptr(), 3, 100, 4, 100) == 1
    assert tokens.tolist() == [10, -1, 0]  # the first of equal maxima; NaN outputs (NaN x 0); the first 0
