"""Tests of asyncllm.kv: the block pool's reference counts and the manager's block tables."""

from __future__ import annotations

import subprocess
import sys

# Another test module of the same session may already have imported torch; then the module-level
# check below cannot see anything, and test_imports_without_torch checks in a fresh interpreter.
_TORCH_PRELOADED = "torch" in sys.modules

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from asyncllm.kv import BlockPool, KVCacheManager  # noqa: E402
from asyncllm.kv.manager import blocks_needed  # noqa: E402

assert _TORCH_PRELOADED or "torch" not in sys.modules, "asyncllm.kv must not import torch"


def test_imports_without_torch() -> None:
    code = "import sys, asyncllm.kv; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


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


# ----------------------------------------------------------------------------------------------
# KVCacheManager
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (32, 16, 2), (33, 16, 3), (5, 1, 5)],
)
def test_blocks_needed(num_tokens: int, block_size: int, expected: int) -> None:
    assert blocks_needed(num_tokens, block_size) == expected


def test_manager_table_grows_only_when_crossing_a_block_boundary() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = kv.allocate_slots(1, 3)
    assert first is not None and len(first) == 1
    assert kv.block_table(1) == first
    assert kv.allocate_slots(1, 4) == []  # still fits in the first block
    assert kv.num_free_blocks == 9
    second = kv.allocate_slots(1, 5)  # crosses into a second block
    assert second is not None and len(second) == 1
    assert kv.block_table(1) == first + second
    assert kv.allocate_slots(1, 8) == []
    third = kv.allocate_slots(1, 17)  # jumps three blocks at once (a chunk of prefill)
    assert third is not None and len(third) == 3
    assert kv.block_table(1) == first + second + third
    assert kv.num_free_blocks == 5
    # Asking for fewer tokens than covered never shrinks the table.
    assert kv.allocate_slots(1, 2) == []
    assert len(kv.block_table(1)) == 5


def test_manager_tables_are_disjoint_and_refcounted() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    assert kv.allocate_slots(1, 4) is not None
    assert kv.allocate_slots(2, 3) is not None
    t1, t2 = kv.block_table(1), kv.block_table(2)
    assert len(t1) == 2 and len(t2) == 2
    assert not set(t1) & set(t2)
    assert all(kv.pool.ref_count(b) == 1 for b in t1 + t2)
    assert kv.num_free_blocks == 2


def test_manager_returns_none_without_partial_change_for_existing_request() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots(1, 8) is not None  # 2 blocks
    assert kv.allocate_slots(2, 4) is not None  # 1 block, 1 left
    table_before = list(kv.block_table(1))
    assert kv.allocate_slots(1, 16) is None  # needs 2 more, only 1 free
    assert kv.block_table(1) == table_before
    assert kv.num_free_blocks == 1
    # A request that fits still can have the remaining block.
    assert kv.allocate_slots(1, 12) is not None
    assert kv.num_free_blocks == 0


def test_manager_returns_none_without_leaving_a_table_for_new_request() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.allocate_slots(7, 9) is None  # needs 3 blocks
    assert kv.block_table(7) == []
    assert kv.num_free_blocks == 2
    kv.free(7)  # nothing held: a no-op
    assert kv.num_free_blocks == 2


def test_manager_free_returns_all_blocks_and_is_idempotent() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.allocate_slots(1, 10) is not None
    assert kv.allocate_slots(2, 4) is not None
    held = kv.block_table(1)
    kv.free(1)
    assert kv.block_table(1) == []
    assert kv.num_free_blocks == 4
    assert all(kv.pool.ref_count(b) == 0 for b in held)
    kv.free(1)  # second free: nothing to do, and no "released more often" error
    kv.free(12345)  # never allocated
    assert kv.num_free_blocks == 4
    assert len(kv.block_table(2)) == 1


def test_manager_freed_request_starts_a_new_table() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots(1, 12) is not None
    kv.free(1)
    new = kv.allocate_slots(1, 5)
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
# Property test: random allocate/free sequences keep the books straight
# ----------------------------------------------------------------------------------------------

_REQUEST_IDS = st.integers(min_value=0, max_value=4)
_OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), _REQUEST_IDS, st.integers(min_value=0, max_value=40)),
        st.tuples(st.just("free"), _REQUEST_IDS, st.just(0)),
    ),
    max_size=60,
)


def _check_invariants(kv: KVCacheManager, covered: dict[int, int], num_blocks: int) -> None:
    tables = {rid: kv.block_table(rid) for rid in range(5)}
    held = [b for table in tables.values() for b in table]
    # Every block is held by at most one table, once.
    assert len(held) == len(set(held))
    assert kv.num_free_blocks + len(held) == num_blocks
    for block in range(num_blocks):
        assert kv.pool.ref_count(block) == (1 if block in held else 0)
    for rid, table in tables.items():
        # Each table covers exactly the most tokens its request asked for (successfully).
        assert len(table) == blocks_needed(covered.get(rid, 0), kv.block_size)


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(min_value=1, max_value=12),
    block_size=st.sampled_from([1, 2, 4, 16]),
    operations=_OPERATIONS,
)
def test_manager_random_operations_keep_invariants(
    num_blocks: int, block_size: int, operations: list[tuple[str, int, int]]
) -> None:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    covered: dict[int, int] = {}  # tokens each request's table must cover
    for op, rid, num_tokens in operations:
        if op == "free":
            kv.free(rid)
            covered.pop(rid, None)
        else:
            before = list(kv.block_table(rid))
            free_before = kv.num_free_blocks
            missing = blocks_needed(num_tokens, block_size) - len(before)
            result = kv.allocate_slots(rid, num_tokens)
            if missing > free_before:
                assert result is None
                assert kv.block_table(rid) == before
                assert kv.num_free_blocks == free_before
            else:
                assert result is not None
                assert result == kv.block_table(rid)[len(before) :]
                assert kv.block_table(rid)[: len(before)] == before
                assert len(result) == max(missing, 0)
                assert kv.num_free_blocks == free_before - len(result)
                covered[rid] = max(covered.get(rid, 0), num_tokens)
        _check_invariants(kv, covered, num_blocks)
    for rid in range(5):
        kv.free(rid)
    assert kv.num_free_blocks == num_blocks
    assert all(kv.pool.ref_count(b) == 0 for b in range(num_blocks))
    # The free queue holds every block exactly once.
    everything = kv.pool.allocate(num_blocks)
    assert everything is not None and sorted(everything) == list(range(num_blocks))
    assert kv.pool.allocate(1) is None
