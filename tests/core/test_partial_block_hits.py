"""Partial-block prefix hits: a request reuses the leading rows of a cached block its next block only starts like.

The KV manager finds the cached block under the same parent that shares the longest run of leading tokens
with the request's first block not fully cached, counts those rows as computed, and has the step copy them
into the request's own next block. Unit level: the hit, the copy, the tenant's salt, eviction, the last
token left to compute, and the configurations that get none. Engine level, on a real model: the tokens equal
transformers' greedy ones for prompts that hit partially (the source block free, held by a running request,
or computed in the same burst), the draft model's KV is copied too, and every block comes back.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.core._request import Request
from asyncllm.core.kv._manager import BlockCopy, KVCacheManager
from asyncllm.testing.parity import stream_all, transformers_greedy

BLOCK = 4


def _request(request_id: int, tokens: list[int], salt: str | None = None) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        params=SamplingParams(max_tokens=4),
        stop_token_ids=frozenset(),
        max_total_tokens=len(tokens) + 4,
        cache_salt=salt,
    )


def _computed(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit the request (its prefix hit taken), pretend a step computed its prompt, and return its table."""
    hit = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens, hit) is not None
    request.num_computed_tokens = request.num_confirmed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    return kv.block_table(request.request_id)


def _manager(**options: object) -> KVCacheManager:
    return KVCacheManager(16, BLOCK, partial_block_hits=True, **options)  # type: ignore[arg-type]


