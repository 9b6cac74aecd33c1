"""Structured output under attack: cancellation, close, n > 1, odd models; each test a bug once found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import asyncllm
from asyncllm import Engine, SamplingParams

pytestmark = pytest.mark.anyio


def _without_eos(tiny_llama: Path, folder: Path) -> Path:
    """A copy of the tiny model whose configs name no end-of-sequence id."""
    shutil.copytree(tiny_llama, folder)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = None
        (folder / name).write_text(json.dumps(config))
    return folder


async def test_a_grammar_backend_that_cannot_be_built_fails_the_request_not_the_engine(
    tiny_llama: Path, tmp_path: Path
) -> None:
    model = _without_eos(tiny_llama, tmp_path / "no-eos")
    async with Engine.open(model) as engine:
        params = SamplingParams(max_tokens=4, structured_output={"regex": "[0-9]+"})
        with pytest.raises(asyncllm.StructuredOutputError, match="end-of-sequence"):
            await engine.generate("x", params)
        stream = engine.stream("x", SamplingParams(max_tokens=4, structured_output={"regex": "[a-z]+"}))
        with pytest.raises(asyncllm.StructuredOutputError, match="end-of-sequence"):
            async with stream:
                async for _ in stream:
                    pass
        assert (await engine.generate("x", SamplingParams(max_tokens=3))).samples[0].finish_reason == "length"
