"""Structured output under attack: cancellation, close, n > 1, odd models; each test a bug once found."""

from __future__ import annotations

import decimal
import json
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from transformers import AutoTokenizer

import asyncllm
from asyncllm import Engine, SamplingParams, StructuredOutput
from asyncllm.executor._runner import SequenceInput
from asyncllm.structured._llguidance import LLGuidanceBackend
from asyncllm.worker._sampler import Sampler

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


async def test_recomputes_whose_prefix_hit_covers_output_tokens_keep_the_engine_alive(tiny_llama: Path) -> None:
    # Identical greedy constrained requests under a tight cache and token budget: a request is preempted
    # mid-recompute (after one chunk), and its next recompute hits cached blocks that hold its own
    # output beyond that chunk. The sampler's history must still know those positions; it used to cut
    # them at the chunk and the engine died ("positions before 56 were never fed").
    params = SamplingParams(max_tokens=150, temperature=0.0, structured_output={"regex": "[a-z]{40,120}"})
    options = {"kv_cache_blocks": 40, "block_size": 8, "max_num_batched_tokens": 8, "max_model_len": 200}
    async with Engine.open(tiny_llama, **options) as engine:  # type: ignore[arg-type]
        texts: list[str] = []

        async def one() -> None:
            sample = (await engine.generate("hello hello", params)).samples[0]
            assert sample.finish_reason == "stop"
            texts.append(sample.text)

        async with anyio.create_task_group() as group:
            for _ in range(12):
                group.start_soon(one)
        assert engine.statistics().num_preemptions > 0
    assert len(texts) == 12 and all(re.fullmatch("[a-z]{40,120}", text) for text in texts)


def test_the_history_keeps_positions_past_a_recomputed_chunk(tiny_llama: Path) -> None:
    # The sampler-level shape of the bug above: fed in full, recomputed from 48 for 4 tokens, then
    # recomputed from a hit at 56 (past the chunk, in the output).
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    backend = LLGuidanceBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = backend.compile(StructuredOutput(regex="[a-z]{40,120}"))
    sampler = Sampler(torch.device("cpu"), backend.vocab_size, frozenset({tokenizer.eos_token_id}))
    prompt = tokenizer.encode("hello hello", add_special_tokens=False)
    output = tokenizer.encode("abcdefghij" * 8, add_special_tokens=False)[: 60 - len(prompt)]
    history = prompt + output

    def feed(start: int, end: int, sample: bool) -> None:
        seq = SequenceInput(
            request_id=1,
            token_ids=history[start:end],
            start_position=start,
            block_table=[],
            sample=sample,
            params=SamplingParams(temperature=0.0, max_tokens=100),
            num_generated=end - len(prompt) - (1 if sample else 0),
            prompt_token_ids=prompt,
            grammar=grammar,
        )
        sampler.record([seq])
        if sample:
            sampler.sample(torch.zeros(1, backend.vocab_size), [seq])

    feed(0, 57, True)
    feed(48, 52, False)
    feed(56, 60, True)
    assert not sampler.failed


@pytest.fixture
def held_compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every grammar compile waits in its worker thread until the event is set (set at teardown)."""
    release = threading.Event()
    real_compile = LLGuidanceBackend.compile

    def held_compile(self: LLGuidanceBackend, spec: StructuredOutput) -> Any:
        assert release.wait(timeout=60)
        return real_compile(self, spec)

    monkeypatch.setattr(LLGuidanceBackend, "compile", held_compile)
    try:
        yield release
    finally:
        release.set()


async def test_requests_waiting_for_their_grammar_count_against_max_waiting_requests(
    tiny_llama: Path, held_compiles: threading.Event
) -> None:
    async with Engine.open(tiny_llama, max_waiting_requests=2) as engine:
        first = engine.stream("x", SamplingParams(max_tokens=5, structured_output={"regex": "[0-9]{3}"}))
        second = engine.stream("x", SamplingParams(max_tokens=5, structured_output={"regex": "[a-z]{3}"}, n=2))
        assert engine.statistics().num_waiting == 2
        with pytest.raises(asyncllm.EngineOverloadedError):
            engine.stream("x", SamplingParams(max_tokens=5, structured_output={"regex": "[A-Z]{3}"}))
        held_compiles.set()
        for stream in (first, second):
            async with stream:
                async for _ in stream:
                    pass
        assert engine.statistics().num_waiting == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"json_schema": False, "regex": "[0-9]+"}, "exactly one"),
        ({"json_schema": False}, "allows no output"),
        ({"json_schema": "false"}, "allows no output"),
    ],
)
def test_json_schema_false_is_a_schema_not_an_unset_field(fields: dict[str, Any], message: str) -> None:
    # It used to count as unset: with a regex beside it the spec was built as a regex, and the engine
    # then compiled the schema false instead ("structured_output.json_schema: Expecting object schema").
    with pytest.raises(asyncllm.InvalidSamplingParamsError, match=message):
        StructuredOutput(**fields)


def test_a_schema_that_is_not_json_is_refused_at_construction() -> None:
    # A Decimal used to be encoded as the string "1.5" in the cache key (so it shared a cache entry
    # with another schema) and reached the grammar engine only at the call.
    schema = {"type": "object", "properties": {"a": {"maximum": decimal.Decimal("1.5")}}}
    with pytest.raises(asyncllm.InvalidSamplingParamsError, match="not JSON"):
        StructuredOutput(json_schema=schema)
    with pytest.raises(asyncllm.InvalidSamplingParamsError, match="not JSON"):
        StructuredOutput(json_schema={"type": "number", "maximum": float("nan")})


async def test_a_schema_with_a_non_string_key_is_read_as_json(tiny_llama: Path) -> None:
    # An int key passed construction, then every call raised a bare TypeError (the cache key could not
    # be encoded) instead of running or refusing the request.
    spec = StructuredOutput(json_schema={"type": "object", "properties": {1: {"type": "integer"}}, "required": ["1"]})
    assert spec.json_schema == {"type": "object", "properties": {"1": {"type": "integer"}}, "required": ["1"]}
    async with Engine.open(tiny_llama) as engine:
        sample = (await engine.generate("x", SamplingParams(max_tokens=30, structured_output=spec))).samples[0]
    if sample.finish_reason == "stop":
        assert set(json.loads(sample.text)) == {"1"}
