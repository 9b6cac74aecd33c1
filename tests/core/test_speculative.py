"""Speculative decoding in the core: the n-gram proposer, the speculator's adaptation, and the scheduler's
budgeting, KV allocation and rollback of drafts, checked against a fake paged model.

The fake model knows each request's "true" continuation (``truth``); it verifies a draft as a greedy
model would (accept while the draft matches the truth) and stores, in every KV slot it writes, a key
of the whole prefix it computed there (draft tokens included). A step then reads back every earlier
position of its request: a rejected draft token's KV that the scheduler still counted as computed, or
a block of rejected tokens served from the prefix cache, reads the wrong key and fails the test.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm.core._request import Request
from asyncllm.core._scheduler import Scheduler, SchedulerOutput, TokenEvent
from asyncllm.core._speculative import (
    INITIAL_BACKOFF,
    MAX_BACKOFF,
    MIN_ACCEPTED_PER_DRAFT,
    SpeculativeConfig,
    Speculator,
    propose_ngram,
)
from asyncllm.core.kv import KVCacheManager
from asyncllm.core.kv._hashing import extend_block_hashes
from asyncllm.core.kv._manager import blocks_needed
from asyncllm.executor._lookahead import PLACEHOLDER
from asyncllm.executor._runner import StepOutput, VerifiedDraft
from asyncllm.sampling_params import SamplingParams

NEVER = 10**9  # a stop id the truth never produces


def ngram(ids: list[int], n_min: int = 1, n_max: int = 3, k: int = 4) -> list[int]:
    return propose_ngram(bytearray(array("i", ids).tobytes()), n_min, n_max, k)


# ----------------------------------------------------------------------------------------------
# The proposer
# ----------------------------------------------------------------------------------------------


def test_ngram_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    # "2 3" occurs twice before the end; the latest (followed by 9) wins over the first (followed by 4).
    assert ngram([1, 2, 3, 4, 5, 2, 3, 9, 8, 7, 2, 3], n_min=2, n_max=2, k=2) == [9, 8]
    # The longest suffix found wins: "1 2 3" points at 4, although "2 3" alone occurs later.
    assert ngram([1, 2, 3, 4, 5, 2, 3, 9, 8, 1, 2, 3], n_min=2, n_max=3, k=2) == [4, 5]


def test_ngram_without_an_earlier_occurrence_proposes_nothing() -> None:
    assert ngram([1, 2, 3, 4]) == []
    assert ngram([7]) == []
    assert ngram([]) == []
    assert ngram([1, 2, 3, 1, 2], n_min=3, n_max=3) == []  # only "1 2" recurs, shorter than n_min


def test_ngram_continuation_that_reaches_the_end_repeats_the_period() -> None:
    # The sequence repeats "5 6 7"; the continuation runs into the end and goes on with the draft.
    assert ngram([5, 6, 7, 5, 6, 7, 5], n_min=1, n_max=2, k=7) == [6, 7, 5, 6, 7, 5, 6]
    assert ngram([4, 4, 4], n_min=1, n_max=1, k=3) == [4, 4, 4]


def test_ngram_ignores_matches_across_token_boundaries() -> None:
    # Ids are stored as little-endian int32s: 0x04030201 is the bytes 01 02 03 04, which also occur
    # straddling 0x02010000 (00 00 01 02) and 0x00000403 (03 04 00 00). That is no occurrence.
    x, a, b = 0x04030201, 0x02010000, 0x00000403
    assert ngram([a, b, 5, x], n_min=1, n_max=1, k=1) == []
    # Past the straddling bytes, the search goes on to the real (earlier) occurrence.
    assert ngram([x, 7, a, b, 5, x], n_min=1, n_max=1, k=1) == [7]


# ----------------------------------------------------------------------------------------------
# The speculator
# ----------------------------------------------------------------------------------------------


def make_request(
    request_id: int,
    prompt: list[int],
    max_tokens: int,
    *,
    stop: frozenset[int] = frozenset({NEVER}),
    max_total_tokens: int | None = None,
    num_speculative_tokens: int | None = None,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens, num_speculative_tokens=num_speculative_tokens),
        stop_token_ids=stop,
        max_total_tokens=max_total_tokens if max_total_tokens is not None else len(prompt) + max_tokens + 100,
    )


def decoding(request: Request, outputs: list[int]) -> Request:
    """The request as the scheduler holds it in decode: every token but the newest computed."""
    request.output_token_ids = list(outputs)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def test_speculator_caps_drafts_by_max_tokens_and_max_model_len() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=2))
    prompt = [1, 2, 3] * 4
    assert speculator.draft(decoding(make_request(0, prompt, 100), [1])) == [2, 3, 1, 2]
    # Two tokens left: one draft token, and the one sampled after it.
    assert speculator.draft(decoding(make_request(1, prompt, 3), [1])) == [2]
    assert speculator.draft(decoding(make_request(2, prompt, 2), [1])) == []
    capped = make_request(3, prompt, 100, max_total_tokens=len(prompt) + 3)
    assert speculator.draft(decoding(capped, [1])) == [2]
    assert speculator.draft(decoding(make_request(4, prompt, 100, num_speculative_tokens=2), [1])) == [2, 3]
    assert speculator.draft(decoding(make_request(5, prompt, 100, num_speculative_tokens=0), [1])) == []


def test_speculator_drafts_only_in_decode_and_waits_for_a_pending_token_it_could_draft_from() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=2, ngram_min=1, ngram_max=1))
    prefilling = make_request(0, [1, 2, 1, 2], 10)
    assert speculator.draft(prefilling) == []  # nothing computed yet
    pending = decoding(make_request(1, [1, 2, 1, 2], 10), [1])
    pending.num_computed_tokens += 1
    pending.num_pending_tokens = 1
    assert speculator.draft(pending) is None  # "... 1" recurs: wait for the token, then draft
    lonely = decoding(make_request(2, [1, 2, 3, 4], 10), [5])
    lonely.num_computed_tokens += 1
    lonely.num_pending_tokens = 1
    assert speculator.draft(lonely) == []  # nothing to draft from: decode on, overlapped


def test_speculator_backs_off_a_request_whose_drafts_fail_and_recovers() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=1))
    request = decoding(make_request(0, [1, 1, 1, 1], 10_000), [1])
    assert speculator.draft(request) == [1, 1, 1, 1]
    failures = 0
    while request.drafting is None or request.drafting.resume_at == 0:
        speculator.record(request, 4, 0)
        failures += 1
        assert failures < 10
    assert failures == 3  # one bad draft does not stop a request that started well: 4 -> 2 -> 1 -> 0.5
    state = request.drafting
    assert state.resume_at == len(request.output_token_ids) + INITIAL_BACKOFF
    assert speculator.draft(request) == []  # paused
    request.output_token_ids += [1] * INITIAL_BACKOFF
    request.num_computed_tokens = request.num_tokens - 1
    assert speculator.draft(request) == [1, 1, 1, 1]  # tries again
    speculator.record(request, 4, 0)  # and fails at once: a longer pause
    assert state.resume_at == len(request.output_token_ids) + 2 * INITIAL_BACKOFF
    for _ in range(12):
        state.resume_at = 0
        speculator.record(request, 4, 0)
    assert state.backoff == MAX_BACKOFF
    state.resume_at = 0
    speculator.record(request, 4, 4)  # a success resets the pause
    assert state.backoff == INITIAL_BACKOFF and state.gain >= MIN_ACCEPTED_PER_DRAFT
    counters = speculator.counters
    assert counters.num_drafts == failures + 14
    assert counters.draft_tokens_per_position == (counters.num_drafts,) * 4
    assert counters.accepted_tokens_per_position == (1, 1, 1, 1)


# ----------------------------------------------------------------------------------------------
# The scheduler with a fake paged model
# ----------------------------------------------------------------------------------------------


def truth(request: Request, index: int) -> int:
    """The request's "model" output at output index ``index``: its prompt's period, broken now and then."""
    period = request.prompt_token_ids[: 3 + request.request_id % 3]
    if index % 7 == 6:
        return 50 + request.request_id
    return period[index % len(period)]


@dataclass
class FakeModel:
    scheduler: Scheduler
    slots: dict[tuple[int, int], int] = field(default_factory=dict)
    num_drafted_steps: int = 0
    num_rejected: int = 0

    def snapshot(self, out: SchedulerOutput) -> list[tuple[list[int], list[int]]]:
        """What the engine copies into the step at schedule time: fed tokens and block tables."""
        kv = self.scheduler.kv_cache
        return [
            (
                item.request.token_ids(item.start, item.start + item.num_new_tokens - len(item.draft)) + item.draft,
                list(kv.block_table(item.request.request_id)),
            )
            for item in out.scheduled
        ]

    def execute(self, out: SchedulerOutput, batch: list[tuple[list[int], list[int]]]) -> StepOutput:
        size = self.scheduler.kv_cache.block_size
        sampled: list[int] = []
        verified: dict[int, VerifiedDraft] = {}
        for item, (fed, table) in zip(out.scheduled, batch):
            request = item.request
            if item.draft:  # a draft follows known tokens only
                assert PLACEHOLDER not in fed
            if item.epoch != request.epoch or request.finished:
                fed = [0 if t == PLACEHOLDER else t for t in fed]  # its result is dropped anyway
            else:  # the previous step's samples are known on the "device" now
                fed = [request.token_ids(item.start + i, item.start + i + 1)[0] if t == PLACEHOLDER else t
                       for i, t in enumerate(fed)]  # fmt: skip
            prefix = request.token_ids(0, item.start) if item.epoch == request.epoch else None
            if prefix is not None and not request.finished:
                for pos in range(item.start):  # attend to the context: it must be this request's real tokens
                    key = self.slots.get((table[pos // size], pos % size))
                    assert key == hash(tuple(prefix[: pos + 1])), f"request {request.request_id} reads wrong KV"
            full = (prefix or request.token_ids(0, item.start)) + fed
            for offset in range(len(fed)):
                pos = item.start + offset
                self.slots[(table[pos // size], pos % size)] = hash(tuple(full[: pos + 1]))
            if not item.sample:
                continue
            first = item.start + len(fed) - len(item.draft) - len(request.prompt_token_ids)  # output index
            if not item.draft:
                sampled.append(truth(request, first))
                continue
            self.num_drafted_steps += 1
            tokens = []
            for j in range(len(item.draft) + 1):
                tokens.append(truth(request, first + j))
                if j == len(item.draft) or tokens[-1] != item.draft[j]:
                    break
            self.num_rejected += len(item.draft) - (len(tokens) - 1)
            verified[request.request_id] = VerifiedDraft(tokens)
            sampled.append(tokens[-1])
        return StepOutput(sampled, verified=verified or None)


def check_schedule(scheduler: Scheduler, out: SchedulerOutput) -> None:
    kv = scheduler.kv_cache
    assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
    for item in out.scheduled:
        request = item.request
        assert len(kv.block_table(request.request_id)) * kv.block_size >= item.start + item.num_new_tokens
        if item.draft:
            # A draft follows the newest token, all of whose predecessors are computed; all of it could
            # be accepted without passing max_tokens or max_model_len.
            assert item.num_new_tokens == 1 + len(item.draft)
            assert item.start == request.num_tokens - 1
            generated = len(request.output_token_ids)
            assert generated + len(item.draft) + 1 <= request.params.max_tokens
            assert request.num_tokens + len(item.draft) + 1 <= request.max_total_tokens
    holders: dict[int, int] = {}
    for request in scheduler.running:
        for block in kv.block_table(request.request_id):
            holders[block] = holders.get(block, 0) + 1
    for block in range(kv.pool.num_blocks):
        assert kv.pool.ref_count(block) == holders.get(block, 0)


def run(
    scheduler: Scheduler,
    requests: list[Request],
    *,
    async_scheduling: bool = True,
    max_steps: int = 5_000,
    model: FakeModel | None = None,
) -> tuple[FakeModel, dict[int, list[TokenEvent]]]:
    """Drive the scheduler like the engine's loop: with async scheduling, step N+1 is scheduled before
    step N's update (the fake "device" runs N+1 once N's samples are known)."""
    model = model or FakeModel(scheduler)
    for request in requests:
        scheduler.add(request)
    events: dict[int, list[TokenEvent]] = {r.request_id: [] for r in requests}
    in_flight: tuple[SchedulerOutput, StepOutput] | None = None
    for _ in range(max_steps):
        if not scheduler.has_work() and in_flight is None:
            break
        out = None
        if scheduler.has_work() and (in_flight is None or async_scheduling):
            out = scheduler.schedule()
            check_schedule(scheduler, out)
            batch = model.snapshot(out)
        if in_flight is not None:
            for event in scheduler.update(*in_flight):
                events[event.request.request_id].append(event)
            in_flight = None
            for request in scheduler.running:  # rolled back: a table covers what is computed, no more
                if not request.num_pending_tokens:
                    table = scheduler.kv_cache.block_table(request.request_id)
                    assert len(table) == blocks_needed(request.num_computed_tokens, scheduler.kv_cache.block_size)
        if out is not None and out.scheduled:
            in_flight = (out, model.execute(out, batch))
    else:
        raise AssertionError("the scheduler does not terminate")
    return model, events


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 8,
    prefix_caching: bool = True,
    config: SpeculativeConfig | None = None,
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        speculator=Speculator(config or SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=3)),
    )


def check_cached_blocks_hold_real_tokens(scheduler: Scheduler, model: FakeModel, requests: list[Request]) -> None:
    """Every block listed in the prefix cache holds the KV of the tokens its hash names."""
    kv = scheduler.kv_cache
    size = kv.block_size
    tokens_of: dict[bytes, list[int]] = {}
    for request in requests:
        tokens = request.token_ids(0, request.num_tokens)
        hashes: list[bytes] = []
        extend_block_hashes(hashes, tokens, size, None)
        for index, block_hash in enumerate(hashes):
            tokens_of[block_hash] = tokens[: (index + 1) * size]
    for block_hash, block in kv.pool._cached.items():
        prefix = tokens_of[block_hash]  # a hash of tokens no request has: a rejected draft's block
        for offset in range(size):
            pos = len(prefix) - size + offset
            assert model.slots[(block, offset)] == hash(tuple(prefix[: pos + 1]))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_drafts_give_the_exact_outputs_in_fewer_steps_and_free_every_block(async_scheduling: bool) -> None:
    scheduler = make_scheduler()
    requests = [make_request(i, [1, 2, 3, 4, 5][: 3 + i % 3] * 3, 40) for i in range(3)]
    model, events = run(scheduler, requests, async_scheduling=async_scheduling)
    for request in requests:
        assert request.output_token_ids == [truth(request, i) for i in range(40)]
        assert request.finish_reason == "length"
        assert [t for e in events[request.request_id] for t in e.new_token_ids] == request.output_token_ids
    counters = scheduler.speculator.counters  # type: ignore[union-attr]
    assert sum(counters.accepted_tokens_per_position) > 40  # drafts did pay
    assert model.num_rejected > 0  # and some were rolled back (the truth breaks its period)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.pool.num_blocks
    check_cached_blocks_hold_real_tokens(scheduler, model, requests)


def test_drafts_count_against_the_token_budget() -> None:
    scheduler = make_scheduler(budget=3)
    request = make_request(0, [1, 2, 3] * 4, 30)
    run(scheduler, [request])
    assert request.output_token_ids == [truth(request, i) for i in range(30)]


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there() -> None:
    scheduler = make_scheduler()
    prompt = [1, 2, 3] * 4
    request = make_request(0, prompt, 40, stop=frozenset({50}))  # truth(·, 6) == 50 for request 0
    _, events = run(scheduler, [request])
    assert request.output_token_ids == [1, 2, 3, 1, 2, 3, 50]
    assert request.finish_reason == "stop"
    assert events[0][-1].finish_reason == "stop" and events[0][-1].new_token_ids[-1] == 50


def test_max_tokens_is_never_exceeded_and_max_model_len_holds() -> None:
    for max_tokens in range(1, 12):
        scheduler = make_scheduler()
        request = make_request(0, [1, 2, 3] * 4, max_tokens)
        run(scheduler, [request])
        assert len(request.output_token_ids) == max_tokens
    scheduler = make_scheduler()
    capped = make_request(1, [1, 2, 3] * 4, 100, max_total_tokens=12 + 9)
    run(scheduler, [capped])
    assert capped.num_tokens == 21 and capped.finish_reason == "length"


def test_a_draft_that_does_not_fit_the_cache_is_dropped_rather_than_preempting() -> None:
    scheduler = make_scheduler(num_blocks=3, block_size=4, prefix_caching=False)
    a = make_request(0, [1, 2, 3, 1, 2, 3, 1], 20)  # 2 blocks; its next token still fits the second
    b = make_request(1, [9, 9, 9], 20, num_speculative_tokens=0)  # the third block; its next token fits too
    model = FakeModel(scheduler)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    scheduler.update(out, model.execute(out, model.snapshot(out)))
    out = scheduler.schedule()  # a would draft "2 3 1 2", which needs a fourth block: none is free
    assert [(item.request, item.draft) for item in out.scheduled] == [(a, []), (b, [])]
    assert scheduler.num_preemptions == 0 and b in scheduler.running


def test_rejected_blocks_are_trimmed_and_never_cached() -> None:
    scheduler = make_scheduler(block_size=2, config=SpeculativeConfig(num_tokens=8, ngram_min=1, ngram_max=3))
    request = make_request(0, [1, 2, 3] * 4, 30)
    model, _ = run(scheduler, [request], async_scheduling=False)
    assert model.num_rejected >= 8
    check_cached_blocks_hold_real_tokens(scheduler, model, [request])
    # A second request with the same prompt and more output reads the first one's cached blocks.
    again = make_request(1, request.token_ids(0, request.num_tokens), 5)
    run(scheduler, [again], model=model)
    assert again.num_cached_tokens and again.num_cached_tokens > 12
    assert again.output_token_ids == [truth(again, i) for i in range(5)]


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, object]:
    num_requests = draw(st.integers(1, 4))
    prompts = [draw(st.lists(st.integers(1, 4), min_size=3, max_size=24)) for _ in range(num_requests)]
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_tokens = [draw(st.integers(1, 30)) for _ in range(num_requests)]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    return {
        "prompts": prompts,
        "max_tokens": max_tokens,
        "block_size": block_size,
        "num_blocks": -(-longest // block_size) + draw(st.integers(0, 6)),
        "budget": draw(st.integers(1, 40)),
        "max_num_seqs": draw(st.integers(1, 4)),
        "prefix_caching": draw(st.booleans()),
        "async_scheduling": draw(st.booleans()),
        "k": draw(st.integers(1, 5)),
        "stop": draw(st.sets(st.integers(1, 60), max_size=2)),
    }


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_workloads_with_drafts_give_exact_outputs(w: dict[str, object]) -> None:
    """Any cache size, budget, block size, draft length and mix: the outputs are the truth up to the first
    stop token or max_tokens, no rejected token's KV is ever read, and every block comes back."""
    prompts: list[list[int]] = w["prompts"]  # type: ignore[assignment]
    max_tokens: list[int] = w["max_tokens"]  # type: ignore[assignment]
    stop: set[int] = w["stop"]  # type: ignore[assignment]
    scheduler = make_scheduler(
        num_blocks=w["num_blocks"],  # type: ignore[arg-type]
        block_size=w["block_size"],  # type: ignore[arg-type]
        budget=w["budget"],  # type: ignore[arg-type]
        max_num_seqs=w["max_num_seqs"],  # type: ignore[arg-type]
        prefix_caching=w["prefix_caching"],  # type: ignore[arg-type]
        config=SpeculativeConfig(num_tokens=w["k"], ngram_min=1, ngram_max=3),  # type: ignore[arg-type]
    )
    requests = [
        make_request(i, p, m, stop=frozenset(stop) | {NEVER}) for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    model, events = run(scheduler, requests, async_scheduling=w["async_scheduling"])  # type: ignore[arg-type]
    for request, limit in zip(requests, max_tokens):
        expected = []
        for index in range(limit):
            expected.append(truth(request, index))
            if expected[-1] in stop:
                break
        assert request.output_token_ids == expected
        assert [t for e in events[request.request_id] for t in e.new_token_ids] == expected
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.pool.num_blocks
    check_cached_blocks_hold_real_tokens(scheduler, model, requests)


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size() -> None:
    speculator = Speculator(SpeculativeConfig(num_tokens=2, ngram_min=1, ngram_max=1, disable_by_batch_size=2))
    request = decoding(make_request(0, [1, 2, 1, 2], 10), [1])
    assert speculator.draft(request, num_running=2) == [2, 1]
    assert speculator.draft(request, num_running=3) == []
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size must be a positive int"):
        SpeculativeConfig(disable_by_batch_size=0)
    # In the scheduler: three requests that could all draft, above the limit of two: none does.
    config = SpeculativeConfig(num_tokens=4, ngram_min=1, ngram_max=3, disable_by_batch_size=2)
    scheduler = make_scheduler(config=config)
    requests = [make_request(i, [1, 2, 3] * 4, 20) for i in range(3)]
    run(scheduler, requests)
    assert scheduler.speculator is not None and scheduler.speculator.counters.num_drafts == 0
    assert all(r.output_token_ids == [truth(r, i) for i in range(20)] for r in requests)
