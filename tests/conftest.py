"""Shared fixtures: both anyio backends, tiny models built locally once per session, benchmark scripts."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from types import ModuleType

import torch

# Triton kernels (tests/kernels, the triton attention backend) run in triton's CPU interpreter when
# there is no GPU. The switch is read when triton is imported, and importing transformers' model
# classes (below) already imports it through torch._dynamo, so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

from asyncllm.testing.tiny_models import tiny_model_path


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_llama(tiny_cache: Path) -> Path:
    return tiny_model_path(tiny_cache, "llama")


@pytest.fixture(scope="session")
def load_benchmark() -> Callable[[str], ModuleType]:
    """Import ``benchmarks/<name>.py`` by path, once per name (the scripts are not a package)."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"

    def load(name: str) -> ModuleType:
        module_name = f"asyncllm_bench_{name}"
        if module_name not in sys.modules:
            spec = importlib.util.spec_from_file_location(module_name, folder / f"{name}.py")
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        return sys.modules[module_name]

    return load
