"""Tests of asyncllm.core.kv: the block pool's reference counts and prefix cache, the manager's block tables."""

from __future__ import annotations

import subprocess
import sys

# Another test module of the same session may already have imported torch; then the module-level
# check below cannot see anything, and test_imports_without_torch checks in a fresh interpreter.
_TORCH_PRELOADED = "torch" in sys.modules

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from asyncllm.core._request import Request  # noqa: E402
from asyncllm.core.kv import BlockPool, KVCacheManager  # noqa: E402
from asyncllm.core.kv._manager import blocks_needed  # noqa: E402
from asyncllm.sampling_params import SamplingParams  # noqa: E402

assert _TORCH_PRELOADED or "torch" not in sys.modules, "asyncllm.core.kv must not import torch"


def test_imports_without_torch() -> None:
    code = (
        "import sys, asyncllm.core.kv, asyncllm.core._request; "
        "assert 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def make_request(request_id: int, token_ids: list[int] | None = None, *, salt: str | None = None) -> Request:
    tokens = token_ids if token_ids is not None else [request_id * 100 + i for i in range(64)]
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        params=SamplingParams(max_tokens=16),
        stop_token_ids=frozenset(),
        max_total_tokens=len(tokens) + 16,
        cache_salt=salt,
    )


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Pretend a finished step computed the request's KV up to ``num_tokens`` (as Scheduler.update does)."""
    request.num_computed_tokens = request.num_confirmed_tokens = num_tokens
    kv.cache_computed_blocks(request)


# ----------------------------------------------------------------------------------------------
# BlockPool
# ----------------------------------------------------------------------------------------------


def test_pool_rejects_empty_cache() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_pool_allocate_hands_out_distinct_blocks_with_one_reference() -> None:
    pool = BlockPool(8)
    first = pool.allocate(3)
    second = pool.allocate(5)
    assert first is not None and second is not None
    assert len(first) == 3 and len(second) == 5
    assert sorted(first + second) == list(range(8))
    assert pool.num_free_blocks == 0
    assert all(pool.ref_count(b) == 1 for b in first + second)


def test_pool_allocate_zero_blocks() -> None:
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_pool_returns_none_when_short_and_changes_nothing() -> None:
    pool = BlockPool(4)
    held = pool.allocate(3)
    assert held is not None
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert all(pool.ref_count(b) == 1 for b in held)
    (last,) = set(range(4)) - set(held)
    assert pool.ref_count(last) == 0
    # The one free block is still there to take.
    assert pool.allocate(1) == [last]
    assert pool.allocate(1) is None


def test_pool_release_frees_and_blocks_are_reusable() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    assert blocks is not None
    pool.release(blocks)
    assert pool.num_free_blocks == 4
    assert all(pool.ref_count(b) == 0 for b in range(4))
    again = pool.allocate(4)
    assert again is not None and sorted(again) == [0, 1, 2, 3]


def test_pool_release_reuses_tail_blocks_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    pool.release(blocks)
    # Released in reverse: the sequence's last block is the first to be handed out again.
    assert pool.allocate(3) == [2, 1, 0]


def test_pool_free_queue_is_fifo_across_releases() -> None:
    pool = BlockPool(4)
    a = pool.allocate(1)
    b = pool.allocate(1)
    assert a == [0] and b == [1]
    pool.release(b)
    pool.release(a)
    # Blocks 2 and 3 were free all along, so they come first, then 1, then 0.
    assert pool.allocate(4) == [2, 3, 1, 0]


def test_pool_shared_block_stays_held_until_last_release() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.touch(blocks)  # a second holder (a prefix-cache hit)
    assert pool.ref_count(blocks[0]) == 2
    pool.release(blocks)
    assert pool.ref_count(blocks[0]) == 1
    assert pool.num_free_blocks == 1
    pool.release(blocks)
    assert pool.ref_count(blocks[0]) == 0
    assert pool.num_free_blocks == 2


def test_pool_releasing_too_often_raises() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks is not None
    pool.release(blocks)
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(blocks)
    assert pool.num_free_blocks == 2
    assert pool.ref_count(blocks[0]) == 0


def test_pool_releasing_a_never_allocated_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.release([1])
    assert pool.num_free_blocks == 2


