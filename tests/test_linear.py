"""Packed linear layers (asyncllm.layers.linear, .gemm_cpu) against F.linear, and their use by the runner."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from asyncllm.layers import gemm_cpu, native
from asyncllm.layers.linear import Linear, PackedWeight, best_packed_format, packed_gemm_available

needs_panels = pytest.mark.skipif(not gemm_cpu.available(), reason="the panel GEMM needs x86 with AVX-512")


def test_available_on_x86_torch_builds() -> None:
    # torch's x86 CPU wheels link MKL statically and export the packed GEMM: CI must exercise it.
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.mkl.is_available():
        assert packed_gemm_available()


@pytest.mark.parametrize("rows", [0, 1, 3, 16, 17, 64, 65, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 80), (1024, 512), (8, 1536)])
def test_packed_matches_f_linear(rows: int, out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    packed = PackedWeight(weight)
    torch.testing.assert_close(packed.linear(x), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


def test_packed_takes_batched_and_strided_inputs() -> None:
    weight = torch.randn(64, 32)
    packed = PackedWeight(weight)
    x = torch.randn(3, 5, 32)
    assert packed.linear(x).shape == (3, 5, 64)
    torch.testing.assert_close(packed.linear(x), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    strided = torch.randn(32, 9).t()  # [9, 32], not contiguous
    torch.testing.assert_close(packed.linear(strided), F.linear(strided, weight), rtol=1e-4, atol=1e-4)


def test_packed_rejects_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="float32"):
        PackedWeight(torch.randn(4, 4, dtype=torch.float64))
    packed = PackedWeight(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        packed.linear(torch.randn(2, 7))
    with pytest.raises(ValueError, match="float32"):
        packed.linear(torch.randn(2, 8, dtype=torch.bfloat16))


def test_panels_available_on_avx512_machines() -> None:
    # CI's machines have AVX-512: the default CPU path must be exercised there, not silently skipped.
    if platform.machine() in ("x86_64", "AMD64") and "avx512f" in native.cpu_flags():
        assert gemm_cpu.available()
        assert best_packed_format() == "panels"


@needs_panels
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 8, 9, 16, 17, 64, 65, 300, 600])
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    # whole panels; a partial last panel (49 = 48 + 1, 100 = 2 x 48 + 4, 8 < 16); odd input widths
    [(96, 80), (1024, 512), (8, 1536), (49, 37), (100, 16)],
)
def test_panels_match_f_linear(rows: int, out_features: int, in_features: int) -> None:
    # 300 and 600 rows span several 256-row blocks with a partial last one; 1-7 rows are the
    # micro-kernel's short cases.
    generator = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    panels = gemm_cpu.PanelWeight(weight)
    torch.testing.assert_close(panels.linear(x), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(panels.linear(x, bias), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


@needs_panels
def test_panels_take_batched_and_strided_inputs() -> None:
    weight = torch.randn(64, 32)
    panels = gemm_cpu.PanelWeight(weight)
    x = torch.randn(3, 5, 32)
    assert panels.linear(x).shape == (3, 5, 64)
    torch.testing.assert_close(panels.linear(x), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    wide = torch.randn(11, 40)[:, 4:36]  # rows 40 floats apart: read in place with their stride
    torch.testing.assert_close(panels.linear(wide), F.linear(wide, weight), rtol=1e-4, atol=1e-4)
    columns = torch.randn(32, 9).t()  # [9, 32] with columns contiguous: copied first
    torch.testing.assert_close(panels.linear(columns), F.linear(columns, weight), rtol=1e-4, atol=1e-4)


@needs_panels
def test_panels_reject_what_they_cannot_run() -> None:
    with pytest.raises(ValueError, match="float32"):
        gemm_cpu.PanelWeight(torch.randn(4, 4, dtype=torch.float64))
    panels = gemm_cpu.PanelWeight(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        panels.linear(torch.randn(2, 7))
    with pytest.raises(ValueError, match="float32"):
        panels.linear(torch.randn(2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("packed_format", [None, "panels", "mkl"])
def test_linear_pack_releases_the_weight_and_keeps_the_results(packed_format: str | None) -> None:
    if packed_format == "panels" and not gemm_cpu.available():
        pytest.skip("the panel GEMM needs x86 with AVX-512")
    if packed_format == "mkl" and not packed_gemm_available():
        pytest.skip("this torch build does not export MKL's packed GEMM")
    layer = Linear(48, 40, bias=True)
    x = torch.randn(6, 48)
    with torch.no_grad():
        before = layer(x)
        assert layer.pack(release=True, packed_format=packed_format)  # type: ignore[arg-type]
        assert layer.packed_format == (packed_format or best_packed_format())
        assert layer.weight.numel() == 0  # the unpacked copy's memory is given back
        torch.testing.assert_close(layer(x), before, rtol=1e-4, atol=1e-4)


def test_linear_without_packing_is_nn_linear() -> None:
    layer = Linear(8, 4).to(torch.float64)
    assert not layer.pack(release=True)  # float64: left alone
    assert not layer.packed and layer.weight.shape == (4, 8)
    x = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    # state dict names are nn.Linear's, so HF checkpoints load unchanged
    assert set(Linear(8, 4).state_dict()) == {"weight", "bias"}


@pytest.mark.parametrize("packed_gemm", [True, False, "panels", "mkl"])
def test_runner_packs_every_linear_layer(tiny_llama, packed_gemm: bool | str) -> None:  # type: ignore[no-untyped-def]
    from asyncllm.model_runner import TorchModelRunner

    expected = best_packed_format() if packed_gemm is True else packed_gemm or None
    if (expected == "panels" and not gemm_cpu.available()) or (expected == "mkl" and not packed_gemm_available()):
        pytest.skip(f"{expected} is unavailable here")
    runner = TorchModelRunner(tiny_llama, device="cpu", dtype="float32", kv_cache_blocks=8, packed_gemm=packed_gemm)  # type: ignore[arg-type]
    info = runner.load()
    assert runner.model is not None
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    # per layer: qkv, o, gate_up, down; plus lm_head
    assert len(layers) == 4 * runner.model.spec.num_layers + 1
    assert runner.num_packed_layers == (len(layers) if expected else 0)
    assert all(m.packed == bool(expected) and m.packed_format == expected for m in layers)
    assert runner.packed_format == expected
    assert (f"{expected} GEMM" in info.description) == bool(expected)
    assert not any(key.endswith("packed_weight") for key in runner.model.state_dict())  # not persistent
    runner.close()


def test_gemm_benchmark_quick(tiny_llama, load_benchmark, capsys) -> None:  # type: ignore[no-untyped-def]
    forward = load_benchmark("forward")
    assert forward.main(["--gemm", "--quick", "--repeats", "1", "--model", str(tiny_llama)]) == 0
    out = capsys.readouterr().out
    columns = "F.linear / MKL packed / panels" if gemm_cpu.available() else "F.linear / MKL packed"
    assert f"| matmul (GFLOPS: {columns}) | 1 rows" in out
    assert "| lm_head [" in out and "| gate_up [" in out


@pytest.mark.parametrize("packed_format", ["panels", "mkl"])
def test_compiled_graphs_call_the_packed_weight(packed_format: str) -> None:
    if not (gemm_cpu.available() if packed_format == "panels" else packed_gemm_available()):
        pytest.skip(f"{packed_format} is unavailable here")
    layer = Linear(24, 40, bias=True)
    x = torch.randn(5, 24)
    with torch.no_grad():
        expected = layer(x)
        assert layer.pack(release=True, packed_format=packed_format)  # type: ignore[arg-type]
        # aot_eager traces through dynamo and AOT autograd like inductor does, without generating code:
        # the custom operator and its fake implementation are what is under test.
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-4)
