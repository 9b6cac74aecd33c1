"""The one-pass SiLU-times-up kernel (asyncllm.backends.cpu._activation): torch's bits, or not used at all."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from asyncllm.backends.cpu import _activation as activation_cpu
from asyncllm.backends.cpu import _native as native

needs_kernel = pytest.mark.skipif(
    not activation_cpu.available(), reason="needs x86 with AVX-512 or AVX2 and a C compiler"
)


def test_available_on_avx512_and_avx2_machines() -> None:
    # CI's machines have AVX-512 or AVX2: the lean forward's default must run the kernel there, not skip it.
    flags = native.cpu_flags()
    vectors = "avx512f" in flags or {"avx2", "fma"} <= flags
    if platform.machine() in ("x86_64", "AMD64") and vectors and native.compiler():
        assert activation_cpu.available()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 64, 300])  # 300 x 1,536 crosses the kernel's OpenMP threshold
@pytest.mark.parametrize("width", [1536, 1000, 37, 3])  # whole vectors, a tail of 8, of 5, a tail alone
def test_same_bits_as_torch_on_a_gate_up_output(rows: int, width: int) -> None:
    generator = torch.Generator().manual_seed(rows * 10_000 + width)
    gate_up = torch.randn(rows, 2 * width, generator=generator) * 8
    expected = gate_up.clone()
    F.silu(expected[:, :width], inplace=True)
    expected[:, :width].mul_(expected[:, width:])
    result = activation_cpu.silu_mul_(gate_up[:, :width], gate_up[:, width:])
    assert result.data_ptr() == gate_up.data_ptr()
    assert torch.equal(gate_up, expected)  # the product in the gate half, up untouched


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize(("rows", "width"), [(33, 1000), (2051, 1536), (37, 4864), (9, 11008)])
def test_same_bits_as_torch_whatever_torch_splits_between_threads(threads: int, rows: int, width: int) -> None:
    # Each of torch's threads restarts its vector loop at its first element, so the stretches where it
    # falls back to expf depend on where the split lands in a row (mid-row at most of these shapes).
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(threads)) * 8
        expected = gate_up.clone()
        F.silu(expected[:, :width], inplace=True)
        expected[:, :width].mul_(expected[:, width:])
        activation_cpu.silu_mul_(gate_up[:, :width], gate_up[:, width:])
        assert torch.equal(gate_up, expected)
    finally:
        torch.set_num_threads(previous)


def test_torch_piece_follows_torchs_split() -> None:
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert activation_cpu.torch_piece(32_767) == 32_767  # under the grain: one thread
        assert activation_cpu.torch_piece(40_000) == 20_000  # two pieces, not three
        assert activation_cpu.torch_piece(100_001) == 33_334
        torch.set_num_threads(1)
        assert activation_cpu.torch_piece(100_001) == 100_001
    finally:
        torch.set_num_threads(previous)


@needs_kernel
def test_same_bits_as_torch_on_special_values() -> None:
    special = [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, -87.5, float("inf"), float("-inf")]
    gate = torch.tensor(special * 3)  # 33: two whole vectors and a tail
    up = torch.linspace(-2, 2, gate.numel())
    expected = F.silu(gate) * up
    activation_cpu.silu_mul_(gate.view(1, -1), up.view(1, -1))
    torch.testing.assert_close(gate, expected, rtol=0, atol=0, equal_nan=True)  # silu(-inf) is nan in both
    gate = torch.tensor([float("nan")] * 17)
    activation_cpu.silu_mul_(gate.view(1, -1), torch.ones(1, 17))
    assert bool(gate.isnan().all())


@needs_kernel
def test_rejects_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="float32"):
        activation_cpu.silu_mul_(torch.ones(2, 4, dtype=torch.float64), torch.ones(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="one row stride"):
        activation_cpu.silu_mul_(torch.ones(2, 4), torch.ones(2, 8)[:, :4])
    with pytest.raises(ValueError, match="rows contiguous"):
        activation_cpu.silu_mul_(torch.ones(4, 2).t(), torch.ones(4, 2).t())
    empty = torch.ones(0, 4)
    assert activation_cpu.silu_mul_(empty, empty) is empty
