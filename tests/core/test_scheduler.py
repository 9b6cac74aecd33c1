"""Tests of asyncllm.core._scheduler: token budget, chunked prefill, admission order, preemption, finishing.

A tiny loop plays the model: it calls ``schedule()``, writes and reads a fake paged KV cache through
the block tables (so a step that would attend to the wrong KV fails), "samples" a token for every
scheduled request with ``sample=True`` and hands them to ``update()``.
"""

from __future__ import annotations

import subprocess
import sys
import weakref
from collections.abc import Callable

# Another test module of the same session may already have imported torch; then the module-level
# check below cannot see anything, and test_imports_without_torch checks in a fresh interpreter.
_TORCH_PRELOADED = "torch" in sys.modules

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from asyncllm.core._request import Request, RequestStatus  # noqa: E402
from asyncllm.core._scheduler import Scheduler, SchedulerOutput, TokenEvent  # noqa: E402
from asyncllm.core.kv import KVCacheManager  # noqa: E402
from asyncllm.core.kv._manager import blocks_needed  # noqa: E402
from asyncllm.executor._runner import StepOutput  # noqa: E402
from asyncllm.sampling_params import SamplingParams  # noqa: E402

assert _TORCH_PRELOADED or "torch" not in sys.modules, "the scheduler must not import torch"

TOKEN = 7
"""What the fake model samples unless a test says otherwise."""
NEVER_SAMPLED = 10**9
"""A stop token id the fake model never produces."""


