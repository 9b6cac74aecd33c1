"""Priority scheduling, cases a review found: each test failed on the code it was written against.

The scheduler and its helpers are those of ``test_priority.py`` (no model: a step's output is
made by hand, and handed to ``update()`` after the next step was scheduled, as the engine's async
scheduling does).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asyncllm.core._request import Request, RequestStatus
from asyncllm.executor._runner import PositionLogprobs, StepOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.testing import import_path

priority = import_path(Path(__file__).with_name("test_priority.py"), "asyncllm_tests_core_priority")
base = priority.base


def prompt_only(request_id: int, kind: str, priority_value: int) -> Request:
    """A request that computes its 8-token prompt and samples nothing: ``max_tokens=0`` with prompt
    logprobs (lm-eval's loglikelihood), or an embedding."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, 9)),
        params=SamplingParams(max_tokens=0, prompt_logprobs=1) if kind == "logprobs" else SamplingParams(max_tokens=1),
        stop_token_ids=frozenset(),
        max_total_tokens=1000,
        priority=priority_value,
        pooling="last" if kind == "embedding" else None,
    )


@pytest.mark.parametrize("kind", ["logprobs", "embedding"])
def test_a_prompt_only_chunk_in_flight_ends_its_request_though_it_was_preempted(kind: str) -> None:
    # The step computed the whole prompt before anything could reuse its blocks (steps run in order),
    # so its result stands, as a sampled token of a step in flight does. Recomputing the request
    # instead lost its prompt logprobs: the runner sends a request's prompt logprobs once, and the
    # recompute came back without them.
    scheduler = priority.make_scheduler(max_num_seqs=1)
    low = prompt_only(0, kind, priority_value=5)
    scheduler.add(low)
    in_flight = scheduler.schedule()
    assert [(s.request, s.pool) for s in in_flight.scheduled] == [(low, True)]
    high = priority.make_request(1, 4, 2, priority=0)
    scheduler.add(high)
    out = scheduler.schedule()  # `high` takes the only seat while `low`'s step still runs
    assert [s.request for s in out.scheduled] == [high] and low.num_preemptions == 1
    entries: list[PositionLogprobs | None] = [None] + [
        PositionLogprobs(token, -1.0, 1, (token,), (-1.0,)) for token in low.prompt_token_ids[1:]
    ]
    vector = np.ones(4, dtype=np.float32)
    result = StepOutput([], prompt_logprobs={0: entries}) if kind == "logprobs" else StepOutput([], pooled={0: vector})
    events = scheduler.update(in_flight, result)
    assert [event.request for event in events] == [low]
    assert low.status is RequestStatus.FINISHED and low not in scheduler.waiting
    if kind == "logprobs":
        assert (events[0].finish_reason, events[0].prompt_logprobs) == ("length", entries)
    else:
        assert events[0].finish_reason == "stop" and events[0].embedding is vector
    base.fake_model(scheduler).execute(out)
    scheduler.update(out, StepOutput([base.TOKEN]))
    base.run_to_completion(scheduler)
    assert high.output_token_ids == [base.TOKEN] * 2
    assert scheduler.num_preemptions == 1
    base.assert_all_blocks_free(scheduler)