def test_pool_cached_block_survives_release_until_evicted() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    assert blocks == [0, 1]
    pool.cache(0, b"h0")
    assert pool.lookup(b"h0") == 0 and pool.is_cached(0) and not pool.is_cached(1)
    assert pool.num_cached_blocks == 1
    pool.release(blocks)
    # Free, but still listed: a later request with the same prefix can take it.
    assert pool.num_free_blocks == 3
    assert pool.lookup(b"h0") == 0
    # Free queue: 2 (never used), then 1, then 0 (released in reverse). Taking two blocks does
    # not reach the cached one.
    assert pool.allocate(2) == [2, 1]
    assert pool.lookup(b"h0") == 0
    # The next allocation pops block 0 and evicts its cache entry.
    assert pool.allocate(1) == [0]
    assert pool.lookup(b"h0") is None
    assert not pool.is_cached(0)
    assert pool.num_cached_blocks == 0


def test_pool_touch_takes_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    assert blocks == [0]
    pool.cache(0, b"h")
    pool.release(blocks)
    assert pool.num_free_blocks == 2
    pool.touch([0])  # a cache hit on a free block
    assert pool.ref_count(0) == 1
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [1]  # block 0 is not handed out twice
    assert pool.allocate(1) is None
    assert pool.lookup(b"h") == 0


def test_pool_first_block_to_cache_a_hash_keeps_it() -> None:
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, b"same")
    pool.cache(1, b"same")
    assert pool.lookup(b"same") == 0
    assert not pool.is_cached(1)
    pool.cache(0, b"other")  # a block caches one hash only
    assert pool.lookup(b"other") is None


def test_pool_reset_prefix_cache() -> None:
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, b"a")
    pool.cache(1, b"b")
    assert pool.reset_prefix_cache() == 2
    assert pool.lookup(b"a") is None and pool.lookup(b"b") is None
    assert pool.num_cached_blocks == 0
    assert not pool.is_cached(0)
    assert pool.ref_count(0) == 1  # holders are not affected


# ----------------------------------------------------------------------------------------------
# KVCacheManager: block tables
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3), (5, 1, 5)],
)
def test_blocks_needed(num_tokens: int, block_size: int, expected: int) -> None:
    assert blocks_needed(num_tokens, block_size) == expected


def test_manager_table_grows_only_when_crossing_a_block_boundary() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request(1)
    first = kv.allocate_slots(r, 3)
    assert first is not None and len(first) == 1
    assert kv.block_table(1) == first
    assert kv.allocate_slots(r, 4) == []  # still fits in the first block
    assert kv.num_free_blocks == 9
    second = kv.allocate_slots(r, 5)  # crosses into a second block
    assert second is not None and len(second) == 1
    assert kv.block_table(1) == first + second
    assert kv.allocate_slots(r, 8) == []
    third = kv.allocate_slots(r, 17)  # jumps three blocks at once (a chunk of prefill)
    assert third is not None and len(third) == 3
    assert kv.block_table(1) == first + second + third
    assert kv.num_free_blocks == 5
    # Asking for fewer tokens than covered never shrinks the table.
    assert kv.allocate_slots(r, 2) == []
    assert len(kv.block_table(1)) == 5


def test_manager_tables_are_disjoint_and_refcounted() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    assert kv.allocate_slots(make_request(1), 4) is not None
    assert kv.allocate_slots(make_request(2), 3) is not None
    t1, t2 = kv.block_table(1), kv.block_table(2)
    assert len(t1) == 2 and len(t2) == 2
    assert not set(t1) & set(t2)
    assert all(kv.pool.ref_count(b) == 1 for b in t1 + t2)
    assert kv.num_free_blocks == 2


def test_manager_returns_none_without_partial_change_for_existing_request() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r1, r2 = make_request(1), make_request(2)
    assert kv.allocate_slots(r1, 8) is not None  # 2 blocks
    assert kv.allocate_slots(r2, 4) is not None  # 1 block, 1 left
    table_before = list(kv.block_table(1))
    assert kv.allocate_slots(r1, 16) is None  # needs 2 more, only 1 free
    assert kv.block_table(1) == table_before
    assert kv.num_free_blocks == 1
    # A request that fits still can have the remaining block.
    assert kv.allocate_slots(r1, 12) is not None
    assert kv.num_free_blocks == 0