def test_a_partial_hit_counts_the_shared_rows_and_copies_them_into_the_next_block() -> None:
    kv = _manager()
    first = _request(1, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    table = _computed(kv, first)
    kv.take_copies()
    second = _request(2, [1, 2, 3, 4, 5, 6, 7, 99, 98, 97])  # block 1 starts like first's: 3 rows
    hit = kv.find_cached_prefix(second)
    assert hit.block_ids == [table[0]] and hit.num_tokens == BLOCK + 3 and hit.copy_from == (table[1], 3)
    new = kv.allocate_slots(second, second.num_tokens, hit)
    assert new is not None and new[0] not in table
    assert kv.take_copies() == [BlockCopy(table[1], new[0], 3)]
    assert kv.take_copies() == []  # taken once


def test_the_first_block_hits_partially_under_its_salt_only() -> None:
    kv = _manager()
    _computed(kv, _request(1, [5, 6, 7, 8, 9], salt="a"))
    assert kv.find_cached_prefix(_request(2, [5, 6, 7, 1, 2], salt="a")).num_tokens == 3
    assert kv.find_cached_prefix(_request(3, [5, 6, 7, 1, 2], salt="b")).num_tokens == 0
    assert kv.find_cached_prefix(_request(4, [5, 6, 7, 1, 2])).num_tokens == 0


def test_the_last_token_is_always_left_to_compute() -> None:
    kv = _manager()
    _computed(kv, _request(1, [1, 2, 3, 4, 5, 6, 7, 8]))
    hit = kv.find_cached_prefix(_request(2, [1, 2, 3, 4, 5, 6, 7]))  # a prefix of the cached prompt
    assert hit.num_tokens == 6 and hit.copy_from is not None and hit.copy_from[1] == 2


def test_an_evicted_block_is_no_longer_found() -> None:
    kv = KVCacheManager(3, BLOCK, partial_block_hits=True)
    first = _request(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _computed(kv, first)
    kv.free(first)
    # Three fresh blocks: every block of the first request is evicted.
    _computed(kv, _request(2, [50, 51, 52, 53, 54, 55, 56, 57, 58]))
    assert kv.find_cached_prefix(_request(3, [1, 2, 9, 9, 9])).num_tokens == 0


def test_evicting_the_latest_block_to_start_so_keeps_the_older_ones_findable() -> None:
    # Two cached first blocks start with token 1: A = [1, 2, 3, 4] (held by a running request) and, cached
    # later, B = [1, 9, 9, 9]. B is evicted; A still holds the KV of [1, 2, 3], so a prompt starting so
    # must still hit its three rows.
    kv = KVCacheManager(4, BLOCK, partial_block_hits=True)
    a = _computed(kv, _request(1, [1, 2, 3, 4, 5]))[0]
    second = _request(2, [1, 9, 9, 9, 5])
    b = _computed(kv, second)[0]
    kv.free(second)
    _computed(kv, _request(3, [7, 7, 7, 7, 7]))  # takes the free blocks, B first (the oldest free)
    assert not kv.pool.is_cached(b) and kv.pool.is_cached(a)
    assert kv.find_cached_prefix(_request(4, [1, 2, 3, 8, 8])).copy_from == (a, 3)


def test_a_large_block_is_indexed_in_time_linear_in_its_size() -> None:
    # The index keys each leading run by an incremental hash: 255 keys for a block of 256, not 255 tuples of
    # up to 255 tokens. Counted through the pool's index itself (no timing).
    kv = KVCacheManager(8, 256, partial_block_hits=True)
    _computed(kv, _request(1, list(range(1, 300))))
    assert len(kv.pool._leading) == 255
    assert all(isinstance(key[2], int) and len(key) == 3 for key in kv.pool._leading)
    hit = kv.find_cached_prefix(_request(2, [*range(1, 200), 0, 0]))
    assert hit.copy_from is not None and hit.copy_from[1] == 199


def test_no_partial_hits_by_default_with_a_window_or_without_prefix_caching() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    for kv in (
        KVCacheManager(16, BLOCK),
        KVCacheManager(16, BLOCK, partial_block_hits=True, sliding_window=64),
        KVCacheManager(16, BLOCK, partial_block_hits=True, sliding_group=(8, 16)),
        KVCacheManager(16, BLOCK, partial_block_hits=True, enable_prefix_caching=False),
    ):
        if kv.enable_prefix_caching:
            _computed(kv, _request(1, tokens))
        hit = kv.find_cached_prefix(_request(2, [1, 2, 3, 4, 5, 6, 0, 0]))
        assert hit.copy_from is None and hit.num_tokens % BLOCK == 0


# -- on a real model -----------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts() -> tuple[list[int], list[list[int]]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 500) for _ in range(10)]  # two blocks of 4 and two rows of a third

    def tail(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    return shared, [shared + tail(n) for n in (5, 3, 6, 1)]


@pytest.mark.anyio
async def test_partial_hits_generate_transformers_tokens(tiny_llama: Path) -> None:
    shared, prompts = _prompts()
    first, *burst = prompts
    expected = transformers_greedy(tiny_llama, tuple(map(tuple, prompts)), 8)
    async with Engine.open(tiny_llama, device="cpu", block_size=BLOCK, kv_cache_blocks=64) as engine:
        # The first prompt's blocks cached and free; then three at once (their sources free, then held by
        # each other as the burst runs), and the first again while the others are cached.
        got = [(await engine.generate(first, GREEDY)).token_ids]
        got += await stream_all(engine, burst, GREEDY)
        again = await engine.generate(first, GREEDY)
        stats = engine.statistics()
    assert [list(tokens) for tokens in got] == expected
    assert list(again.token_ids) == expected[0]
    assert again.num_cached_tokens == len(first) - 1  # all but the last token: two of them copied rows
    assert stats.prefix_cache_hits >= 3 * len(shared)  # the burst found every shared token
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.anyio
async def test_the_copy_is_what_makes_the_numbers_right(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny model's greedy tokens barely depend on two rows of context, so this compares logprobs: with the
    # copy they equal a cache-less engine's to float32 rounding; without it (the hit rows left as the fresh
    # block held them) they move, so the test above could not pass on rows that merely happened to fit.
    from asyncllm.worker._model_runner import TorchModelRunner

    shared, prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)

    async def logprobs(enable_prefix_caching: bool) -> tuple[list[float], int | None]:
        async with Engine.open(
            tiny_llama, device="cpu", block_size=BLOCK, kv_cache_blocks=64, enable_prefix_caching=enable_prefix_caching
        ) as engine:
            await engine.generate(prompts[0], GREEDY)
            result = await engine.generate(prompts[1], params)
        assert result.logprobs is not None
        return [entry.logprob for step in result.logprobs for entry in step.top], result.num_cached_tokens

    reference, none_cached = await logprobs(False)
    copied, cached = await logprobs(True)
    monkeypatch.setattr(TorchModelRunner, "_copy_blocks", lambda self, copies: None)
    uncopied, _ = await logprobs(True)
    assert none_cached == 0 and cached == len(shared)
    assert copied == pytest.approx(reference, rel=1e-5, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(uncopied, reference, strict=True)) > 1e-3


@pytest.mark.anyio
async def test_the_draft_models_kv_is_copied_too(tiny_llama: Path) -> None:
    _, prompts = _prompts()
    expected = transformers_greedy(tiny_llama, tuple(map(tuple, prompts)), 8)
    async with Engine.open(
        tiny_llama,
        device="cpu",
        block_size=BLOCK,
        kv_cache_blocks=96,
        speculative_method="draft_model",
        speculative_model=str(tiny_llama),
        num_speculative_tokens=3,
    ) as engine:
        got = [list((await engine.generate(prompt, GREEDY)).token_ids) for prompt in prompts]
        stats = engine.statistics()
    assert got == expected
    # The target as its own draft: every proposal is accepted, which needs the draft's copied rows right.
    assert stats.spec_acceptance_rate == 1.0
    assert stats.kv_blocks_free == stats.kv_blocks_total
