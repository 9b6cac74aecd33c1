"""The KV manager of a hybrid model: global layers keep every block, sliding layers free theirs.

With ``sliding_group`` a request holds two tables over two pools: the global layers' (every block)
and the sliding layers' (``kv.sliding``, which drops the blocks that leave the window). A fake model
plays the device with the engine's pipelining (step N+1 scheduled, its tables copied, before step N
runs): every step writes each new position's key (a hash of its whole prefix) through both copied
tables, then every query reads its whole context through the global table and its window through the
sliding one. A block freed too early, handed to another request, or served by a wrong prefix hit in
either group shows up as a wrong key.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

# Another test module of the same session may already have imported torch (see test_kv.py).
_TORCH_PRELOADED = "torch" in sys.modules

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from asyncllm.core._request import Request  # noqa: E402
from asyncllm.core._scheduler import ScheduledRequest, Scheduler, SchedulerOutput  # noqa: E402
from asyncllm.core.kv import KVCacheManager  # noqa: E402
from asyncllm.core.kv._manager import CacheHit  # noqa: E402
from asyncllm.executor._runner import StepOutput  # noqa: E402
from asyncllm.testing.kv_requests import confirm, held, make_request  # noqa: E402

assert _TORCH_PRELOADED or "torch" not in sys.modules, "asyncllm.core must not import torch"






def sliding(kv: KVCacheManager) -> KVCacheManager:
    assert kv.sliding is not None
    return kv.sliding


# ----------------------------------------------------------------------------------------------
# The manager alone
# ----------------------------------------------------------------------------------------------


def test_a_window_and_a_sliding_group_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="exclude"):
        KVCacheManager(8, 4, sliding_window=4, sliding_group=(4, 8))
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(8, 4, sliding_group=(0, 8))


def test_the_sliding_group_frees_while_the_global_one_keeps_everything() -> None:
    kv = KVCacheManager(64, 4, sliding_group=(6, 16))
    request = make_request(1, list(range(40)), 8)
    assert kv.allocate_slots(request, 40) is not None
    assert held(kv) == 10 and held(sliding(kv)) == 10
    confirm(kv, request, 40)
    assert kv.allocate_slots(request, 41) is not None  # position 40 reads 35..40: blocks 8 on
    assert kv.block_offset(1) == 0 and len(kv.block_table(1)) == 11
    assert kv.sliding_block_offset(1) == 8 and len(kv.sliding_block_table(1) or []) == 3
    assert held(sliding(kv)) == 3 and sliding(kv).num_window_freed_blocks == 8
    kv.free(request)
    assert held(kv) == 0 and held(sliding(kv)) == 0


def test_an_allocation_happens_in_both_pools_or_in_neither() -> None:
    kv = KVCacheManager(64, 4, sliding_group=(4, 3))
    request = make_request(1, list(range(16)), 8)
    # 16 tokens need 4 blocks in each group; the sliding pool has 3: nothing is taken anywhere.
    assert kv.allocate_slots(request, 16) is None
    assert held(kv) == 0 and held(sliding(kv)) == 0 and kv.block_table(1) == []
    assert kv.allocate_slots(request, 12) is not None
    assert held(kv) == 3 and held(sliding(kv)) == 3
    small = KVCacheManager(2, 4, sliding_group=(4, 8))
    assert small.allocate_slots(make_request(2, list(range(12)), 1), 12) is None
    assert held(small) == 0 and held(sliding(small)) == 0


def test_a_hit_holds_in_both_groups() -> None:
    kv = KVCacheManager(32, 4, sliding_group=(4, 32))
    prompt = list(range(40))
    a = make_request(1, prompt, 8)
    assert kv.allocate_slots(a, 40) is not None
    confirm(kv, a, 40)
    assert kv.allocate_slots(a, 41) is not None  # the sliding group drops blocks 0..8
    b = make_request(2, [*prompt, 99], 8)
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 40 and hit.block_ids == kv.block_table(1)[:10]
    assert hit.sliding is not None and hit.sliding.num_tokens == 40 and hit.sliding.block_offset == 9
    assert hit.sliding.block_ids == (kv.sliding_block_table(1) or [])[:1]
    assert kv.allocate_slots(b, 41, hit) is not None
    assert kv.block_table(2)[:10] == kv.block_table(1)[:10]
    assert kv.sliding_block_offset(2) == 9


def test_a_hit_stops_where_the_sliding_window_has_a_hole() -> None:
    kv = KVCacheManager(32, 2, sliding_group=(5, 16))
    tokens = list(range(16))
    a = make_request(1, tokens, 1)
    assert kv.allocate_slots(a, 16) is not None
    confirm(kv, a, 16)
    table = list(kv.sliding_block_table(1) or [])
    kv.free(a)
    # Evict the sliding group's block 7 alone (hold the others, take the 8 unused ones and it).
    pool = sliding(kv).pool
    pool.touch(table[:7])
    taken = pool.allocate(9)
    assert taken is not None and taken[-1] == table[7]
    pool.release(table[:7])
    pool.release(taken)
    b = make_request(2, [*tokens, 3], 1)
    hit = kv.find_cached_prefix(b)
    # The global chain holds all 8 blocks; the sliding window of position 16 needs block 7: the
    # longest prefix whose window avoids it is 14 tokens (position 14 reads 10..14, blocks 5 and 6).
    assert hit.num_tokens == 14 and len(hit.block_ids) == 7
    assert hit.sliding == CacheHit(table[5:7], 14, 5)


def test_the_global_chain_bounds_the_hit() -> None:
    kv = KVCacheManager(8, 4, sliding_group=(4, 32))
    a = make_request(1, list(range(24)), 1)
    assert kv.allocate_slots(a, 24) is not None
    confirm(kv, a, 24)
    kv.free(a)
    filler = make_request(2, list(range(100, 120)), 1)
    assert kv.allocate_slots(filler, 20) is not None  # evicts a's last global blocks first
    b = make_request(3, [*range(24), 5], 1)
    hit = kv.find_cached_prefix(b)
    cached = sum(kv.pool.lookup(h) is not None for h in a.block_hashes)
    assert hit.num_tokens == cached * 4 and len(hit.block_ids) == cached
    assert hit.sliding is not None and hit.sliding.num_tokens == hit.num_tokens


def test_prefix_of_gives_both_groups() -> None:
    kv = KVCacheManager(32, 4, sliding_group=(4, 32))
    a = make_request(1, list(range(20)), 8)
    assert kv.allocate_slots(a, 20) is not None
    hit = kv.prefix_of(1, 4)
    assert hit is not None and hit.block_ids == kv.block_table(1)[:4]
    assert hit.sliding == CacheHit((kv.sliding_block_table(1) or [])[3:4], 16, 3)
    confirm(kv, a, 20)
    assert kv.allocate_slots(a, 21) is not None  # the sliding group drops blocks 0..3
    assert kv.prefix_of(1, 4) is None


def test_a_hit_without_its_sliding_part_is_refused() -> None:
    kv = KVCacheManager(32, 4, sliding_group=(4, 32))
    a = make_request(1, list(range(20)), 8)
    assert kv.allocate_slots(a, 20) is not None
    with pytest.raises(ValueError, match="sliding"):
        kv.allocate_slots(make_request(2, list(range(20)), 8), 20, CacheHit(kv.block_table(1)[:4], 16))


# ----------------------------------------------------------------------------------------------
# The scheduler, pipelined, with a fake model that reads both groups
# ----------------------------------------------------------------------------------------------


@dataclass
class _Copied:
    item: ScheduledRequest
    table: list[int]
    sliding_offset: int
    sliding_table: list[int]


class HybridModel:
    """The device: writes every new position's prefix key in both groups, then reads each query's
    whole context through the global table and its window through the sliding one."""

    def __init__(self, kv: KVCacheManager, window: int) -> None:
        self.kv = kv
        self.window = window
        self.slots: dict[tuple[str, int, int], int] = {}
        self._keys: dict[int, list[int]] = {}

    def copy(self, out: SchedulerOutput) -> list[_Copied]:
        kv = self.kv
        copied = []
        for item in out.scheduled:
            rid = item.request.request_id
            copied.append(
                _Copied(
                    item,
                    list(kv.block_table(rid)),
                    kv.sliding_block_offset(rid),
                    list(kv.sliding_block_table(rid) or []),
                )
            )
            end = item.start + item.num_new_tokens
            assert kv.block_offset(rid) == 0 and len(kv.block_table(rid)) * kv.block_size >= end
            first_read = max(0, item.start - self.window + 1) // kv.block_size
            assert kv.sliding_block_offset(rid) <= first_read, "a block the step reads left the sliding table"
            assert (kv.sliding_block_offset(rid) + len(kv.sliding_block_table(rid) or [])) * kv.block_size >= end
        return copied

    def _prefix_keys(self, request: Request, end: int) -> list[int]:
        keys = self._keys.setdefault(request.request_id, [])
        for token in request.token_ids(len(keys), end):
            keys.append(hash((keys[-1] if keys else None, token)))
        return keys

    def execute(self, copied: list[_Copied]) -> None:
        size = self.kv.block_size
        for c in copied:
            keys = self._prefix_keys(c.item.request, c.item.start + c.item.num_new_tokens)
            for pos in range(c.item.start, c.item.start + c.item.num_new_tokens):
                self.slots[("global", c.table[pos // size], pos % size)] = keys[pos]
                self.slots[("sliding", c.sliding_table[pos // size - c.sliding_offset], pos % size)] = keys[pos]
        for c in copied:
            end = c.item.start + c.item.num_new_tokens
            keys = self._prefix_keys(c.item.request, end)
            rid = c.item.request.request_id
            for query in range(c.item.start, end):
                for pos in range(query + 1):
                    assert self.slots.get(("global", c.table[pos // size], pos % size)) == keys[pos], (
                        f"request {rid} at {query} reads a wrong global key at {pos}"
                    )
                for pos in range(max(0, query - self.window + 1), query + 1):
                    block = c.sliding_table[pos // size - c.sliding_offset]
                    assert self.slots.get(("sliding", block, pos % size)) == keys[pos], (
                        f"request {rid} at {query} reads a wrong sliding key at {pos}"
                    )


def run_pipelined(scheduler: Scheduler, model: HybridModel, *, on_step: object = None) -> int:
    in_flight: tuple[SchedulerOutput, list[_Copied]] | None = None
    steps = 0
    while scheduler.has_work() or in_flight is not None:
        assert steps < 20_000, "the scheduler does not terminate"
        out = scheduler.schedule()
        copied = model.copy(out)
        if in_flight is not None:
            previous, previous_copied = in_flight
            model.execute(previous_copied)
            sampled = [7 + item.request.request_id for item in previous.scheduled if item.sample]
            scheduler.update(previous, StepOutput(sampled))
            if callable(on_step):
                on_step()
        in_flight = (out, copied) if out.scheduled else None
        steps += 1
    return steps


def _scheduler(
    num_blocks: int, sliding_blocks: int, block_size: int, window: int, *, budget: int, prefix_caching: bool
) -> Scheduler:
    kv = KVCacheManager(
        num_blocks, block_size, enable_prefix_caching=prefix_caching, sliding_group=(window, sliding_blocks)
    )
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget)


def test_a_long_generation_holds_a_bounded_number_of_sliding_blocks() -> None:
    window, size = 32, 16
    scheduler = _scheduler(64, 8, size, window, budget=256, prefix_caching=True)
    kv = scheduler.kv_cache
    request = make_request(1, [i % 50 for i in range(100)], 400)
    scheduler.add(request)
    most = [0]

    def measure() -> None:
        if len(request.output_token_ids) > 1:
            most[0] = max(most[0], held(sliding(kv)))

    run_pipelined(scheduler, HybridModel(kv, window), on_step=measure)
    assert len(request.output_token_ids) == 400
    # 500 tokens: 32 global blocks, but at most ceil(window / block) + 2 sliding ones at a time.
    assert most[0] <= -(-window // size) + 2
    assert sliding(kv).num_window_freed_blocks >= 500 // size - 4
    assert held(kv) == 0 and held(sliding(kv)) == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_when_the_sliding_pool_runs_out(prefix_caching: bool) -> None:
    # The global pool is ample; the sliding pool (14 blocks of 4) holds one request's window and two
    # chunks (one in flight), not three requests': requests are preempted for it and recomputed.
    scheduler = _scheduler(64, 14, 4, 10, budget=16, prefix_caching=prefix_caching)
    requests = [make_request(i, [(i * 5 + j) % 13 for j in range(30)], 40) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    run_pipelined(scheduler, HybridModel(scheduler.kv_cache, 10))
    assert scheduler.num_preemptions > 0
    assert all(len(r.output_token_ids) == 40 for r in requests)
    assert held(scheduler.kv_cache) == 0 and held(sliding(scheduler.kv_cache)) == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_sample_shares_both_groups_or_neither(prefix_caching: bool) -> None:
    scheduler = _scheduler(64, 64, 4, 4, budget=64, prefix_caching=prefix_caching)
    first = make_request(1, list(range(20)), 10)
    sample = dataclasses.replace(first, request_id=2, sample_index=1, output_token_ids=[], block_hashes=[], forks=[])
    first.group = sample.group = [first, sample]
    first.forks = [sample]
    scheduler.add(first)
    run_pipelined(scheduler, HybridModel(scheduler.kv_cache, 4))
    assert sample.num_cached_tokens == (16 if prefix_caching else 0)
    assert len(first.output_token_ids) == len(sample.output_token_ids) == 10
    assert held(scheduler.kv_cache) == 0 and held(sliding(scheduler.kv_cache)) == 0


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(8, 40),
    sliding_share=st.floats(0.3, 1.0),
    budget=st.integers(1, 24),
    prefix_caching=st.booleans(),
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=4),
    max_tokens=st.integers(1, 20),
    shared=st.integers(0, 20),
)
def test_random_workloads_read_the_right_kv_in_both_groups(
    window: int,
    block_size: int,
    num_blocks: int,
    sliding_share: float,
    budget: int,
    prefix_caching: bool,
    prompts: list[list[int]],
    max_tokens: int,
    shared: int,
) -> None:
    # The sliding pool must hold one request's window, a chunk and the step in flight at least.
    floor = -(-(window + 2 * budget) // block_size) + 2
    sliding_blocks = max(floor, int(num_blocks * sliding_share))
    scheduler = _scheduler(num_blocks, sliding_blocks, block_size, window, budget=budget, prefix_caching=prefix_caching)
    base = prompts[0]
    requests = []
    for i, prompt in enumerate(prompts):
        tokens = base[:shared] + prompt if i else prompt
        if len(tokens) + max_tokens > num_blocks * block_size // 2:
            continue  # one request alone must fit the global pool
        requests.append(make_request(i, tokens, max_tokens))
        scheduler.add(requests[-1])
    run_pipelined(scheduler, HybridModel(scheduler.kv_cache, window))
    assert all(len(r.output_token_ids) == max_tokens for r in requests)
    kv = scheduler.kv_cache
    assert held(kv) == 0 and held(sliding(kv)) == 0
