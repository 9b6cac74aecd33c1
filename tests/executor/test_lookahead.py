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


class _Pending:
    def __init__(self, output: StepOutput, rows: dict[int, int], log: list[str], name: str) -> None:
        self.output, self.sample_rows, self.log, self.name = output, rows, log, name

    def result(self) -> StepOutput:
        self.log.append(f"wait {self.name}")
        return self.output


class _Launcher(_Echo):
    """An overlapping runner: ``launch`` logs, and fills placeholders from ``after`` as a device would."""

    overlaps = True

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.log: list[str] = []
        self.fail_at = fail_at

    def launch(self, batch: StepBatch, after: _Pending | None = None) -> _Pending:
        name = f"step {len(self.fed) + 1}"
        if len(self.fed) + 1 == self.fail_at:
            raise ValueError(f"{name} failed")
        self.log.append(f"launch {name}")
        # What the device gathers: the sampled id of the same request in the step before.
        fed = [
            [*s.token_ids[:-1], after.output.sampled_token_ids[after.sample_rows[s.request_id]]]
            if after is not None and s.token_ids[-1] == PLACEHOLDER
            else list(s.token_ids)
            for s in batch.sequences
        ]
        self.fed.append(fed)
        sampling = [s for s in batch.sequences if s.sample]
        output = StepOutput([100 + tokens[-1] for tokens, s in zip(fed, batch.sequences) if s.sample])
        return _Pending(output, {s.request_id: row for row, s in enumerate(sampling)}, self.log, name)


def test_launch_then_collect_runs_the_next_step_before_waiting_for_the_last() -> None:
    runner = _Launcher()
    lookahead = LookaheadExecutor(runner)  # type: ignore[arg-type]
    assert lookahead.overlaps and not LookaheadExecutor(_Echo()).overlaps  # type: ignore[arg-type]
    lookahead.launch(StepBatch([_seq(1, [5, 6], 0), _seq(2, [7], 0)], []))
    lookahead.launch(StepBatch([_seq(1, [PLACEHOLDER], 2), _seq(2, [PLACEHOLDER], 1)], []))
    assert lookahead.collect().sampled_token_ids == [106, 107]
    assert runner.log == ["launch step 1", "launch step 2", "wait step 1"]
    assert lookahead.collect().sampled_token_ids == [206, 207]
    assert lookahead.num_filled == 2
    # Nothing in flight: the next step's placeholders are filled on the host from the last samples.
    lookahead.launch(StepBatch([_seq(1, [PLACEHOLDER], 3)], []))
    assert runner.fed[-1] == [[206]]
    assert lookahead.collect().sampled_token_ids == [306]


def test_a_failed_launch_is_raised_by_its_collect_and_fails_the_steps_after() -> None:
    lookahead = LookaheadExecutor(_Launcher(fail_at=2))  # type: ignore[arg-type]
    lookahead.launch(StepBatch([_seq(1, [5], 0)], []))
    lookahead.launch(StepBatch([_seq(1, [PLACEHOLDER], 1)], []))
    lookahead.launch(StepBatch([_seq(1, [PLACEHOLDER], 2)], []))
    assert lookahead.collect().sampled_token_ids == [105]
    with pytest.raises(ValueError, match="step 2 failed"):
        lookahead.collect()
    with pytest.raises(RuntimeError, match="launched before this one failed"):
        lookahead.collect()
    with pytest.raises(RuntimeError, match="without a launched step"):
        lookahead.collect()
