"""Priority scheduling in the scheduler: queue order, ties, preemption order, preemption to admit.

The fake model and the invariants of ``test_scheduler.py`` are reused; a second fake device here
runs steps one behind the scheduler, as the engine's async scheduling does (placeholders filled
from the previous step's samples), so preemptions of requests with a step in flight are covered.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.core._priority import WaitingHeap, rank
from asyncllm.core._request import Request, RequestStatus
from asyncllm.core._scheduler import Scheduler, SchedulerOutput
from asyncllm.core.kv import KVCacheManager
from asyncllm.core.kv._manager import blocks_needed
from asyncllm.engine._input_processor import InputProcessor
from asyncllm.executor._lookahead import PLACEHOLDER
from asyncllm.executor._runner import StepOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.testing import ByteTokenizer, import_path

base = import_path(Path(__file__).with_name("test_scheduler.py"), "asyncllm_tests_core_scheduler")
TOKEN = base.TOKEN


def make_scheduler(
    policy: str = "priority",
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = False,
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,  # type: ignore[arg-type]
    )


def make_request(request_id: int, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    request: Request = base.make_request(request_id, prompt_len, max_tokens)
    request.priority = priority
    return request


def admission_order(outputs: list[SchedulerOutput]) -> list[int]:
    """Request ids in the order of their first scheduled chunk."""
    order: list[int] = []
    for out in outputs:
        for item in out.scheduled:
            if item.request.request_id not in order:
                order.append(item.request.request_id)
    return order


# -- the waiting queue -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("priority", [3, 1, 4, 0, 2]),  # by priority; 1 before 4 and 0 before 2: ties in arrival order
        ("fcfs", [0, 1, 2, 3, 4]),  # the default ignores nothing: it never sees other priorities
    ],
)
def test_admission_order_is_priority_then_arrival(policy: str, expected: list[int]) -> None:
    scheduler = make_scheduler(policy, max_num_seqs=1)
    priorities = [3, 1, 3, 0, 1] if policy == "priority" else [0] * 5
    for request_id, priority in enumerate(priorities):
        scheduler.add(make_request(request_id, 4, 2, priority))
    assert admission_order(base.run_to_completion(scheduler)) == expected
    assert scheduler.num_preemptions == 0
    base.assert_all_blocks_free(scheduler)


def test_a_later_better_priority_goes_before_earlier_waiting_ones() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    running = make_request(0, 4, 6, priority=0)
    scheduler.add(running)
    base.step(scheduler)
    lows = [make_request(i, 4, 2, priority=5) for i in (1, 2)]
    for request in lows:
        scheduler.add(request)
    base.step(scheduler)
    high = make_request(3, 4, 2, priority=1)  # outranks the waiting ones, not the running one
    scheduler.add(high)
    assert list(scheduler.waiting) == [high, *lows]
    outputs = base.run_to_completion(scheduler)
    assert admission_order(outputs) == [0, 3, 1, 2]
    assert scheduler.num_preemptions == 0  # 0 is not outranked by 1: it ran to its end
    assert running.output_token_ids == [TOKEN] * 6
    base.assert_all_blocks_free(scheduler)


# -- preemption to admit ---------------------------------------------------------------------------


def test_a_better_priority_takes_the_seat_of_the_worst_running_request() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    a, b = make_request(0, 4, 8, priority=5), make_request(1, 4, 8, priority=5)
    scheduler.add(a)
    scheduler.add(b)
    base.step(scheduler)
    base.step(scheduler)
    high = make_request(2, 4, 3, priority=0)
    scheduler.add(high)
    out, _ = base.step(scheduler)
    # b, the latest of the two equals, gave up its seat; a kept running in the same step.
    assert [s.request for s in out.scheduled] == [a, high]
    assert b.status is RequestStatus.WAITING and b.num_preemptions == 1 and b.num_computed_tokens == 0
    assert scheduler.running == [high, a]  # rank order: the best first, the next victim last
    assert list(scheduler.waiting) == [b]
    base.run_to_completion(scheduler)
    assert [r.output_token_ids for r in (a, b, high)] == [[TOKEN] * 8, [TOKEN] * 8, [TOKEN] * 3]
    assert a.num_preemptions == 0
    base.assert_all_blocks_free(scheduler)


def test_a_better_priority_preempts_for_blocks() -> None:
    # 4 blocks of 4: a holds 3 once it has 9+ tokens; high needs 2 for its prompt of 8.
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    a = make_request(0, 4, 8, priority=1)
    scheduler.add(a)
    base.step_until(scheduler, lambda out: len(scheduler.kv_cache.block_table(0)) == 3)
    high = make_request(1, 8, 2, priority=0)
    scheduler.add(high)
    out, _ = base.step(scheduler)
    assert [s.request for s in out.scheduled] == [high]  # a's decode of this step was taken back
    assert a.status is RequestStatus.WAITING and a.num_preemptions == 1
    base.run_to_completion(scheduler)
    assert a.output_token_ids == [TOKEN] * 8 and high.output_token_ids == [TOKEN] * 2
    base.assert_all_blocks_free(scheduler)


@pytest.mark.parametrize("priority", [0, 1])
def test_an_equal_or_worse_priority_never_preempts(priority: int) -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    a = make_request(0, 4, 8, priority=0)
    scheduler.add(a)
    base.step(scheduler)
    later = make_request(1, 4, 2, priority=priority)
    scheduler.add(later)
    outputs = base.run_to_completion(scheduler)
    assert admission_order(outputs) == [0, 1]
    assert scheduler.num_preemptions == 0
    assert a.output_token_ids == [TOKEN] * 8 and later.output_token_ids == [TOKEN] * 2
    base.assert_all_blocks_free(scheduler)


def test_a_request_preempted_to_admit_another_waits_a_step() -> None:
    # v fills the cache (4 blocks of 4); high needs one block, so v is preempted. v's first chunk
    # of 3 tokens (the budget left) would fit in what v freed, but it waits for the next step, as
    # any preempted request does.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=4)
    v = make_request(0, 4, 13, priority=1)
    scheduler.add(v)
    base.step_until(scheduler, lambda out: len(scheduler.kv_cache.block_table(0)) == 4)
    high = make_request(1, 1, 3, priority=0)
    scheduler.add(high)
    out, _ = base.step(scheduler)
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(high, 1)]
    assert v.status is RequestStatus.WAITING and scheduler.kv_cache.num_free_blocks == 3
    out, _ = base.step(scheduler)
    assert [(s.request, s.start, s.num_new_tokens) for s in out.scheduled] == [(high, 1, 1), (v, 0, 3)]
    base.run_to_completion(scheduler)
    assert v.output_token_ids == [TOKEN] * 13 and high.output_token_ids == [TOKEN] * 3
    assert v.num_preemptions == 1
    base.assert_all_blocks_free(scheduler)


# -- preemption under memory pressure --------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "priorities", "victims"),
    [
        # The worst priority first, the latest arrival first among equals; 0 is never touched.
        ("priority", [2, 9, 0, 9, 5], [3, 1, 4, 0]),
        ("fcfs", [0, 0, 0, 0, 0], [4, 3, 2, 1]),  # the latest admitted first
    ],
)
def test_memory_pressure_preempts_in_reverse_rank(policy: str, priorities: list[int], victims: list[int]) -> None:
    # Five requests of 2 prompt tokens in blocks of 2 grow in step; the cache holds 12 blocks, one
    # request's whole life needs 11: the cache runs dry with all five running.
    scheduler = make_scheduler(policy, num_blocks=12, block_size=2)
    requests = [make_request(i, 2, 20, priority) for i, priority in enumerate(priorities)]
    for request in requests:
        scheduler.add(request)
    order: list[int] = []
    preempt = scheduler._preempt

    def record(request: Request) -> None:
        if policy == "priority":  # the victim ranks below every request still running
            assert all(rank(request) > rank(kept) for kept in scheduler.running)
        order.append(request.request_id)
        preempt(request)

    scheduler._preempt = record  # type: ignore[method-assign]
    base.run_to_completion(scheduler)
    assert order[: len(victims)] == victims
    assert all(r.output_token_ids == [TOKEN] * 20 for r in requests)
    base.assert_all_blocks_free(scheduler)


# -- WaitingHeap -----------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "pop", "remove"]), st.integers(-3, 3), st.integers(0, 1000)),
        max_size=300,
    )
)
def test_waiting_heap_agrees_with_a_sorted_list(ops: list[tuple[str, int, int]]) -> None:
    heap = WaitingHeap()
    model: list[Request] = []
    next_id = 0
    for op, priority, pick in ops:
        if op == "add" or not model:
            request = make_request(next_id, 1, 1, priority)
            next_id += 1
            heap.append(request)
            model.append(request)
        elif op == "pop":
            first = min(model, key=rank)
            assert heap.popleft() is first
            model.remove(first)
        else:
            victim = model[pick % len(model)]
            heap.remove(victim)
            model.remove(victim)
            assert victim not in heap
        assert len(heap) == len(model) and bool(heap) == bool(model)
        assert list(heap) == sorted(model, key=rank)
        if model:
            assert heap[0] is min(model, key=rank)
        assert len(heap._heap) <= 2 * len(model) + 64 + 1  # removed entries do not pile up


def test_waiting_heap_refuses_what_a_deque_would_not_hide() -> None:
    heap = WaitingHeap()
    request = make_request(1, 1, 1)
    with pytest.raises(IndexError):
        heap.popleft()
    with pytest.raises(ValueError, match="not waiting"):
        heap.remove(request)
    heap.append(request)
    with pytest.raises(ValueError, match="already waiting"):
        heap.append(request)
    with pytest.raises(IndexError):
        heap[1]


def test_aborting_many_waiting_requests_keeps_the_heap_small() -> None:
    # A low priority that never comes up, aborted over and over under steady better-priority traffic.
    scheduler = make_scheduler(max_num_seqs=1)
    for request_id in range(10_000):
        request = make_request(request_id, 1, 1, priority=9 if request_id % 2 else 0)
        scheduler.add(request)
        if request.priority == 9:
            scheduler.finish(request, "abort")
    assert isinstance(scheduler.waiting, WaitingHeap)
    assert len(scheduler.waiting) == 5_000
    assert len(scheduler.waiting._heap) <= 2 * 5_000 + 64


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy must be"):
        make_scheduler("lifo")


# -- random workloads, scheduled one step ahead ------------------------------------------------------


def _expected_token(request: Request, position: int) -> int:
    # The token the fake device samples for ``position``: a function of the request and position
    # alone, so it is known (and checked) wherever it is fed, before or after a preemption.
    return request.request_id * 1000 + position


class LookaheadDevice:
    """Runs steps in order, one behind the scheduler, as the device thread does.

    A step is captured when scheduled (its block tables and token ids, placeholders included) and
    run later: a placeholder must stand for a token the previous step sampled for that request, as
    ``LookaheadExecutor`` requires; every fed token is checked against what the request really has
    at that position; and each step reads back every earlier position of its requests through its
    tables (a block handed out too early, or a wrong prefix-cache hit, shows).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}
        self.last: dict[int, int] = {}

    def run(self, batch: list[tuple[Request, int, list[int], list[int], bool]]) -> list[int]:
        size = self.block_size
        fed = []
        for request, start, tokens, table, sample in batch:
            tokens = list(tokens)
            if tokens[-1] == PLACEHOLDER:
                assert request.request_id in self.last, "a placeholder the previous step did not sample"
                tokens[-1] = self.last[request.request_id]
            prompt_len = len(request.prompt_token_ids)
            assert tokens[:prompt_len] == request.prompt_token_ids[: len(tokens)]
            assert tokens[prompt_len:] == [_expected_token(request, p) for p in range(prompt_len, len(tokens))]
            keys = []
            for token in tokens:
                keys.append(hash((keys[-1] if keys else None, token)))
            for position in range(start, len(tokens)):
                self.slots[(table[position // size], position % size)] = keys[position]
            fed.append((request, tokens, table, keys, sample))
        sampled = []
        self.last = {}
        for request, tokens, table, keys, sample in fed:
            seen = [self.slots.get((table[p // size], p % size)) for p in range(len(tokens))]
            assert seen == keys, f"request {request.request_id} attends to the wrong KV"
            if sample:
                token = _expected_token(request, len(tokens))
                sampled.append(token)
                self.last[request.request_id] = token
        return sampled


def capture(scheduler: Scheduler, out: SchedulerOutput) -> list[tuple[Request, int, list[int], list[int], bool]]:
    kv = scheduler.kv_cache
    return [
        (
            s.request,
            s.start,
            s.request.token_ids(0, s.start + s.num_new_tokens),
            list(kv.block_table(s.request.request_id)),
            s.sample,
        )
        for s in out.scheduled
        if not s.pool
    ]


@st.composite
def priority_workloads(draw: st.DrawFn) -> dict[str, object]:
    num_requests = draw(st.integers(min_value=2, max_value=6))
    shared = draw(st.lists(st.integers(0, 3), min_size=0, max_size=24))
    prompts = []
    for _ in range(num_requests):
        keep = draw(st.integers(0, len(shared)))
        prompts.append(shared[:keep] + draw(st.lists(st.integers(0, 3), min_size=1, max_size=12)))
    max_tokens = draw(st.lists(st.integers(1, 12), min_size=num_requests, max_size=num_requests))
    block_size = draw(st.sampled_from([1, 2, 4]))
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    return {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "n": draw(st.lists(st.sampled_from([1, 1, 2, 3]), min_size=num_requests, max_size=num_requests)),
        "priorities": draw(st.lists(st.integers(-2, 2), min_size=num_requests, max_size=num_requests)),
        "arrivals": draw(st.lists(st.integers(0, 8), min_size=num_requests, max_size=num_requests)),
        "aborts": draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, num_requests - 1)), max_size=2)),
        "block_size": block_size,
        # Room for the longest request alone, often not for two: preemption happens.
        "num_blocks": blocks_needed(longest, block_size) + draw(st.integers(0, 6)),
        "max_num_seqs": draw(st.integers(1, 4)),
        "budget": draw(st.integers(1, 32)),
        "prefix_caching": draw(st.booleans()),
    }


@settings(max_examples=150, deadline=None)
@given(priority_workloads())
def test_random_priority_workloads_scheduled_ahead_end_exactly(w: dict[str, object]) -> None:
    prompts: list[list[int]] = w["prompts"]  # type: ignore[assignment]
    arrivals: list[int] = w["arrivals"]  # type: ignore[assignment]
    aborts: list[tuple[int, int]] = w["aborts"]  # type: ignore[assignment]
    scheduler = make_scheduler(
        num_blocks=w["num_blocks"],  # type: ignore[arg-type]
        block_size=w["block_size"],  # type: ignore[arg-type]
        max_num_seqs=w["max_num_seqs"],  # type: ignore[arg-type]
        max_num_batched_tokens=w["budget"],  # type: ignore[arg-type]
        enable_prefix_caching=w["prefix_caching"],  # type: ignore[arg-type]
    )
    # Requests as the engine builds them: ids in arrival order, n > 1 as groups of samples.
    inputs = InputProcessor(
        ByteTokenizer(), vocab_size=257, max_model_len=1 << 20, eos_token_ids=frozenset(), scheduling_policy="priority"
    )
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    built: dict[int, Request] = {}
    for index in order:
        params = SamplingParams(max_tokens=w["max_tokens"][index], n=w["n"][index], ignore_eos=True)  # type: ignore[index]
        built[index] = inputs.process(prompts[index], params, priority=w["priorities"][index])  # type: ignore[index]
    requests = [built[i] for i in range(len(prompts))]
    every = [sample for request in requests for sample in (request.group or [request])]
    device = LookaheadDevice(scheduler.kv_cache.block_size)
    in_flight: tuple[SchedulerOutput, list[tuple[Request, int, list[int], list[int], bool]]] | None = None
    step_index = 0
    while scheduler.has_work() or step_index <= max(arrivals) or in_flight is not None:
        assert step_index < 5_000, "the scheduler does not terminate"
        for index, request in enumerate(requests):
            if arrivals[index] == step_index:
                scheduler.add(request)
        for at, index in aborts:
            if at == step_index and arrivals[index] < step_index:
                for sample in requests[index].group or [requests[index]]:
                    scheduler.finish(sample, "abort")
        waiting_before = set(map(id, scheduler.waiting))
        counts = {id(r): r.num_preemptions for r in every}
        out = scheduler.schedule()
        base.check_schedule(scheduler, out)
        admitted = [s.request for s in out.scheduled if id(s.request) in waiting_before]
        victims = [r for r in every if r.num_preemptions > counts[id(r)]]
        # Admitted requests outrank every request left waiting; victims rank below every survivor.
        assert all(rank(a) < rank(w) for a in admitted for w in scheduler.waiting)
        assert all(rank(v) > rank(r) for v in victims for r in scheduler.running)
        batch = capture(scheduler, out)
        # The device runs the previous step now; its result reaches the scheduler after this
        # step was scheduled, as with the engine's async scheduling.
        if in_flight is not None:
            previous, previous_batch = in_flight
            scheduler.update(previous, StepOutput(device.run(previous_batch)))
        in_flight = (out, batch) if out.scheduled else None
        step_index += 1
    for request in every:
        assert request.finished
        prompt_len = len(request.prompt_token_ids)
        expected = [_expected_token(request, prompt_len + k) for k in range(len(request.output_token_ids))]
        assert request.output_token_ids == expected
        if request.finish_reason != "abort":
            assert len(request.output_token_ids) == request.params.max_tokens
    base.assert_all_blocks_free(scheduler)
