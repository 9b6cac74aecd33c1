"""Shared fixtures: both anyio backends, and tiny models built locally once per session."""

from __future__ import annotations

import os

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