def test_imports_without_torch() -> None:
    code = (
        "import sys, asyncllm.core._scheduler, asyncllm.core._request, asyncllm.sampling_params, "
        "asyncllm.core.kv, asyncllm.executor._runner, asyncllm.executor._lookahead; "
        "assert 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def make_request(
    request_id: int,
    prompt_len: int,
    max_tokens: int,
    *,
    stop_token_ids: frozenset[int] = frozenset({NEVER_SAMPLED}),
    max_total_tokens: int | None = None,
    token_ids: list[int] | None = None,
) -> Request:
    if token_ids is None:
        token_ids = [(request_id * 31 + i) % 200 for i in range(prompt_len)]
    assert len(token_ids) == prompt_len
    return Request(
        request_id=request_id,
        prompt_token_ids=token_ids,
        params=SamplingParams(max_tokens=max_tokens),
        stop_token_ids=stop_token_ids,
        max_total_tokens=max_total_tokens if max_total_tokens is not None else prompt_len + max_tokens + 1000,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = False,
) -> Scheduler:
    # Prefix caching is off unless a test is about it: with it, a preempted request may resume
    # from its own cached blocks instead of from zero.
    return Scheduler(
        KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def check_schedule(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Invariants every schedule() result must satisfy."""
    kv = scheduler.kv_cache
    assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
    assert len(out.scheduled) <= scheduler.max_num_seqs
    assert len(scheduler.running) <= scheduler.max_num_seqs
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    for item in out.scheduled:
        request = item.request
        assert request.status is RequestStatus.RUNNING
        assert request in scheduler.running
        assert item.num_new_tokens >= 1
        # Scheduling is optimistic: the chunk counts as computed at once, a sampled token as pending.
        assert item.start + item.num_new_tokens == request.num_computed_tokens
        assert item.start + item.num_new_tokens <= request.num_tokens + request.num_pending_tokens
        assert item.sample == (
            item.start + item.num_new_tokens == request.num_tokens + request.num_pending_tokens - item.sample
        )
        # The request's table covers every token it will have KV for after the step.
        assert len(kv.block_table(request.request_id)) * kv.block_size >= item.start + item.num_new_tokens
    for request in scheduler.waiting:
        assert request.status is RequestStatus.WAITING
        assert kv.block_table(request.request_id) == [], "a waiting request holds blocks"
    holders: dict[int, int] = {}
    for request in scheduler.running:
        table = kv.block_table(request.request_id)
        assert len(table) == len(set(table))
        for block in table:
            holders[block] = holders.get(block, 0) + 1
    for block in range(kv.pool.num_blocks):
        assert kv.pool.ref_count(block) == holders.get(block, 0)
    assert len(holders) + kv.num_free_blocks == kv.pool.num_blocks


Sampler = Callable[[Request], int]


class PagedKV:
    """The fake model's KV cache: what a real model would store in each slot, checked on every read.

    A position's KV depends on its token and everything before it, so each slot records a key of
    the whole prefix up to that position. A step writes its tokens' keys through the block table
    and then "attends" to every earlier position of the request: reading a slot that some other
    sequence (or nobody) wrote means the scheduler or the prefix cache handed out the wrong block.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.kv = scheduler.kv_cache
        self.slots: dict[tuple[int, int], int] = {}
        self._prefix_keys: dict[int, list[int]] = {}  # request id -> key of each prefix

    def _keys(self, request: Request, end: int) -> list[int]:
        keys = self._prefix_keys.setdefault(request.request_id, [])
        if len(keys) < end:
            for token in request.token_ids(len(keys), end):
                keys.append(hash((keys[-1] if keys else None, token)))
        return keys

    def execute(self, out: SchedulerOutput) -> None:
        size = self.kv.block_size
        for item in out.scheduled:
            table = self.kv.block_table(item.request.request_id)
            keys = self._keys(item.request, item.start + item.num_new_tokens)
            for pos in range(item.start, item.start + item.num_new_tokens):
                block = table[pos // size]
                assert self.kv.pool.ref_count(block) == 1, "a step writes into a block another request holds"
                self.slots[(block, pos % size)] = keys[pos]
        for item in out.scheduled:
            table = self.kv.block_table(item.request.request_id)
            end = item.start + item.num_new_tokens
            keys = self._keys(item.request, end)
            seen = [self.slots.get((table[pos // size], pos % size)) for pos in range(end)]
            assert seen == keys[:end], f"request {item.request.request_id} attends to the wrong KV"


_MODELS: weakref.WeakKeyDictionary[Scheduler, PagedKV] = weakref.WeakKeyDictionary()


def fake_model(scheduler: Scheduler) -> PagedKV:
    """The scheduler's fake model (one per scheduler, made on first use)."""
    model = _MODELS.get(scheduler)
    if model is None:
        model = _MODELS[scheduler] = PagedKV(scheduler)
    return model


def step(scheduler: Scheduler, sampler: Sampler = lambda request: TOKEN) -> tuple[SchedulerOutput, list[TokenEvent]]:
    """One schedule/execute/update round with the fake model."""
    out = scheduler.schedule()
    check_schedule(scheduler, out)
    fake_model(scheduler).execute(out)
    sampled = [sampler(item.request) for item in out.scheduled if item.sample]
    events = scheduler.update(out, StepOutput(sampled))
    return out, events


def step_until(scheduler: Scheduler, done: Callable[[SchedulerOutput], bool], max_steps: int = 1000) -> SchedulerOutput:
    """Step until ``done(output)`` holds; return that step's output."""
    for _ in range(max_steps):
        out, _ = step(scheduler)
        if done(out):
            return out
    raise AssertionError(f"condition not reached in {max_steps} steps")


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_work():
        assert len(outputs) < max_steps, "the scheduler does not terminate"
        out, _ = step(scheduler)
        outputs.append(out)
    return outputs


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(kv.pool.ref_count(b) == 0 for b in range(kv.pool.num_blocks))


# ----------------------------------------------------------------------------------------------
# Budget and chunked prefill
# ----------------------------------------------------------------------------------------------


def test_chunked_prefill_of_a_long_prompt() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32)
    request = make_request(1, prompt_len=100, max_tokens=3)
    scheduler.add(request)
    chunks = []
    for _ in range(4):
        out, events = step(scheduler)
        assert len(out.scheduled) == 1
        item = out.scheduled[0]
        chunks.append((item.start, item.num_new_tokens, item.sample))
        if not item.sample:
            assert events == []
            assert request.output_token_ids == []
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]
    assert request.num_computed_tokens == 100
    assert request.output_token_ids == [TOKEN]
    # Then one decode token per step until max_tokens.
    outputs = run_to_completion(scheduler)
    assert [(o.scheduled[0].start, o.scheduled[0].num_new_tokens) for o in outputs if o.scheduled] == [
        (100, 1),
        (101, 1),
    ]
    assert request.output_token_ids == [TOKEN] * 3
    assert request.finish_reason == "length"
    assert_all_blocks_free(scheduler)


def test_token_budget_is_shared_across_requests_in_arrival_order() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32)
    a, b, c = make_request(1, 20, 2), make_request(2, 30, 2), make_request(3, 40, 2)
    for request in (a, b, c):
        scheduler.add(request)
    out, events = step(scheduler)
    assert [(s.request, s.num_new_tokens, s.sample) for s in out.scheduled] == [(a, 20, True), (b, 12, False)]
    assert [e.request for e in events] == [a]
    out, _ = step(scheduler)
    # a decodes first, then b's remaining 18 tokens, then c gets what is left of the budget.
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 18), (c, 13)]
    assert out.num_batched_tokens == 32
    outputs = run_to_completion(scheduler)
    assert all(o.num_batched_tokens <= 32 for o in outputs)
    assert all(len(r.output_token_ids) == 2 for r in (a, b, c))
    assert_all_blocks_free(scheduler)


def test_budget_of_one_token_still_makes_progress() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=1)
    a, b = make_request(1, 3, 2), make_request(2, 2, 1)
    scheduler.add(a)
    scheduler.add(b)
    outputs = run_to_completion(scheduler)
    assert all(o.num_batched_tokens == 1 for o in outputs)
    # a: 3 prompt tokens + 1 decode token; b: 2 prompt tokens.
    assert len(outputs) == 3 + 1 + 2
    assert a.output_token_ids == [TOKEN, TOKEN]
    assert b.output_token_ids == [TOKEN]
    assert_all_blocks_free(scheduler)


# ----------------------------------------------------------------------------------------------
# Admission: max_num_seqs, FCFS, decode first
# ----------------------------------------------------------------------------------------------


def test_max_num_seqs_caps_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=1000)
    requests = [make_request(i, 5, 3) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    out, _ = step(scheduler)
    assert [s.request for s in out.scheduled] == requests[:2]
    assert list(scheduler.waiting) == requests[2:]
    outputs = [out, *run_to_completion(scheduler)]
    assert max(len(o.scheduled) for o in outputs) == 2
    # Requests 2 and 3 only start once 0 and 1 have finished (after 3 steps).
    first_step = {
        r.request_id: next(i for i, o in enumerate(outputs) if r in [s.request for s in o.scheduled]) for r in requests
    }
    assert first_step == {0: 0, 1: 0, 2: 3, 3: 3, 4: 6}
    assert all(r.output_token_ids == [TOKEN] * 3 for r in requests)
    assert_all_blocks_free(scheduler)


def test_admission_is_first_come_first_served() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    requests = [make_request(i, 4, 2) for i in (5, 3, 9, 1)]  # ids deliberately not sorted
    for request in requests:
        scheduler.add(request)
    outputs = run_to_completion(scheduler)
    order = []
    for out in outputs:
        for item in out.scheduled:
            if item.request.request_id not in order:
                order.append(item.request.request_id)
    assert order == [5, 3, 9, 1]
    assert_all_blocks_free(scheduler)


def test_a_waiting_request_that_does_not_fit_blocks_later_ones() -> None:
    # FCFS: a small request queued behind a big one that does not fit yet is not admitted first.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=100)
    first = make_request(1, 8, 5)  # 2 blocks now, 3 at its end
    big = make_request(2, 12, 1)  # 3 blocks
    small = make_request(3, 1, 1)  # 1 block
    for request in (first, big, small):
        scheduler.add(request)
    out, _ = step(scheduler)
    assert [s.request for s in out.scheduled] == [first]
    assert list(scheduler.waiting) == [big, small]
    run_to_completion(scheduler)
    assert big.output_token_ids == [TOKEN] and small.output_token_ids == [TOKEN]
    assert_all_blocks_free(scheduler)


def test_decode_goes_before_new_prefill() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    a = make_request(1, 4, 5)
    scheduler.add(a)
    step(scheduler)
    b = make_request(2, 50, 1)
    scheduler.add(b)
    out, _ = step(scheduler)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 7)]
    # While b prefills in chunks, a keeps decoding one token every step.
    for _ in range(100):
        if b.output_token_ids:
            break
        out, _ = step(scheduler)
        if not a.finished:
            assert out.scheduled[0].request is a and out.scheduled[0].num_new_tokens == 1
    assert b.output_token_ids
    run_to_completion(scheduler)
    assert len(a.output_token_ids) == 5
    assert_all_blocks_free(scheduler)


