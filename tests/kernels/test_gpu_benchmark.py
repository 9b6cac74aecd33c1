"""``benchmarks/gpu.py`` imports cleanly and answers ``--help`` anywhere; without CUDA it says why and exits 2."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


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