def test_manager_returns_none_without_leaving_a_table_for_new_request() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request(7)
    assert kv.allocate_slots(r, 9) is None  # needs 3 blocks
    assert kv.block_table(7) == []
    assert kv.num_free_blocks == 2
    kv.free(r)  # nothing held: a no-op
    assert kv.num_free_blocks == 2


def test_manager_free_returns_all_blocks_and_is_idempotent() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    r1, r2 = make_request(1), make_request(2)
    assert kv.allocate_slots(r1, 10) is not None
    assert kv.allocate_slots(r2, 4) is not None
    held = kv.block_table(1)
    kv.free(r1)
    assert kv.block_table(1) == []
    assert kv.num_free_blocks == 4
    assert all(kv.pool.ref_count(b) == 0 for b in held)
    kv.free(r1)  # second free: nothing to do, and no "released more often" error
    kv.free(make_request(12345))  # never allocated
    assert kv.num_free_blocks == 4
    assert len(kv.block_table(2)) == 1


def test_manager_freed_request_starts_a_new_table() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = make_request(1)
    assert kv.allocate_slots(r, 12) is not None
    kv.free(r)
    new = kv.allocate_slots(r, 5)
    assert new is not None and len(new) == 2
    assert kv.block_table(1) == new
    assert kv.num_free_blocks == 1


def test_manager_block_table_of_unknown_request_is_empty_and_detached() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    table = kv.block_table(99)
    assert table == []
    table.append(0)  # mutating the returned empty list must not create state
    assert kv.block_table(99) == []
    assert kv.num_free_blocks == 2


# ----------------------------------------------------------------------------------------------
# KVCacheManager: prefix cache
# ----------------------------------------------------------------------------------------------


def test_manager_prefix_hit_shares_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    shared = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = make_request(1, [*shared, 1, 2])
    assert kv.find_cached_prefix(a).num_tokens == 0  # empty cache
    assert kv.allocate_slots(a, a.num_tokens) is not None
    compute(kv, a, a.num_tokens)
    b = make_request(2, [*shared, 3, 4, 5])
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 8
    assert hit.block_ids == kv.block_table(1)[:2]
    free_before = kv.num_free_blocks
    new = kv.allocate_slots(b, b.num_tokens, hit)
    assert new is not None and len(new) == 2  # tokens 8..14
    assert kv.block_table(2) == hit.block_ids + new
    assert kv.num_free_blocks == free_before - 2
    assert [kv.pool.ref_count(x) for x in hit.block_ids] == [2, 2]
    # Freeing a leaves the shared blocks with b.
    kv.free(a)
    assert [kv.pool.ref_count(x) for x in hit.block_ids] == [1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 10


def test_manager_hit_on_free_cached_blocks_and_counts_them_as_taken() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request(1, list(range(12)))  # 3 full blocks
    assert kv.allocate_slots(a, 12) is not None
    compute(kv, a, 12)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request(2, [*range(12), 50, 51, 52, 53, 54])  # needs 5 blocks, 3 of them cached
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 12
    # 2 new blocks are needed but only 1 free block is not a hit block: nothing may change.
    assert kv.allocate_slots(b, b.num_tokens, hit) is None
    assert kv.block_table(2) == []
    assert kv.num_free_blocks == 4
    assert all(kv.pool.ref_count(x) == 0 for x in range(4))
    assert all(kv.pool.lookup(h) is not None for h in b.block_hashes[:3])
    # A shorter step fits: the hit blocks leave the free queue without being evicted.
    new = kv.allocate_slots(b, 13, hit)
    assert new is not None and len(new) == 1
    assert kv.block_table(2) == [*hit.block_ids, *new]
    assert kv.num_free_blocks == 0
    assert [kv.pool.lookup(h) for h in b.block_hashes[:3]] == hit.block_ids


def test_manager_always_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(8))
    a = make_request(1, tokens)
    assert kv.allocate_slots(a, 8) is not None
    compute(kv, a, 8)
    b = make_request(2, tokens)  # the same prompt, exactly two full blocks
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 4  # the last block is recomputed so there are logits to sample
    assert len(hit.block_ids) == 1


