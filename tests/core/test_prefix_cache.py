"""Prefix caching on a real model: same tokens as without it, real hits, salts keep tenants apart."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asyncllm import Engine, SamplingParams

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(40)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    unrelated = [tail(60) for _ in range(4)]  # enough to evict the shared prefix from a small cache
    return [
        shared + tail(5),
        shared + tail(7),  # full-block hit on the shared 40 tokens
        shared[:22] + tail(9),  # partial match: 5 full blocks of 4
        shared,  # the whole prompt cached: one token must still be computed
        *unrelated,
        shared + tail(3),  # after evictions
        shared + tail(5)[:0] + shared[:8],  # a prompt that repeats itself
    ]


async def _run(model: Path, enable: bool, prompts: list[list[int]]) -> tuple[list[tuple[int, ...]], object]:
    async with Engine.open(
        model, device="cpu", block_size=4, kv_cache_blocks=48, enable_prefix_caching=enable
    ) as engine:
        outputs = [(await engine.generate(p, GREEDY)).token_ids for p in prompts]
        stats = engine.statistics()
    return outputs, stats


async def test_outputs_identical_with_and_without_prefix_caching(tiny_llama: Path) -> None:
    prompts = _prompts()
    cached, cached_stats = await _run(tiny_llama, True, prompts)
    plain, plain_stats = await _run(tiny_llama, False, prompts)
    assert cached == plain
    assert plain_stats.prefix_cache_hits == 0  # type: ignore[attr-defined]
    assert cached_stats.prefix_cache_hits >= 40 + 20 + 36  # type: ignore[attr-defined]
    assert cached_stats.num_prompt_tokens < plain_stats.num_prompt_tokens  # type: ignore[attr-defined]
    assert cached_stats.kv_blocks_free == cached_stats.kv_blocks_total  # type: ignore[attr-defined]


async def test_hits_skip_prefill_and_reset_forgets(tiny_llama: Path) -> None:
    prompt = list(range(10, 50))
    async with Engine.open(tiny_llama, device="cpu", block_size=4, kv_cache_blocks=64) as engine:
        await engine.generate(prompt, GREEDY)
        before = engine.statistics()
        await engine.generate(prompt, GREEDY)
        after_hit = engine.statistics()
        forgotten = engine.reset_prefix_cache()
        await engine.generate(prompt, GREEDY)
        after_reset = engine.statistics()
    assert before.prefix_cache_hits == 0
    # All but the last token: 9 full blocks of 4 and 3 rows of the tenth, copied (a partial-block hit).
    assert after_hit.prefix_cache_hits - before.prefix_cache_hits == 39
    assert after_hit.num_prompt_tokens - before.num_prompt_tokens == 1  # only the last token computed
    assert forgotten > 0
    assert after_reset.prefix_cache_hits == after_hit.prefix_cache_hits
    assert 0.0 < after_reset.prefix_cache_hit_rate < 1.0


async def test_cache_salt_keeps_tenants_apart(tiny_llama: Path) -> None:
    prompt = list(range(10, 50))
    async with Engine.open(tiny_llama, device="cpu", block_size=4, kv_cache_blocks=64) as engine:
        a1 = await engine.generate(prompt, GREEDY, cache_salt="tenant-a")
        b1 = await engine.generate(prompt, GREEDY, cache_salt="tenant-b")
        no_salt = await engine.generate(prompt, GREEDY)
        hits_so_far = engine.statistics().prefix_cache_hits
        a2 = await engine.generate(prompt, GREEDY, cache_salt="tenant-a")
        hits_after = engine.statistics().prefix_cache_hits
    assert hits_so_far == 0  # no tenant's blocks, whole or partial, served another
    assert hits_after == 39
    assert a1.token_ids == b1.token_ids == no_salt.token_ids == a2.token_ids
