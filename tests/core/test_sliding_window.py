"""The KV manager with a sliding window: blocks that leave the window go back to the pool.

A model whose every layer attends only to the last ``W`` positions never reads a block again once it
lies wholly before the window of the request's next token. The manager drops such blocks from the
front of the table (``block_offset``), keeps its prefix-cache entries (a dropped block is free and
evictable, like a finished request's), and a prefix hit needs only the blocks within the window of
the request's first token to compute.

A fake model plays the device with the engine's pipelining: step N+1 is scheduled (and its tables
copied, as ``EngineCore._batch`` does) before step N runs and is confirmed. Every step writes each
new position's key (a hash of the whole prefix) through the copied table and then reads, for every
query, the positions of its window: a block dropped too early, handed to another request, or served
by a wrong prefix-cache hit shows up as a wrong key, or as a window the copied table does not cover.
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






# ----------------------------------------------------------------------------------------------
# The manager alone
# ----------------------------------------------------------------------------------------------


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(8, 4, sliding_window=0)


def test_first_needed_block() -> None:
    kv = KVCacheManager(8, 4, sliding_window=6)
    # Position p attends to p - 5 .. p: the block of p - 5.
    assert [kv.first_needed_block(p) for p in (0, 5, 8, 9, 12, 13, 40)] == [0, 0, 0, 1, 1, 2, 8]
    assert KVCacheManager(8, 4).first_needed_block(40) == 0


def test_blocks_before_the_window_of_the_confirmed_tokens_are_returned() -> None:
    kv = KVCacheManager(64, 4, sliding_window=6)
    request = make_request(1, list(range(40)), 8)
    first = kv.allocate_slots(request, 40)
    assert first is not None and len(first) == 10
    # Scheduled but not confirmed: a step still to run or in flight may read every block.
    assert kv.allocate_slots(request, 40) == []
    assert kv.block_offset(1) == 0 and held(kv) == 10
    confirm(kv, request, 40)
    new = kv.allocate_slots(request, 41)  # position 40 attends to 35..40: blocks 8 and up
    assert new is not None and len(new) == 1
    assert kv.block_offset(1) == 8
    assert kv.block_table(1) == first[8:] + new
    assert held(kv) == 3 and kv.num_window_freed_blocks == 8
    assert all(kv.pool.ref_count(b) == 0 for b in first[:8])
    kv.free(request)
    assert held(kv) == 0 and kv.block_offset(1) == 0


def test_without_a_window_nothing_leaves() -> None:
    kv = KVCacheManager(64, 4)
    request = make_request(1, list(range(40)), 8)
    assert kv.allocate_slots(request, 40) is not None
    confirm(kv, request, 40)
    assert kv.allocate_slots(request, 41) is not None
    assert kv.block_offset(1) == 0 and len(kv.block_table(1)) == 11 and kv.num_window_freed_blocks == 0


def test_a_failed_allocation_still_returns_the_blocks_that_left() -> None:
    kv = KVCacheManager(10, 4, sliding_window=4)
    request = make_request(1, list(range(40)), 40)
    assert kv.allocate_slots(request, 40) is not None  # every block
    confirm(kv, request, 40)
    # 13 more tokens need 4 more blocks; the window returns 9 (position 40 reads 37..40): it fits.
    assert kv.allocate_slots(request, 53) is not None
    assert kv.block_offset(1) == 9 and len(kv.block_table(1)) == 5
    other = make_request(2, list(range(100, 120)), 1)
    assert kv.allocate_slots(other, 20) is not None  # 5 blocks: the pool is full
    confirm(kv, request, 53)
    # 20 more tokens need 5 more blocks; the window returns 3 (position 53 reads 50..53): too few.
    assert kv.allocate_slots(request, 73) is None
    assert kv.block_offset(1) == 12 and len(kv.block_table(1)) == 2 and held(kv) == 7


def test_dropped_blocks_stay_cached_until_evicted() -> None:
    kv = KVCacheManager(32, 4, sliding_window=4)
    prompt = list(range(40))
    a = make_request(1, prompt, 8)
    assert kv.allocate_slots(a, 40) is not None
    confirm(kv, a, 40)
    assert kv.allocate_slots(a, 41) is not None
    assert kv.block_offset(1) == 9
    # A second request with the same prompt: every block of its window is cached (held or free).
    b = make_request(2, [*prompt, 99], 8)
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 40
    # Its first token to compute (position 40) reads 37..40: it takes block 9 on, never blocks 0..8.
    assert hit.block_offset == 9 and hit.block_ids == kv.block_table(1)[:1]
    before = [kv.pool.ref_count(block) for block in range(32)]
    assert kv.allocate_slots(b, 41, hit) is not None
    assert kv.block_offset(2) == 9 and kv.block_table(2)[0] == kv.block_table(1)[0]
    after = [kv.pool.ref_count(block) for block in range(32)]
    assert sum(after) - sum(before) == 2  # block 9 shared, one new block


def test_a_hit_needs_only_the_window_of_its_first_token() -> None:
    kv = KVCacheManager(12, 4, sliding_window=5)
    prompt = list(range(32))
    a = make_request(1, prompt, 1)
    assert kv.allocate_slots(a, 32) is not None
    confirm(kv, a, 32)
    kv.free(a)  # 8 cached blocks in the free queue; the 4 never used come first, then a's tail first
    filler = make_request(2, list(range(500, 524)), 1)
    assert kv.allocate_slots(filler, 24) is not None  # 6 blocks: the 4 unused, then a's blocks 7 and 6
    assert [kv.pool.lookup(h) is not None for h in a.block_hashes] == [True] * 6 + [False] * 2
    b = make_request(3, [*prompt[:28], 7, 7, 7], 1)  # shares a's first 7 blocks
    hit = kv.find_cached_prefix(b)
    # Block 6 is gone, so at most 24 tokens; position 24 reads 20..24: blocks 5 on.
    assert (hit.num_tokens, hit.block_offset) == (24, 5)
    assert hit.block_ids == [kv.pool.lookup(a.block_hashes[5])]
    assert kv.allocate_slots(b, 31, hit) is not None
    assert kv.block_offset(3) == 5 and kv.block_table(3)[0] == hit.block_ids[0]


@pytest.mark.parametrize(("hole", "expected"), [(5, (16, 6)), (6, (12, 4)), (7, (14, 5))])
def test_a_hit_stops_before_a_hole_in_its_window(hole: int, expected: tuple[int, int]) -> None:
    kv = KVCacheManager(16, 2, sliding_window=5)
    tokens = list(range(16))
    a = make_request(1, tokens, 1)
    assert kv.allocate_slots(a, 16) is not None
    confirm(kv, a, 16)
    table = list(kv.block_table(1))
    kv.free(a)
    # Evict block ``hole`` alone: hold the blocks after it, take the 8 unused ones and the hole.
    kv.pool.touch(table[hole + 1 :])
    taken = kv.pool.allocate(9)
    assert taken is not None and taken[-1] == table[hole]
    kv.pool.release(table[hole + 1 :])
    kv.pool.release(taken)
    b = make_request(2, [*tokens, 3], 1)
    hit = kv.find_cached_prefix(b)
    # Eight cached blocks but one: the longest prefix whose next token's window (5 positions, so the
    # blocks of positions n - 4 .. n - 1) holds no hole. A window-blind cache would stop at the hole.
    assert (hit.num_tokens, hit.block_offset) == expected
    assert hit.block_ids == table[expected[1] : expected[0] // 2]


def test_prefix_of_shares_only_the_window_and_refuses_a_dropped_block() -> None:
    kv = KVCacheManager(32, 4, sliding_window=4)
    a = make_request(1, list(range(20)), 8)
    assert kv.allocate_slots(a, 20) is not None
    table = list(kv.block_table(1))
    # A sample computes from position 16 (reads 13..16): blocks 3 on of a's first four.
    hit = kv.prefix_of(1, 4)
    assert hit == CacheHit(table[3:4], 16, 3)
    confirm(kv, a, 20)
    assert kv.allocate_slots(a, 21) is not None  # position 20 reads 17..20: a drops blocks 0..3
    assert kv.block_offset(1) == 4
    assert kv.prefix_of(1, 4) is None
    assert KVCacheManager(8, 4).prefix_of(7, 1) is None  # holds nothing


def test_a_hit_passed_whole_is_trimmed_to_the_window() -> None:
    kv = KVCacheManager(32, 4, sliding_window=4)
    a = make_request(1, list(range(20)), 8)
    assert kv.allocate_slots(a, 20) is not None
    table = list(kv.block_table(1))
    b = make_request(2, list(range(20)), 8)
    assert kv.allocate_slots(b, 20, CacheHit(table[:4], 16)) is not None
    assert kv.block_offset(2) == 3 and kv.block_table(2)[0] == table[3]
    assert [kv.pool.ref_count(x) for x in table[:4]] == [1, 1, 1, 2]


def test_blocks_cached_after_a_windowed_hit_line_up() -> None:
    kv = KVCacheManager(32, 4, sliding_window=4)
    prompt = list(range(24))
    a = make_request(1, prompt, 1)
    assert kv.allocate_slots(a, 24) is not None
    confirm(kv, a, 24)
    kv.free(a)
    b = make_request(2, [*prompt[:16], *range(50, 62)], 1)
    hit = kv.find_cached_prefix(b)
    assert (hit.num_tokens, hit.block_offset) == (16, 3)
    assert kv.allocate_slots(b, 28, hit) is not None
    confirm(kv, b, 28)
    offset = kv.block_offset(2)
    for index in range(offset, 7):
        assert kv.pool.lookup(b.block_hashes[index]) == kv.block_table(2)[index - offset]


# ----------------------------------------------------------------------------------------------
# The scheduler, pipelined, with a fake model that reads only the window
# ----------------------------------------------------------------------------------------------


@dataclass
class _Copied:
    """One scheduled request as the runner receives it: its table copied at scheduling time."""

    item: ScheduledRequest
    offset: int
    table: list[int]


class WindowedModel:
    """The device: writes every new position's prefix key, then reads each query's window."""

    def __init__(self, kv: KVCacheManager, window: int) -> None:
        self.kv = kv
        self.window = window
        self.slots: dict[tuple[int, int], int] = {}
        self._keys: dict[int, list[int]] = {}

    def copy(self, out: SchedulerOutput) -> list[_Copied]:
        kv = self.kv
        copied = []
        for item in out.scheduled:
            rid = item.request.request_id
            copied.append(_Copied(item, kv.block_offset(rid), list(kv.block_table(rid))))
            # The table covers every position the step writes or any of its queries reads.
            first_read = max(0, item.start - self.window + 1) // kv.block_size
            assert kv.block_offset(rid) <= first_read, "a block the step reads left the table"
            assert (kv.block_offset(rid) + len(kv.block_table(rid))) * kv.block_size >= item.start + item.num_new_tokens
        return copied

    def _prefix_keys(self, request: Request, end: int) -> list[int]:
        # Every token a step feeds is known when it runs (the previous step's update came first).
        keys = self._keys.setdefault(request.request_id, [])
        for token in request.token_ids(len(keys), end):
            keys.append(hash((keys[-1] if keys else None, token)))
        return keys

    def execute(self, copied: list[_Copied]) -> None:
        size = self.kv.block_size
        for c in copied:
            keys = self._prefix_keys(c.item.request, c.item.start + c.item.num_new_tokens)
            for pos in range(c.item.start, c.item.start + c.item.num_new_tokens):
                self.slots[(c.table[pos // size - c.offset], pos % size)] = keys[pos]
        for c in copied:
            end = c.item.start + c.item.num_new_tokens
            keys = self._prefix_keys(c.item.request, end)
            for query in range(c.item.start, end):
                for pos in range(max(0, query - self.window + 1), query + 1):
                    block = c.table[pos // size - c.offset]
                    assert self.slots.get((block, pos % size)) == keys[pos], (
                        f"request {c.item.request.request_id} at {query} reads a wrong key at {pos}"
                    )


def run_pipelined(scheduler: Scheduler, model: WindowedModel, *, on_step: object = None) -> int:
    """Schedule step N+1 before step N runs, as the engine does; return the steps run."""
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


def _scheduler(num_blocks: int, block_size: int, window: int, *, budget: int, prefix_caching: bool) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching, sliding_window=window)
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget)


def test_a_long_generation_holds_a_bounded_number_of_blocks() -> None:
    window, size = 32, 16
    scheduler = _scheduler(64, size, window, budget=256, prefix_caching=True)
    kv = scheduler.kv_cache
    request = make_request(1, [i % 50 for i in range(100)], 400)
    scheduler.add(request)
    model = WindowedModel(kv, window)
    most = [0]

    def measure() -> None:
        if len(request.output_token_ids) > 1:  # past the prompt's step
            most[0] = max(most[0], held(kv))

    run_pipelined(scheduler, model, on_step=measure)
    assert request.output_token_ids and len(request.output_token_ids) == 400
    # 500 tokens need 32 blocks; at most ceil(window / block) + 1 plus the one in flight are held.
    assert most[0] <= -(-window // size) + 2
    assert kv.num_window_freed_blocks >= 500 // size - 4
    assert held(kv) == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_chunked_prefill_across_the_window(prefix_caching: bool) -> None:
    scheduler = _scheduler(64, 4, 10, budget=7, prefix_caching=prefix_caching)
    requests = [make_request(i, [(i * 7 + j) % 11 for j in range(50 + i)], 20) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    model = WindowedModel(scheduler.kv_cache, 10)
    run_pipelined(scheduler, model)
    assert all(len(r.output_token_ids) == 20 for r in requests)
    assert scheduler.kv_cache.num_window_freed_blocks > 0 and held(scheduler.kv_cache) == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_and_recompute(prefix_caching: bool) -> None:
    # 12 blocks of 4 for three requests that each hold up to 5 at a time (a window of 10 plus a
    # chunk): the pool runs out and requests are preempted and recomputed.
    scheduler = _scheduler(12, 4, 10, budget=16, prefix_caching=prefix_caching)
    requests = [make_request(i, [(i * 5 + j) % 13 for j in range(30)], 40) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    run_pipelined(scheduler, WindowedModel(scheduler.kv_cache, 10))
    assert scheduler.num_preemptions > 0
    assert all(len(r.output_token_ids) == 40 for r in requests)
    assert held(scheduler.kv_cache) == 0


def test_two_requests_sharing_a_prefix_longer_than_the_window() -> None:
    scheduler = _scheduler(64, 4, 8, budget=64, prefix_caching=True)
    shared = [j % 17 for j in range(60)]
    first = make_request(1, [*shared, 1, 2], 30)
    scheduler.add(first)
    model = WindowedModel(scheduler.kv_cache, 8)
    run_pipelined(scheduler, model)
    second = make_request(2, [*shared, 3, 4, 5], 30)
    scheduler.add(second)
    run_pipelined(scheduler, model)
    # The first request dropped most of the shared blocks long ago; they stayed cached (free), and
    # the second takes those of the window at position 60 only.
    assert second.num_cached_tokens == 60
    assert len(second.output_token_ids) == 30 and held(scheduler.kv_cache) == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_sample_does_not_share_a_block_its_first_sample_dropped(prefix_caching: bool) -> None:
    scheduler = _scheduler(64, 4, 4, budget=64, prefix_caching=prefix_caching)
    first = make_request(1, list(range(20)), 10)
    sample = dataclasses.replace(first, request_id=2, sample_index=1, output_token_ids=[], block_hashes=[], forks=[])
    first.group = sample.group = [first, sample]
    first.forks = [sample]
    scheduler.add(first)
    run_pipelined(scheduler, WindowedModel(scheduler.kv_cache, 4))
    # The sample computes from position 16 at best, reading block 3, which the first sample dropped as
    # soon as its prompt was confirmed (position 20 reads 17..20): only the prefix cache still has it.
    assert sample.num_cached_tokens == (16 if prefix_caching else 0)
    assert len(first.output_token_ids) == len(sample.output_token_ids) == 10
    assert held(scheduler.kv_cache) == 0


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 24),
    prefix_caching=st.booleans(),
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=4),
    max_tokens=st.integers(1, 20),
    shared=st.integers(0, 20),
)
def test_random_workloads_read_the_right_kv(
    window: int,
    block_size: int,
    num_blocks: int,
    budget: int,
    prefix_caching: bool,
    prompts: list[list[int]],
    max_tokens: int,
    shared: int,
) -> None:
    scheduler = _scheduler(num_blocks, block_size, window, budget=budget, prefix_caching=prefix_caching)
    base = prompts[0]
    requests = []
    for i, prompt in enumerate(prompts):
        tokens = base[:shared] + prompt if i else prompt  # shared prefixes make prefix hits common
        if len(tokens) + max_tokens > num_blocks * block_size // 2:
            continue  # one request alone must fit the pool, or the scheduler rightly stalls
        requests.append(make_request(i, tokens, max_tokens))
        scheduler.add(requests[-1])
    run_pipelined(scheduler, WindowedModel(scheduler.kv_cache, window))
    assert all(len(r.output_token_ids) == max_tokens for r in requests)
    kv = scheduler.kv_cache
    assert held(kv) == 0 and all(kv.pool.ref_count(b) == 0 for b in range(num_blocks))


@pytest.mark.parametrize("hybrid", [False, True])
def test_trimming_a_rejected_draft_counts_from_the_window(hybrid: bool) -> None:
    """Speculative decoding trims a rejected draft's blocks (``trim``) from a table whose first blocks
    left the window: the kept blocks are counted from ``block_offset``, and a hybrid model's sliding
    group gives its draft blocks back too."""
    window, block = 16, 4
    if hybrid:
        kv = KVCacheManager(64, block, sliding_group=(window, 64))
        group = kv.sliding
        assert group is not None
    else:
        kv = group = KVCacheManager(64, block, sliding_window=window)
    request = make_request(0, list(range(40)), max_tokens=20)
    assert kv.allocate_slots(request, 40) is not None
    confirm(kv, request, 40)
    assert kv.allocate_slots(request, 41 + 6) is not None  # the newest token and a draft of 6: 47 slots
    assert group.block_offset(0) > 0  # the premise: the window's edge moved past the first blocks
    before = held(group)
    kv.trim(request, 42)  # one draft token accepted: 42 tokens' KV kept
    kept = -(-42 // block) - group.block_offset(0)
    assert len(group.block_table(0)) == kept
    assert held(group) == before - (-(-47 // block) - -(-42 // block))
    kv.free(request)
    assert held(kv) == 0 and held(group) == 0