def test_manager_partial_blocks_are_never_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(1, list(range(7)))
    assert kv.allocate_slots(a, 7) is not None
    compute(kv, a, 7)
    assert kv.pool.num_cached_blocks == 1
    b = make_request(2, [*range(7), 99, 98])
    assert kv.find_cached_prefix(b).num_tokens == 4


def test_manager_prefix_hit_needs_the_whole_chain() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request(1, [1, 2, 3, 4, 5, 6])
    assert kv.allocate_slots(a, 6) is not None
    compute(kv, a, 6)
    # Same second block, different first block: the chained hash does not match.
    b = make_request(2, [9, 9, 3, 4, 5, 6, 7])
    assert kv.find_cached_prefix(b).num_tokens == 0
    c = make_request(3, [1, 2, 3, 4, 0, 0, 7])
    assert kv.find_cached_prefix(c).num_tokens == 4


def test_manager_cache_salt_keeps_tenants_apart() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    a = make_request(1, tokens, salt="tenant-a")
    assert kv.allocate_slots(a, 9) is not None
    compute(kv, a, 9)
    assert kv.find_cached_prefix(make_request(2, tokens, salt="tenant-b")).num_tokens == 0
    assert kv.find_cached_prefix(make_request(3, tokens)).num_tokens == 0
    assert kv.find_cached_prefix(make_request(4, tokens, salt="tenant-a")).num_tokens == 8


def test_manager_prefix_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_request(1, list(range(9)))
    assert kv.allocate_slots(a, 9) is not None
    compute(kv, a, 9)
    assert kv.pool.num_cached_blocks == 0
    assert kv.find_cached_prefix(make_request(2, list(range(9)))).num_tokens == 0


def test_manager_reset_prefix_cache() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(1, list(range(9)))
    assert kv.allocate_slots(a, 9) is not None
    compute(kv, a, 9)
    assert kv.reset_prefix_cache() == 2
    assert kv.find_cached_prefix(make_request(2, list(range(9)))).num_tokens == 0
    assert len(kv.block_table(1)) == 3  # the running request keeps its blocks


def test_manager_request_freed_and_recomputed_caches_its_blocks_again() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(a, 8) is not None
    compute(kv, a, 8)
    kv.free(a)  # preempted
    a.num_computed_tokens = 0
    other = make_request(2, list(range(20, 28)))
    assert kv.allocate_slots(other, 8) is not None  # takes (and evicts) both of a's blocks
    kv.free(other)
    assert kv.find_cached_prefix(a).num_tokens == 0
    assert kv.allocate_slots(a, 8) is not None
    compute(kv, a, 8)
    table = kv.block_table(1)
    assert [kv.pool.lookup(h) for h in a.block_hashes[:2]] == table
    assert kv.find_cached_prefix(make_request(3, [1, 2, 3, 4, 5, 6, 7, 8, 0])).block_ids == table


def test_manager_output_tokens_are_part_of_the_cached_prefix() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(1, [1, 2, 3])
    assert kv.allocate_slots(a, 3) is not None
    compute(kv, a, 3)
    a.output_token_ids += [4, 5]  # generated; the first block is now full once 4 is fed
    assert kv.allocate_slots(a, 5) is not None
    compute(kv, a, 4)
    b = make_request(2, [1, 2, 3, 4, 5, 6])
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 4
    assert hit.block_ids == kv.block_table(1)[:1]


# ----------------------------------------------------------------------------------------------
# Property test: random allocate/compute/free sequences keep the books straight
# ----------------------------------------------------------------------------------------------

_NUM_REQUESTS = 4


@st.composite
def kv_scenarios(draw: st.DrawFn) -> tuple[int, int, bool, list[list[int]], list[tuple[str, int, int]]]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(min_value=1, max_value=24))
    prefix_caching = draw(st.booleans())
    # Prompts share prefixes and use a tiny alphabet, so prefix-cache hits are common.
    base = draw(st.lists(st.integers(0, 2), min_size=4, max_size=16))
    prompts = []
    for _ in range(_NUM_REQUESTS):
        keep = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        tail = draw(st.lists(st.integers(0, 2), min_size=1, max_size=6))
        prompts.append(base[:keep] + tail)
    kinds = st.sampled_from(["step"] * 6 + ["free"] * 2 + ["reset"])
    operations = draw(
        st.lists(st.tuples(kinds, st.integers(0, _NUM_REQUESTS - 1), st.integers(1, 12)), min_size=15, max_size=40)
    )
    return block_size, num_blocks, prefix_caching, prompts, operations


