"""Packed linear layers (asyncllm.models._linear, .gemm_cpu) against F.linear, and their use by the runner."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu import _greedy_head as greedy_head_cpu
from asyncllm.backends.cpu import _native as native
from asyncllm.models import _linear as linear
from asyncllm.models._linear import (
    PANEL_MAX_ROWS,
    Linear,
    PackedWeight,
    best_packed_format,
    format_available,
    packed_gemm_available,
)

needs_panels = pytest.mark.skipif(not gemm_cpu.available(), reason="the panel GEMM needs x86 with AVX-512 or AVX2")


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


def test_panels_available_on_avx512_and_avx2_machines() -> None:
    # CI's machines have AVX-512 or AVX2: the default CPU path must be exercised there, not silently skipped.
    flags = native.cpu_flags()
    if platform.machine() in ("x86_64", "AMD64") and ("avx512f" in flags or {"avx2", "fma"} <= flags):
        assert gemm_cpu.available()
        # MKL's fast kernels: Intel's with AVX-512
        both = packed_gemm_available() and native.cpu_vendor() == "GenuineIntel" and "avx512f" in flags
        assert best_packed_format(1 << 20) == ("both" if both else "panels")
        assert best_packed_format(1 << 60) == "panels"  # no room for a second copy: the panels alone


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
@pytest.mark.parametrize("bfloat16", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_panels_give_every_thread_count_the_same_outputs(bfloat16: bool, threads: int) -> None:
    # Threads claim panels one at a time (and one ahead): every panel must be computed exactly once, by
    # whichever thread, whether there are fewer panels than threads (1), or a few more (5, 7 with a partial one).
    if bfloat16 and not gemm_cpu.bfloat16_available():
        pytest.skip("no bfloat16 panels here")
    generator = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    for out_features in (40, 240, 300):
        weight = torch.randn(out_features, 72, generator=generator)
        panels = gemm_cpu.PanelWeight(weight, bfloat16=bfloat16)
        x = torch.randn(37, 72, generator=generator)
        try:
            torch.set_num_threads(1)
            alone, alone_tokens = panels.linear(x), panels.argmax(x)
            torch.set_num_threads(threads)
            shared, shared_tokens = panels.linear(x), panels.argmax(x)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(shared, alone)  # each output the same chain of operations, in the same order
        assert torch.equal(shared_tokens, alone_tokens)
        assert torch.equal(alone_tokens, alone.argmax(-1))
        expected = weight.to(torch.bfloat16).float() if bfloat16 else weight
        reference = x.to(torch.bfloat16).float() if bfloat16 else x
        torch.testing.assert_close(alone, F.linear(reference, expected), rtol=1e-4, atol=1e-3)


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


@pytest.mark.parametrize("packed_format", [None, "both", "panels", "mkl"])
def test_linear_pack_releases_the_weight_and_keeps_the_results(packed_format: str | None) -> None:
    if packed_format is not None and not format_available(packed_format):  # type: ignore[arg-type]
        pytest.skip(f"{packed_format} is unavailable here")
    layer = Linear(48, 40, bias=True)
    with torch.no_grad():
        inputs = [torch.randn(rows, 48) for rows in (1, 6, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1, 300)]
        before = [layer(x) for x in inputs]
        assert layer.pack(release=True, packed_format=packed_format)  # type: ignore[arg-type]
        assert layer.packed_format == (packed_format or best_packed_format(48 * 40 * 4))
        assert layer.weight.numel() == 0  # the unpacked copy's memory is given back
        for x, expected in zip(inputs, before, strict=True):
            torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not format_available("both"), reason="needs both the panel GEMM and MKL's packed GEMM")
def test_both_formats_split_inputs_by_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []
    panel_matmul, packed_matmul = gemm_cpu.panel_matmul, linear.packed_matmul

    def on_panels(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(("panels", x.shape[0]))
        return panel_matmul(x, *args)  # type: ignore[arg-type]

    def on_mkl(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(("mkl", x.shape[0]))
        return packed_matmul(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(gemm_cpu, "panel_matmul", on_panels)
    monkeypatch.setattr(linear, "packed_matmul", on_mkl)
    layer = Linear(32, 16, bias=False)
    assert layer.pack(release=False, packed_format="both")
    assert layer.packed_weight is not None and layer.panel_weight is not None
    with torch.no_grad():
        for rows in (1, PANEL_MAX_ROWS, PANEL_MAX_ROWS + 1, 2048):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-4, atol=1e-4)
    # decode-sized inputs on the panels (the weights' memory traffic decides), prefill-sized on MKL's
    assert calls == [("panels", 1), ("panels", PANEL_MAX_ROWS), ("mkl", PANEL_MAX_ROWS + 1), ("mkl", 2048)]


def test_linear_without_packing_is_nn_linear() -> None:
    layer = Linear(8, 4).to(torch.float64)
    assert not layer.pack(release=True)  # float64: left alone
    assert not layer.packed and layer.weight.shape == (4, 8)
    x = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    # state dict names are nn.Linear's, so HF checkpoints load unchanged
    assert set(Linear(8, 4).state_dict()) == {"weight", "bias"}


@pytest.mark.parametrize("packed_gemm", [True, False, "both", "panels", "mkl"])
def test_runner_packs_every_linear_layer(tiny_llama, packed_gemm: bool | str) -> None:  # type: ignore[no-untyped-def]
    from asyncllm.worker._model_runner import TorchModelRunner
    expected = best_packed_format(1 << 20) if packed_gemm is True else packed_gemm or None  # a tiny model
    if isinstance(expected, str) and not format_available(expected):  # type: ignore[arg-type]
        pytest.skip(f"{expected} is unavailable here")
    runner = TorchModelRunner(tiny_llama, device="cpu", dtype="float32", kv_cache_blocks=8, packed_gemm=packed_gemm)  # type: ignore[arg-type]
    info = runner.load()
    assert runner.model is not None
    layers = [m for m in runner.model.modules() if isinstance(m, Linear)]
    # per layer: qkv, o, gate_up, down; plus lm_head
    assert len(layers) == 4 * runner.model.spec.num_layers + 1
    assert runner.num_packed_layers == (len(layers) if expected else 0)
    model = runner.model
    # Beside a greedy head the output projection keeps the panels alone: the bounded head where AMX or
    # AVX512-BF16 runs (backends.cpu._greedy_head), elsewhere the argmax fused into the panels.
    head_format = "panels" if model.greedy_head is not None else expected
    assert all(m.packed == bool(expected) and m.packed_format == expected for m in layers if m is not model.lm_head)
    assert model.lm_head.packed_format == head_format
    assert (model.greedy_head is not None) == (expected in ("both", "panels"))
    if model.greedy_head is not None:
        head_type = greedy_head_cpu.GreedyHead if greedy_head_cpu.available() else gemm_cpu.PanelArgmaxHead
        assert isinstance(model.greedy_head, head_type)
    assert runner.packed_format == expected
    assert (f"{expected} GEMM" in info.description) == bool(expected)
    assert not any(key.endswith("packed_weight") for key in runner.model.state_dict())  # not persistent
    runner.close()


@pytest.mark.parametrize("bounded", [True, False])
def test_no_greedy_head_packing_where_no_head_runs(tiny_cache, monkeypatch, bounded: bool) -> None:  # type: ignore[no-untyped-def]
    """A model whose layer is not Llama's (olmo2) gets no greedy head: its output projection keeps the format asked
    for and gives back its float32 weight, as if ``greedy_head`` were off (neither head's packing for nothing)."""
    from asyncllm.testing.tiny_models import tiny_model_path
    from asyncllm.worker._model_runner import TorchModelRunner

    if not format_available("both"):
        pytest.skip("both packed formats are unavailable here")
    if bounded and not greedy_head_cpu.available():
        pytest.skip("the bounded head's units (AMX or AVX512-BF16) are unavailable here")
    if not bounded:
        monkeypatch.setattr(greedy_head_cpu, "available", lambda *args: False)
    path = tiny_model_path(tiny_cache, "olmo2", tie_word_embeddings=False)
    runner = TorchModelRunner(path, device="cpu", dtype="float32", kv_cache_blocks=8, packed_gemm="both")
    runner.load()
    try:
        model = runner.model
        assert model is not None and not model.spec.llama_layer and model.greedy_head is None
        assert model.lm_head.packed_format == "both" and model.lm_head.weight.numel() == 0
    finally:
        runner.close()


def test_gemm_benchmark_quick(tiny_llama, load_benchmark, capsys) -> None:  # type: ignore[no-untyped-def]
    forward = load_benchmark("forward")
    assert forward.main(["--gemm", "--quick", "--repeats", "1", "--model", str(tiny_llama)]) == 0
    out = capsys.readouterr().out
    columns = "F.linear / MKL packed / panels" if gemm_cpu.available() else "F.linear / MKL packed"
    assert f"| matmul (GFLOPS: {columns}) | 1 rows" in out
    assert "| lm_head [" in out and "| gate_up [" in out


@pytest.mark.parametrize("packed_format", ["both", "panels", "mkl"])
def test_compiled_graphs_call_the_packed_weight(packed_format: str) -> None:
    if not format_available(packed_format):  # type: ignore[arg-type]
        pytest.skip(f"{packed_format} is unavailable here")
    layer = Linear(24, 40, bias=True)
    inputs = [torch.randn(5, 24), torch.randn(PANEL_MAX_ROWS + 3, 24)]
    with torch.no_grad():
        expected = [layer(x) for x in inputs]
        assert layer.pack(release=True, packed_format=packed_format)  # type: ignore[arg-type]
        # aot_eager traces through dynamo and AOT autograd like inductor does, without generating code:
        # the custom operator and its fake implementation are what is under test.
        compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
        for x, want in zip(inputs, expected, strict=True):
            torch.testing.assert_close(compiled(x), want, rtol=1e-4, atol=1e-4)
