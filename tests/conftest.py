"""Shared fixtures: both anyio backends, tiny models built locally once per session, benchmark scripts."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import torch

# Triton kernels (tests/backends/triton, the triton attention backend) run in triton's CPU interpreter when
# there is no GPU. The switch is read when triton is imported, and importing transformers' model
# classes (below) already imports it through torch._dynamo, so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

from asyncllm.testing import import_path
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
        return import_path(folder / f"{name}.py", f"asyncllm_bench_{name}")

    return load
