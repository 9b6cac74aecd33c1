"""MKL-packed linear layers (asyncllm.layers.linear) against F.linear, and their use by the runner."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from asyncllm.layers.linear import Linear, PackedWeight, packed_gemm_available


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


def test_linear_pack_releases_the_weight_and_keeps_the_results() -> None:
    layer = Linear(48, 40, bias=True)
    x = torch.randn(6, 48)
    with torch.no_grad():
        before = layer(x)
        assert layer.pack(release=True)
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


@pytest.mark.parametrize("packed_gemm", [True, False])
def test_runner_packs_every_linear_layer(tiny_llama, packed_gemm: bool) -> None:  # type: ignore[no-untyped-def]
    from asyncllm.model_runner import TorchModelRunner

    runner = TorchModelRunner(tiny_llama, device="cpu", dtype="float32", kv_cache_blocks=8, packed_gemm=packed_gemm)
    runner.load()
    assert runner.model is not None
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    # per layer: qkv, o, gate_up, down; plus lm_head
    assert len(layers) == 4 * runner.model.spec.num_layers + 1
    assert runner.num_packed_layers == (len(layers) if packed_gemm else 0)
    assert all(m.packed == packed_gemm for m in layers)
    assert not any(key.endswith("packed_weight") for key in runner.model.state_dict())  # not persistent
    runner.close()


def test_gemm_benchmark_quick(tiny_llama, load_benchmark, capsys) -> None:  # type: ignore[no-untyped-def]
    forward = load_benchmark("forward")
    assert forward.main(["--gemm", "--quick", "--repeats", "1", "--model", str(tiny_llama)]) == 0
    out = capsys.readouterr().out
    assert "| matmul (GFLOPS: F.linear / packed) | 1 rows" in out
    assert "| lm_head [" in out and "| gate_up [" in out
