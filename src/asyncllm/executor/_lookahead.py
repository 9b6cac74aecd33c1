"""The lookahead protocol: how a step is scheduled before its predecessor's sampled tokens are known.

With async scheduling the event loop builds step N+1 while step N runs on the device. A request's
newest token, which step N is sampling, is then unknown to the loop: ``Request.token_ids`` writes
``PLACEHOLDER`` in its place. Steps run in order on the one device thread, so when N+1 starts there,
N's samples are known: ``LookaheadExecutor`` substitutes them, without a trip through the loop.

With a runner that ``overlaps`` (CUDA), the device thread goes one step further: it launches step
N+1 before it waits for step N's sampled ids. The engine then submits two calls per step, in this
order: ``launch(N+1)``, then ``collect()`` (N's output). The runner gathers N's samples into N+1's
inputs on the device, so N+1's preparation and launches run while N computes, and the host waits for
N only after N+1 is queued behind it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import cast

from asyncllm.executor._runner import ModelRunner, OverlappingRunner, PendingStep, SequenceInput, StepBatch, StepOutput

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
        self._in_flight: deque[PendingStep | BaseException] = deque()

    @property
    def overlaps(self) -> bool:
        """The runner launches steps without waiting for them: use ``launch`` and ``collect``, not ``execute``."""
        return bool(getattr(self.runner, "overlaps", False)) and callable(getattr(self.runner, "launch", None))

    def execute(self, batch: StepBatch) -> StepOutput:
        """Fill placeholders from the previous step's samples, run the step, remember its samples."""
        output = self.runner.execute(self._filled(batch))
        sampling = [seq.request_id for seq in batch.sequences if seq.sample]
        self._last = dict(zip(sampling, output.sampled_token_ids))
        return output

    def launch(self, batch: StepBatch) -> None:
        """Launch a step without waiting for it (a runner that ``overlaps``); ``collect`` gives its output.

        Placeholders stand for the samples of the step launched before; when that step is still in
        flight, the runner gathers them on the device. A failure is kept for this step's ``collect``.
        """
        runner = cast(OverlappingRunner, self.runner)
        try:
            after = self._in_flight[-1] if self._in_flight else None
            if isinstance(after, BaseException):
                raise RuntimeError("the step launched before this one failed") from after
            if after is None:
                batch = self._filled(batch)
            else:
                self.num_filled += sum(seq.token_ids[-1] == PLACEHOLDER for seq in batch.sequences)
            self._in_flight.append(runner.launch(batch, after))
        except BaseException as exc:  # re-raised by this step's collect(), on the awaiting task
            self._in_flight.append(exc)

    def collect(self) -> StepOutput:
        """Wait for the oldest launched step and return its output (its failure re-raised).

        Raises:
            RuntimeError: No step is in flight (an engine bug).
        """
        if not self._in_flight:
            raise RuntimeError("collect() without a launched step")
        entry = self._in_flight.popleft()
        if isinstance(entry, BaseException):
            raise entry
        output = entry.result()
        self._last = {request_id: output.sampled_token_ids[row] for request_id, row in entry.sample_rows.items()}
        return output

    def _filled(self, batch: StepBatch) -> StepBatch:
        if any(seq.token_ids[-1] == PLACEHOLDER for seq in batch.sequences):
            filled = [self._fill(seq) for seq in batch.sequences]
            return StepBatch(filled, batch.finished_request_ids, batch.block_copies)
        return batch

    def _fill(self, seq: SequenceInput) -> SequenceInput:
        if seq.token_ids[-1] != PLACEHOLDER:
            return seq
        token_id = self._last.get(seq.request_id)
        if token_id is None:  # a scheduling bug; computing on a made-up token would be worse
            raise RuntimeError(f"request {seq.request_id} feeds a token the previous step did not sample")
        self.num_filled += 1
        return dataclasses.replace(seq, token_ids=[*seq.token_ids[:-1], token_id])