def test_running_chunked_prefill_goes_before_new_prefill() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a = make_request(1, 25, 1)
    scheduler.add(a)
    step(scheduler)
    b = make_request(2, 5, 1)
    scheduler.add(b)
    out, _ = step(scheduler)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(a, 10)]
    out, _ = step(scheduler)
    assert [(s.request, s.num_new_tokens, s.sample) for s in out.scheduled] == [(a, 5, True), (b, 5, True)]
    assert_all_blocks_free(scheduler)


# ----------------------------------------------------------------------------------------------
# Preemption
# ----------------------------------------------------------------------------------------------


def test_preemption_when_blocks_run_out_recomputes_the_latest_request() -> None:
    # Each request needs 3 blocks at its end (4 + 8 - 1 = 11 tokens of KV); the cache has 4.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_request(1, 4, 8), make_request(2, 4, 8)
    scheduler.add(a)
    scheduler.add(b)
    finished_reported: list[int] = []
    preempt_step = None
    outputs = []
    while scheduler.has_work():
        assert len(outputs) < 100
        b_tokens_before = list(b.output_token_ids)
        out, _ = step(scheduler)
        outputs.append(out)
        finished_reported += out.finished_request_ids
        if preempt_step is None and scheduler.num_preemptions:
            preempt_step = len(outputs) - 1
            # The latest arrival lost its blocks and went back to the front of the queue.
            assert b.num_preemptions == 1
            assert b.status is RequestStatus.WAITING
            assert b.num_computed_tokens == 0
            assert scheduler.kv_cache.block_table(b.request_id) == []
            assert scheduler.waiting[0] is b
            assert scheduler.running == [a]
            assert [s.request for s in out.scheduled] == [a]
            assert b.output_token_ids == b_tokens_before  # its tokens so far are kept
            assert a.num_preemptions == 0
    assert preempt_step is not None, "no preemption happened"
    assert scheduler.num_preemptions == 1
    # b is recomputed from scratch: prompt plus the tokens it had already generated.
    recompute = next(s for o in outputs[preempt_step + 1 :] for s in o.scheduled if s.request is b)
    assert recompute.start == 0
    assert a.output_token_ids == [TOKEN] * 8 and a.finish_reason == "length"
    assert b.output_token_ids == [TOKEN] * 8 and b.finish_reason == "length"
    assert scheduler.schedule().finished_request_ids == []  # no step runs to carry them: they wait
    assert sorted(finished_reported + scheduler.pending_finished_request_ids) == [1, 2]
    assert_all_blocks_free(scheduler)


