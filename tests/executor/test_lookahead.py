"""The lookahead protocol on its own: placeholders filled from the previous step's samples."""

from __future__ import annotations

import pytest

from asyncllm import SamplingParams
from asyncllm.executor._lookahead import PLACEHOLDER, LookaheadExecutor
from asyncllm.executor._runner import SequenceInput, StepBatch, StepOutput


class _Echo:
    """A runner that samples 100 + the last token it was fed, and records what it was fed."""

    def __init__(self) -> None:
        self.fed: list[list[list[int]]] = []

    def execute(self, batch: StepBatch) -> StepOutput:
        self.fed.append([list(seq.token_ids) for seq in batch.sequences])
        return StepOutput([100 + seq.token_ids[-1] for seq in batch.sequences if seq.sample])


def _seq(request_id: int, token_ids: list[int], start: int, *, sample: bool = True) -> SequenceInput:
    return SequenceInput(
        request_id=request_id,
        token_ids=token_ids,
        start_position=start,
        block_table=[0],
        sample=sample,
        params=SamplingParams(),
        num_generated=0,
        prompt_token_ids=[1],
        bad_words_token_ids=(),
        epoch=0,
    )


def test_a_placeholder_is_the_token_the_previous_step_sampled() -> None:
    runner = _Echo()
    lookahead = LookaheadExecutor(runner)  # type: ignore[arg-type]
    first = lookahead.execute(StepBatch([_seq(1, [5, 6], 0), _seq(2, [7], 0)], []))
    assert first.sampled_token_ids == [106, 107]
    second = lookahead.execute(StepBatch([_seq(1, [PLACEHOLDER], 2), _seq(2, [PLACEHOLDER], 1)], []))
    assert runner.fed[1] == [[106], [107]]  # filled on the way in: the runner never sees a placeholder
    assert second.sampled_token_ids == [206, 207]
    assert lookahead.num_filled == 2


def test_a_chunk_that_samples_nothing_leaves_no_token_to_fill() -> None:
    lookahead = LookaheadExecutor(_Echo())  # type: ignore[arg-type]
    lookahead.execute(StepBatch([_seq(1, [5, 6], 0, sample=False), _seq(2, [7], 0)], []))
    with pytest.raises(RuntimeError, match="request 1 feeds a token the previous step did not sample"):
        lookahead.execute(StepBatch([_seq(1, [PLACEHOLDER], 2)], []))


def test_only_the_last_position_can_be_a_placeholder_and_known_tokens_pass_unchanged() -> None:
    runner = _Echo()
    lookahead = LookaheadExecutor(runner)  # type: ignore[arg-type]
    batch = StepBatch([_seq(3, [9, 10, 11], 0)], [])
    lookahead.execute(batch)
    assert runner.fed[0] == [[9, 10, 11]] and lookahead.num_filled == 0
