"""The scheduler and LongRoPE's switch (``Scheduler(long_rope_length=...)``): a request longer than the
original context is computed with the long frequencies from its first token; one that grows past it
is recomputed from position 0, once; long and short KV never share blocks. Torch-free."""

from __future__ import annotations

import dataclasses
import sys

# Another test module of the same session may already have imported torch (see test_kv.py).
_TORCH_PRELOADED = "torch" in sys.modules

from asyncllm.core._request import Request  # noqa: E402
from asyncllm.core._scheduler import Scheduler, SchedulerOutput  # noqa: E402
from asyncllm.core.kv import KVCacheManager  # noqa: E402
from asyncllm.executor._runner import StepOutput  # noqa: E402
from asyncllm.sampling_params import SamplingParams  # noqa: E402

assert _TORCH_PRELOADED or "torch" not in sys.modules, "asyncllm.core must not import torch"

LIMIT = 12
"""The original context of these tests."""


def make_request(request_id: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens),
        stop_token_ids=frozenset({10**9}),
        max_total_tokens=len(prompt) + max_tokens,
    )


def make_scheduler(*, prefix_caching: bool = False, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(64, 4, enable_prefix_caching=prefix_caching)
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=budget, long_rope_length=LIMIT)


def finish_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    sampled = [5 for item in out.scheduled if item.sample]
    scheduler.update(out, StepOutput(sampled))


def run(scheduler: Scheduler) -> list[tuple[int, int, int, bool]]:
    """Every step's (request, start, tokens, long) until nothing is left; one step at a time."""
    steps = []
    while scheduler.has_work():
        out = scheduler.schedule()
        steps += [(i.request.request_id, i.start, i.num_new_tokens, i.request.long_rope) for i in out.scheduled]
        finish_step(scheduler, out)
    return steps


def test_a_request_that_grows_past_the_switch_is_recomputed_once() -> None:
    scheduler = make_scheduler()
    request = make_request(1, list(range(10)), 6)
    scheduler.add(request)
    steps = run(scheduler)
    # Prompt of 10 (short), tokens at 10 and 11 (short: 12 tokens fit), then the token at position 12
    # makes the sequence 13 long: everything again from 0, long; then decodes, long.
    assert steps == [(1, 0, 10, False), (1, 10, 1, False), (1, 11, 1, False), (1, 0, 13, True), (1, 13, 1, True),
                     (1, 14, 1, True)]  # fmt: skip
    assert scheduler.num_long_rope_recomputes == 1 and request.epoch == 1
    assert len(request.output_token_ids) == 6
    assert scheduler.kv_cache.num_free_blocks == 64


def test_a_prompt_past_the_switch_is_long_from_the_start() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_request(1, list(range(13)), 3))
    assert run(scheduler) == [(1, 0, 13, True), (1, 13, 1, True), (1, 14, 1, True)]
    assert scheduler.num_long_rope_recomputes == 0


def test_the_recompute_with_a_step_in_flight() -> None:
    # Async scheduling: the step that samples the 13th token is still running when the next is
    # scheduled. Its token still arrives (it was computed short, as transformers computes it); its KV
    # is dropped with the epoch, and the recompute feeds that token as a placeholder at its end.
    scheduler = make_scheduler()
    request = make_request(1, list(range(12)), 4)
    scheduler.add(request)
    first = scheduler.schedule()  # the prompt: samples the 13th token
    second = scheduler.schedule()  # with that token pending: 13 long, recomputed from 0
    assert [(i.start, i.num_new_tokens, i.epoch) for i in second.scheduled] == [(0, 13, 1)]
    assert request.token_ids(0, 13)[-1] < 0  # the placeholder
    finish_step(scheduler, first)
    assert request.output_token_ids == [5] and request.num_confirmed_tokens == 0
    finish_step(scheduler, second)
    assert request.num_confirmed_tokens == 13 and request.output_token_ids == [5, 5]
    run(scheduler)
    assert len(request.output_token_ids) == 4 and scheduler.num_long_rope_recomputes == 1


def test_long_and_short_blocks_never_serve_each_other() -> None:
    scheduler = make_scheduler(prefix_caching=True)
    kv = scheduler.kv_cache
    prompt = list(range(100, 116))  # 16 tokens, past the switch: long
    scheduler.add(make_request(1, prompt, 1))
    run(scheduler)
    short = make_request(2, prompt[:9], 1)  # the same first two blocks, within the switch
    assert kv.find_cached_prefix(short).num_tokens == 0
    scheduler.add(short)
    run(scheduler)
    again = make_request(3, [*prompt, 7], 1)
    again.long_rope = True
    assert kv.find_cached_prefix(again).num_tokens == 16
    assert kv.find_cached_prefix(make_request(4, prompt[:9], 1)).num_tokens == 8  # the short run's blocks


def test_a_sample_does_not_share_its_first_samples_blocks_once_those_are_long() -> None:
    scheduler = make_scheduler(budget=13)
    first = make_request(1, list(range(12)), 4)
    sample = dataclasses.replace(first, request_id=2, sample_index=1, output_token_ids=[], block_hashes=[], forks=[])
    first.group = sample.group = [first, sample]
    first.forks = [sample]
    scheduler.add(first)
    run(scheduler)
    # The first sample's first decode (position 12) recomputed it long, taking the step's whole budget;
    # the sample (12 tokens: short) was admitted a step later, when the first's long blocks were
    # there to share, and computed its prompt itself.
    assert first.long_rope and sample.long_rope and scheduler.num_long_rope_recomputes == 2
    assert sample.num_cached_tokens == 0
    assert len(first.output_token_ids) == len(sample.output_token_ids) == 4