def test_preempted_request_is_recomputed_from_zero_with_its_outputs() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_request(1, 4, 8), make_request(2, 4, 8)
    scheduler.add(a)
    scheduler.add(b)
    step_until(scheduler, lambda out: scheduler.num_preemptions > 0)
    generated_before = len(b.output_token_ids)
    assert generated_before >= 1
    out = step_until(scheduler, lambda out: any(s.request is b for s in out.scheduled))
    (item,) = [s for s in out.scheduled if s.request is b]
    # The first step of b after readmission refeeds the prompt and every generated token.
    assert item.start == 0
    assert item.num_new_tokens == 4 + generated_before
    assert item.sample
    assert len(b.output_token_ids) == generated_before + 1
    run_to_completion(scheduler)
    assert len(b.output_token_ids) == 8
    assert_all_blocks_free(scheduler)


def test_preemption_picks_the_latest_arrival_among_several() -> None:
    scheduler = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=64)
    reqs = [make_request(i, 2, 6) for i in range(3)]  # 7 tokens of KV each: 4 blocks at the end
    for request in reqs:
        scheduler.add(request)
    step_until(scheduler, lambda out: scheduler.num_preemptions > 0)
    assert [r.num_preemptions for r in reqs] == [0, 0, 1]
    assert reqs[2].status is RequestStatus.WAITING
    run_to_completion(scheduler)
    assert all(r.output_token_ids == [TOKEN] * 6 for r in reqs)
    assert reqs[0].num_preemptions == 0
    assert_all_blocks_free(scheduler)


