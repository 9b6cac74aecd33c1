"""``benchmarks/gpu.py`` imports cleanly and answers ``--help`` anywhere; without CUDA it says why and exits 2.

Its fused-norm comparison also runs here, on a tiny model with the kernels in triton's interpreter
(eager only, one clock reading per call): the flow, not the numbers.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("asyncllm_gpu_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _load().main(["--help"])
    assert exit_info.value.code == 0
    assert "--enforce-eager" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark would really run")
def test_without_cuda_exits_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert _load().main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def _once_ms(function: Callable[[], object]) -> float:
    start = time.perf_counter()
    function()
    return (time.perf_counter() - start) * 1e3


def test_fused_norm_comparison_runs_on_a_tiny_model(tiny_llama: Path) -> None:
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")
    from asyncllm.worker._model_runner import TorchModelRunner
    gpu = torch.cuda.is_available()
    runner = TorchModelRunner(
        tiny_llama, device="cuda" if gpu else "cpu", dtype="float32", block_size=4, kv_cache_blocks=4,
        attention_backend="triton", enforce_eager=True,
    )  # fmt: skip
    runner.load()
    rows = _load().fused_norm_ab(
        runner.model, runner.kv_caches, block_size=4, batches=(1, 2), context=7, timer=_once_ms, graphs=gpu
    )
    assert [(row["batch"], row["mode"]) for row in rows] == [
        (b, mode) for b in (1, 2) for mode in (("eager", "graph") if gpu else ("eager",))
    ]
    assert all(row["fused_ms"] > 0 and row["unfused_ms"] > 0 for row in rows)
    assert runner.model is not None and runner.model.fused_norm  # switched back on
    runner.close()
