"""The lookahead protocol: how a step is scheduled before its predecessor's sampled tokens are known.

With async scheduling the event loop builds step N+1 while step N runs on the device. A request's
newest token, which step N is sampling, is then unknown to the loop: ``Request.token_ids`` writes
``PLACEHOLDER`` in its place. Steps run in order on the one device thread, so when N+1 starts there,
N's samples are known: ``LookaheadExecutor`` substitutes them, without a trip through the loop.
"""

from __future__ import annotations

import dataclasses

from asyncllm.executor._runner import ModelRunner, SequenceInput, StepBatch, StepOutput

PLACEHOLDER = -1
"""Stands for a token sampled by the step in flight, in a step scheduled before its result arrived."""


class LookaheadExecutor:
    """Runs steps on the device thread, filling in tokens the previous step sampled.

    With async scheduling, step N+1 is built before step N's sampled ids reach the event loop; a
    request's newest token then reads ``PLACEHOLDER``. Steps run in order on one thread, so when
    N+1 starts, N's samples are known here: they are substituted without a trip through the loop.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._last: dict[int, int] = {}
        self.num_filled = 0
        """Placeholders filled in so far: how often a step was scheduled ahead of its predecessor."""

    def execute(self, batch: StepBatch) -> StepOutput:
        """Fill placeholders from the previous step's samples, run the step, remember its samples."""
        if any(seq.token_ids[-1] == PLACEHOLDER for seq in batch.sequences):
            batch = StepBatch([self._fill(seq) for seq in batch.sequences], batch.finished_request_ids)
        output = self.runner.execute(batch)
        sampling = [seq.request_id for seq in batch.sequences if seq.sample]
        self._last = dict(zip(sampling, output.sampled_token_ids))
        return output

    def _fill(self, seq: SequenceInput) -> SequenceInput:
        if seq.token_ids[-1] != PLACEHOLDER:
            return seq
        token_id = self._last.get(seq.request_id)
        if token_id is None:  # a scheduling bug; computing on a made-up token would be worse
            raise RuntimeError(f"request {seq.request_id} feeds a token the previous step did not sample")
        self.num_filled += 1
        return dataclasses.replace(seq, token_ids=[*seq.token_ids[:-1], token_id])