def test_no_admission_in_a_step_that_preempted() -> None:
    # A budget of 2 leaves one token after a's decode: enough for a one-token first chunk of the
    # preempted b, whose freed blocks would fit it. Re-admitting it at once would only thrash.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=2)
    a, b = make_request(1, 4, 8), make_request(2, 4, 8)
    scheduler.add(a)
    scheduler.add(b)
    out = step_until(scheduler, lambda out: scheduler.num_preemptions > 0)
    assert [s.request for s in out.scheduled] == [a]
    assert out.num_batched_tokens == 1
    assert list(scheduler.waiting) == [b]
    assert scheduler.kv_cache.num_free_blocks >= 1
    out, _ = step(scheduler)
    assert [(s.request, s.start) for s in out.scheduled] == [(a, 9), (b, 0)]  # back in the next step
    run_to_completion(scheduler)
    assert [len(r.output_token_ids) for r in (a, b)] == [8, 8]
    assert_all_blocks_free(scheduler)


def test_waiting_requests_keep_their_order_behind_a_preempted_one() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = make_request(1, 4, 8), make_request(2, 4, 8)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    c = make_request(3, 1, 1)
    scheduler.add(c)
    out = step_until(scheduler, lambda out: scheduler.num_preemptions > 0)
    assert [s.request for s in out.scheduled] == [a]
    assert list(scheduler.waiting) == [b, c]  # the preempted request goes to the front
    run_to_completion(scheduler)
    assert [len(r.output_token_ids) for r in (a, b, c)] == [8, 8, 1]
    assert_all_blocks_free(scheduler)


# ----------------------------------------------------------------------------------------------
# Prefix caching (the fake model checks that every step reads the right KV)
# ----------------------------------------------------------------------------------------------


def test_admission_starts_after_the_cached_prefix() -> None:
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=True)
    shared = list(range(50, 66))  # 4 full blocks
    a = make_request(1, 18, 2, token_ids=[*shared, 1, 2])
    scheduler.add(a)
    run_to_completion(scheduler)  # a's blocks are free now, but still listed in the cache
    b = make_request(2, 19, 2, token_ids=[*shared, 7, 8, 9])
    scheduler.add(b)
    out, _ = step(scheduler)
    (item,) = out.scheduled
    assert (item.start, item.num_new_tokens, item.sample) == (16, 3, True)
    assert all(scheduler.kv_cache.pool.is_cached(x) for x in scheduler.kv_cache.block_table(2)[:4])
    assert scheduler.kv_cache.num_hit_tokens == 16
    run_to_completion(scheduler)
    assert b.output_token_ids == [TOKEN, TOKEN]
    assert_all_blocks_free(scheduler)