def _snapshot(kv: KVCacheManager) -> tuple[dict[int, list[int]], list[int], int]:
    tables = {rid: list(kv.block_table(rid)) for rid in range(_NUM_REQUESTS)}
    return tables, [kv.pool.ref_count(b) for b in range(kv.pool.num_blocks)], kv.num_free_blocks


@settings(max_examples=100, deadline=None)
@given(kv_scenarios())
def test_manager_random_operations_keep_invariants(
    scenario: tuple[int, int, bool, list[list[int]], list[tuple[str, int, int]]],
) -> None:
    block_size, num_blocks, prefix_caching, prompts, operations = scenario
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching)
    requests = [make_request(i, prompt) for i, prompt in enumerate(prompts)]
    covered = [0] * _NUM_REQUESTS  # tokens each request's table must cover
    # What each block holds: the whole token prefix up to its end, once fully written.
    contents: dict[int, tuple[int, ...] | None] = {}

    for op, rid, n in operations:
        request = requests[rid]
        if op == "free":
            kv.free(request)
            request.num_computed_tokens = 0  # as a preemption does
            covered[rid] = 0
        elif op == "reset":
            kv.reset_prefix_cache()
        else:
            tokens = request.token_ids(0, request.num_tokens)
            table = list(kv.block_table(rid))
            before = _snapshot(kv)
            if table:
                hit = None
                start = request.num_computed_tokens
            else:
                hit = kv.find_cached_prefix(request)
                assert hit.num_tokens == len(hit.block_ids) * block_size
                assert hit.num_tokens < request.num_tokens
                if not prefix_caching:
                    assert hit.block_ids == []
                for i, block in enumerate(hit.block_ids):
                    # A hit serves exactly the KV of this request's prefix.
                    assert contents.get(block) == tuple(tokens[: (i + 1) * block_size])
                start = hit.num_tokens
            target = min(start + n, request.num_tokens)
            hit_blocks = hit.block_ids if hit else []
            missing = blocks_needed(target, block_size) - len(table) - len(hit_blocks)
            available = kv.num_free_blocks - sum(1 for b in hit_blocks if kv.pool.ref_count(b) == 0)
            result = kv.allocate_slots(request, target, hit) if hit else kv.allocate_slots(request, target)
            if missing > available:
                assert result is None
                assert _snapshot(kv) == before
            else:
                assert result is not None
                new_table = kv.block_table(rid)
                assert new_table == table + hit_blocks + result
                assert len(result) == max(missing, 0)
                for block in result:
                    contents[block] = None  # fresh block: whatever it held is gone
                # The step writes tokens [start, target) into the table's blocks.
                for i in range(start // block_size, target // block_size):
                    contents[new_table[i]] = tuple(tokens[: (i + 1) * block_size])
                covered[rid] = max(covered[rid], target)
                compute(kv, request, target)
                if request.num_computed_tokens == request.num_tokens:
                    request.output_token_ids.append(n % 3)  # a sampled token extends the sequence

        # Invariants after every operation.
        tables = {rid: kv.block_table(rid) for rid in range(_NUM_REQUESTS)}
        holders = [0] * num_blocks
        for rid, table in tables.items():
            assert len(table) == len(set(table)), "a block twice in one table"
            assert len(table) == blocks_needed(covered[rid], block_size)
            assert requests[rid].num_computed_tokens <= len(table) * block_size
            for block in table:
                holders[block] += 1
        for block in range(num_blocks):
            assert kv.pool.ref_count(block) == holders[block]
            if not prefix_caching:
                assert holders[block] in (0, 1), "without prefix caching a block has one holder"
            if kv.pool.is_cached(block):
                assert contents.get(block) is not None, "a block listed in the cache was never filled"
        assert kv.num_free_blocks == holders.count(0)

    for request in requests:
        kv.free(request)
    assert kv.num_free_blocks == num_blocks
    assert all(kv.pool.ref_count(b) == 0 for b in range(num_blocks))
    # The free queue holds every block exactly once.
    everything = kv.pool.allocate(num_blocks)
    assert everything is not None and sorted(everything) == list(range(num_blocks))
    assert kv.pool.allocate(1) is None
