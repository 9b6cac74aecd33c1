"""Review of ``Engine.embed``: reproducers of what a production user would hit, each failing before its fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncllm import Engine, InvalidPromptError, SamplingParams
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

PROMPT = list(range(10, 50))  # 40 tokens: two full blocks of 16 cached on a repeat


async def test_mean_pooling_does_not_count_as_prefix_cache_misses(tiny_cache: Path) -> None:
    # Mean pooling never looks the prefix cache up (it needs every position's hidden state), so its
    # prompt tokens are no lookups: counted as misses they would drag prefix_cache_hit_rate down with
    # every embedding served, and the operator would read a cache that works as one that does not.
    model = tiny_model_path(tiny_cache, "llama")
    async with Engine.open(model, device="cpu", enable_prefix_caching=True) as engine:
        await engine.generate(PROMPT, SamplingParams(max_tokens=1))
        await engine.generate(PROMPT, SamplingParams(max_tokens=1))
        before = engine.statistics()
        for _ in range(3):
            await engine.embed(PROMPT, pooling="mean")
        # Nor does a request that wants prompt_logprobs, for the same reason.
        await engine.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))
        after = engine.statistics()
        await engine.embed(PROMPT, pooling="last")  # a last-token request does look up, and hits
        last = engine.statistics()
    assert before.prefix_cache_hits == 32 and before.prefix_cache_queries == 80
    assert (after.prefix_cache_queries, after.prefix_cache_hits) == (80, 32)
    assert after.prefix_cache_hit_rate == before.prefix_cache_hit_rate == 0.4
    assert (last.prefix_cache_queries, last.prefix_cache_hits) == (120, 64)


async def test_a_token_of_the_wrong_type_is_named_as_such(tiny_cache: Path) -> None:
    # A nested list or a string among token ids used to read "prompt token id [2] is outside the
    # vocabulary": a type mistake reported as a range one.
    model = tiny_model_path(tiny_cache, "llama")
    async with Engine.open(model, device="cpu") as engine:
        for inputs, shown in (([[1, [2]]], "list [2]"), ([["a"]], "str 'a'"), ([[1, 2.0]], "float 2.0")):
            with pytest.raises(InvalidPromptError, match=f"token ids must be ints, got {re.escape(shown)}") as caught:
                await engine.embed(inputs)  # type: ignore[arg-type]
            assert caught.value.param == "input"
        with pytest.raises(InvalidPromptError, match="outside the vocabulary"):
            await engine.embed([[1, 10**9]])
        stats = engine.statistics()
    assert stats.num_waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total