def test_running_requests_share_cached_blocks() -> None:
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True)
    shared = list(range(50, 62))  # 3 full blocks
    a = make_request(1, 14, 6, token_ids=[*shared, 1, 2])
    scheduler.add(a)
    step(scheduler)  # a's whole prompt: its 3 full blocks get cached
    b = make_request(2, 13, 6, token_ids=[*shared, 3])
    scheduler.add(b)
    out, _ = step(scheduler)
    assert [(s.request, s.start, s.num_new_tokens) for s in out.scheduled] == [(a, 14, 1), (b, 12, 1)]
    kv = scheduler.kv_cache
    assert kv.block_table(1)[:3] == kv.block_table(2)[:3]
    assert [kv.pool.ref_count(x) for x in kv.block_table(1)[:3]] == [2, 2, 2]
    scheduler.finish(a, "abort")
    assert [kv.pool.ref_count(x) for x in kv.block_table(2)[:3]] == [1, 1, 1]
    run_to_completion(scheduler)
    assert b.output_token_ids == [TOKEN] * 6
    assert_all_blocks_free(scheduler)


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    a, b = make_request(1, 4, 13), make_request(2, 8, 8)  # 16 and 15 tokens of KV: 4 blocks each
    scheduler.add(a)
    scheduler.add(b)
    step_until(scheduler, lambda out: scheduler.num_preemptions > 0)
    assert b.num_preemptions == 1 and b.num_computed_tokens == 0
    generated = len(b.output_token_ids)
    out = step_until(scheduler, lambda out: any(s.request is b for s in out.scheduled))
    (item,) = [s for s in out.scheduled if s.request is b]
    # Recomputation skips the blocks that stayed cached (b's first one at least: its tail blocks
    # were released first and so evicted first).
    assert item.start > 0 and item.start % 4 == 0
    assert item.start + item.num_new_tokens == 8 + generated
    run_to_completion(scheduler)
    assert a.output_token_ids == [TOKEN] * 13
    assert b.output_token_ids == [TOKEN] * 8
    assert_all_blocks_free(scheduler)


# ----------------------------------------------------------------------------------------------
# Finishing
# ----------------------------------------------------------------------------------------------


def test_finish_on_stop_token() -> None:
    scheduler = make_scheduler()
    request = make_request(1, 5, 10, stop_token_ids=frozenset({TOKEN}))
    scheduler.add(request)
    _, events = step(scheduler)
    assert [(e.request, e.new_token_ids, e.finish_reason) for e in events] == [(request, [TOKEN], "stop")]
    assert request.finished and request.finish_reason == "stop"
    assert request.output_token_ids == [TOKEN]
    assert not scheduler.has_work()
    assert_all_blocks_free(scheduler)


def test_stop_token_only_when_sampled() -> None:
    scheduler = make_scheduler()
    request = make_request(1, 5, 4, stop_token_ids=frozenset({3}))
    scheduler.add(request)
    samples = iter([1, 2, 3, 4])
    run_with: Sampler = lambda r: next(samples)  # noqa: E731
    events = [e for _ in range(3) for e in step(scheduler, run_with)[1]]
    assert [e.finish_reason for e in events] == [None, None, "stop"]
    assert request.output_token_ids == [1, 2, 3]
    assert not scheduler.has_work()
    assert_all_blocks_free(scheduler)


def test_finish_on_max_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request(1, 5, 3)
    scheduler.add(request)
    reasons = [e.finish_reason for _ in range(3) for e in step(scheduler)[1]]
    assert reasons == [None, None, "length"]
    assert request.finish_reason == "length"
    assert len(request.output_token_ids) == 3
    assert not scheduler.has_work()
    assert_all_blocks_free(scheduler)


def test_finish_on_max_total_tokens() -> None:
    scheduler = make_scheduler()
    request = make_request(1, 5, 10, max_total_tokens=7)
    scheduler.add(request)
    run_to_completion(scheduler)
    assert request.output_token_ids == [TOKEN, TOKEN]
    assert request.finish_reason == "length"
    assert_all_blocks_free(scheduler)


def test_finished_request_ids_are_reported_once_by_the_next_step_that_runs() -> None:
    # The scheduler alone keeps them: a schedule with nothing to run carries none, the next one
    # that runs carries them all, once.
    scheduler = make_scheduler()
    a, b = make_request(1, 3, 1), make_request(2, 3, 2)
    scheduler.add(a)
    scheduler.add(b)
    out, _ = step(scheduler)
    assert out.finished_request_ids == []
    assert a.finished and not b.finished
    out, _ = step(scheduler)
    assert out.finished_request_ids == [1]
    assert b.finished
    out = scheduler.schedule()
    assert out.scheduled == [] and out.finished_request_ids == []
    assert scheduler.pending_finished_request_ids == [2]
    scheduler.add(make_request(3, 3, 1))
    out = scheduler.schedule()
    assert out.finished_request_ids == [2] and [s.request.request_id for s in out.scheduled] == [3]
    assert scheduler.pending_finished_request_ids == []
    assert scheduler.schedule().finished_request_ids == []


