"""Speculative decoding under review: behaviours a production user would hit, each found failing first.

The tiny model is random, so its greedy or sampled output rarely repeats; ``allowed_token_ids`` narrows
it to three tokens, which makes the output repetitive enough for n-gram drafts while every token still
depends on the model's logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.engine._stream import RequestStream
from asyncllm.testing import ByteTokenizer, ScriptedRunner

pytestmark = pytest.mark.anyio

PROMPT = [40, 41, 42, 40, 41, 42, 40, 41]


async def _token_ids(stream: RequestStream) -> list[int]:
    async with stream:
        return [token async for chunk in stream for token in chunk.token_ids]


async def test_a_seeded_sampled_request_does_not_depend_on_what_else_runs(tiny_llama: Path) -> None:
    # Plain decoding promises it (each seeded request draws from its own generator). With drafts, the
    # draft's length depended on the step's budget left by other requests, and verifying a draft of
    # another length draws other random numbers: the same seeded request gave other tokens.
    seeded = SamplingParams(temperature=20.0, seed=11, max_tokens=24, ignore_eos=True, allowed_token_ids=[40, 41, 42])
    other = SamplingParams(max_tokens=24, ignore_eos=True, num_speculative_tokens=0)
    options = {"speculative_method": "ngram", "speculative_ngram_min": 1, "max_num_batched_tokens": 4}
    async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=64, **options) as engine:
        alone = await _token_ids(engine.stream(PROMPT, seeded))
        busy = engine.stream([7, 8, 9], other)  # running first, it takes one token of each step's budget
        together = await _token_ids(engine.stream(PROMPT, seeded))
        await _token_ids(busy)
    assert together == alone
    async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=64, max_num_batched_tokens=4) as plain:
        assert await _token_ids(plain.stream(PROMPT, seeded)) == alone  # as without speculation


SCRIPT = b"the cat sat on the mat. the cat sat on the hat. a dog sat on the cat. "
SCRIPTED_PROMPT = "the cat sat on the mat. the cat sat on the hat. a dog"


async def _scripted_run(params: SamplingParams, **options: Any) -> tuple[list[int], int]:
    runner = ScriptedRunner(SCRIPT)
    async with Engine.open(runner=runner, tokenizer=ByteTokenizer(), **options) as engine:
        token_ids = await _token_ids(engine.stream(SCRIPTED_PROMPT, params))
        stats = engine.statistics()
    return token_ids, stats.num_generated_tokens


async def test_tokens_dropped_after_a_stop_string_are_not_counted_as_generated() -> None:
    # A verified draft that runs past a stop string: the tokens after it never reach the stream, as
    # plain decoding never generates them; statistics() counted them all the same.
    params = SamplingParams(max_tokens=200, ignore_eos=True, stop=("the ha",))  # completed inside a draft
    plain, plain_count = await _scripted_run(params)
    fast, fast_count = await _scripted_run(params, speculative_method="ngram", num_speculative_tokens=8)
    assert fast == plain
    assert fast_count == plain_count == len(plain)
