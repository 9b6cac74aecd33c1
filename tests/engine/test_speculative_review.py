"""Speculative decoding under review: behaviours a production user would hit, each found failing first.

The tiny model is random, so its greedy or sampled output rarely repeats; ``allowed_token_ids`` narrows
it to three tokens, which makes the output repetitive enough for n-gram drafts while every token still
depends on the model's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.engine._stream import RequestStream

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