def test_finish_of_a_waiting_request() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_request(1, 3, 2), make_request(2, 3, 2)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    assert b.status is RequestStatus.WAITING
    scheduler.finish(b, "abort")
    assert b.finished and b.finish_reason == "abort"
    assert b not in scheduler.waiting
    out, _ = step(scheduler)
    assert out.finished_request_ids == [2]
    run_to_completion(scheduler)
    assert b.output_token_ids == [] and b.num_computed_tokens == 0
    assert_all_blocks_free(scheduler)


def test_finish_of_a_running_request_frees_its_blocks() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4)
    a, b = make_request(1, 10, 5), make_request(2, 3, 2)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    assert len(scheduler.kv_cache.block_table(1)) == 3
    free_before = scheduler.kv_cache.num_free_blocks
    scheduler.finish(a, "abort")
    assert scheduler.kv_cache.block_table(1) == []
    assert scheduler.kv_cache.num_free_blocks == free_before + 3
    assert a not in scheduler.running and a.finish_reason == "abort"
    scheduler.finish(a, "stop")  # idempotent: the first reason stays
    assert a.finish_reason == "abort"
    assert scheduler.kv_cache.num_free_blocks == free_before + 3
    out, _ = step(scheduler)
    assert [s.request for s in out.scheduled] == [b]
    assert out.finished_request_ids == [1]
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_update_discards_the_token_of_a_request_aborted_during_its_step() -> None:
    scheduler = make_scheduler()
    a, b = make_request(1, 4, 5), make_request(2, 4, 5)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert [s.request for s in out.scheduled] == [a, b]
    fake_model(scheduler).execute(out)
    scheduler.finish(a, "abort")  # the step is "on the device" now
    assert_all_blocks_free_except(scheduler, b)
    events = scheduler.update(out, StepOutput([111, 222]))
    # a's token is dropped; b still gets its own token, not a's.
    assert [(e.request, e.new_token_ids) for e in events] == [(b, [222])]
    assert a.output_token_ids == []
    assert b.output_token_ids == [222]
    assert b.num_computed_tokens == 4
    run_to_completion(scheduler)
    assert len(b.output_token_ids) == 5
    assert_all_blocks_free(scheduler)


def test_update_skips_an_aborted_chunk_that_samples_nothing() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    a, b = make_request(1, 20, 2), make_request(2, 2, 2)
    scheduler.add(b)
    scheduler.add(a)
    out = scheduler.schedule()
    assert [(s.request, s.sample) for s in out.scheduled] == [(b, True), (a, False)]
    fake_model(scheduler).execute(out)
    scheduler.finish(a, "abort")
    events = scheduler.update(out, StepOutput([5]))
    assert [(e.request, e.new_token_ids) for e in events] == [(b, [5])]
    assert a.output_token_ids == [] and a.num_confirmed_tokens == 0
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def assert_all_blocks_free_except(scheduler: Scheduler, request: Request) -> None:
    kv = scheduler.kv_cache
    assert kv.num_free_blocks == kv.pool.num_blocks - len(kv.block_table(request.request_id))


# ----------------------------------------------------------------------------------------------
# Property test: random workloads always finish, with the right tokens, leaking no blocks
# ----------------------------------------------------------------------------------------------


def _sampled_token(request: Request) -> int:
    # Depends on the request and the position, so a token handed to the wrong request shows.
    return request.request_id * 1000 + len(request.output_token_ids)


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, object]:
    num_requests = draw(st.integers(min_value=2, max_value=6))
    # Prompts share a prefix (over a tiny alphabet) so that, with prefix caching, requests hit
    # each other's blocks and their own after a preemption.
    base = draw(st.lists(st.integers(0, 3), min_size=0, max_size=40))
    token_ids = []
    for _ in range(num_requests):
        keep = draw(st.one_of(st.just(len(base)), st.integers(0, len(base))))
        token_ids.append(base[:keep] + draw(st.lists(st.integers(0, 3), min_size=1, max_size=20)))
    prompts = [len(t) for t in token_ids]
    max_tokens = draw(st.lists(st.integers(1, 20), min_size=num_requests, max_size=num_requests))
    arrivals = draw(st.lists(st.integers(0, 6), min_size=num_requests, max_size=num_requests))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    longest = max(p + m for p, m in zip(prompts, max_tokens, strict=True))
    # Always room for the longest request alone (else nothing could finish), often not for two.
    num_blocks = blocks_needed(longest, block_size) + draw(st.integers(0, 4))
    aborts = draw(
        st.lists(
            st.tuples(st.integers(0, 60), st.integers(0, num_requests - 1), st.booleans()),
            max_size=3,
        )
    )
    return {
        "token_ids": token_ids,
        "prefix_caching": draw(st.booleans()),
        "max_tokens": max_tokens,
        "arrivals": arrivals,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_num_seqs": draw(st.integers(1, 4)),
        "budget": draw(st.integers(1, 64)),
        "aborts": aborts,
    }


@settings(max_examples=100, deadline=None)
@given(workloads())
def test_random_workloads_terminate_with_exact_outputs(w: dict[str, object]) -> None:
    token_ids: list[list[int]] = w["token_ids"]  # type: ignore[assignment]
    max_tokens: list[int] = w["max_tokens"]  # type: ignore[assignment]
    arrivals: list[int] = w["arrivals"]  # type: ignore[assignment]
    aborts: list[tuple[int, int, bool]] = w["aborts"]  # type: ignore[assignment]
    scheduler = make_scheduler(
        num_blocks=w["num_blocks"],  # type: ignore[arg-type]
        block_size=w["block_size"],  # type: ignore[arg-type]
        max_num_seqs=w["max_num_seqs"],  # type: ignore[arg-type]
        max_num_batched_tokens=w["budget"],  # type: ignore[arg-type]
        enable_prefix_caching=w["prefix_caching"],  # type: ignore[arg-type]
    )
    requests = [
        make_request(i, len(t), m, token_ids=t) for i, (t, m) in enumerate(zip(token_ids, max_tokens, strict=True))
    ]
    added: set[int] = set()
    aborted: set[int] = set()
    reported: list[int] = []

    def abort(index: int) -> None:
        request = requests[index]
        if index in added and not request.finished:
            scheduler.finish(request, "abort")
            aborted.add(index)
            assert scheduler.kv_cache.block_table(index) == []

    step_index = 0
    while scheduler.has_work() or len(added) < len(requests):
        assert step_index < 20_000, "the scheduler does not terminate"
        for index, request in enumerate(requests):
            if arrivals[index] == step_index:
                scheduler.add(request)
                added.add(index)
        for at, index, during_step in aborts:
            if at == step_index and not during_step:
                abort(index)
        out = scheduler.schedule()
        check_schedule(scheduler, out)
        fake_model(scheduler).execute(out)
        reported += out.finished_request_ids
        for at, index, during_step in aborts:
            if at == step_index and during_step:
                abort(index)  # while the step "runs": its token must be dropped
        before = {r.request_id: (len(r.output_token_ids), r.num_computed_tokens) for r in requests}
        sampled = [_sampled_token(s.request) for s in out.scheduled if s.sample]
        events = scheduler.update(out, StepOutput(sampled))
        for event in events:
            rid = event.request.request_id
            assert rid not in aborted
            assert event.new_token_ids == [rid * 1000 + before[rid][0]]
        for index in aborted:  # aborted requests, even those aborted during the step, do not move
            request = requests[index]
            assert (len(request.output_token_ids), request.num_computed_tokens) == before[index]
        step_index += 1

    assert scheduler.schedule().finished_request_ids == []  # nothing runs: they wait for a step
    reported += scheduler.pending_finished_request_ids
    assert sorted(reported) == list(range(len(requests))), "each finished id is reported exactly once"
    for index, request in enumerate(requests):
        assert request.finished
        expected = [index * 1000 + i for i in range(max_tokens[index])]
        if index in aborted:
            assert request.finish_reason == "abort"
            assert request.output_token_ids == expected[: len(request.output_token_ids)]
            assert len(request.output_token_ids) < max_tokens[index]
        else:
            assert request.finish_reason == "length"
            assert request.output_token_ids == expected
    assert_all_blocks_free(scheduler)
