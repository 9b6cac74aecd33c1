"""``EngineCore``: the step loop that keeps the device busy.

One iteration: apply aborts; schedule step N+1 and hand it to the device thread while step N may
still be running there (async scheduling: N's sampled tokens are placeholders the device thread
fills in); deliver the tokens of the last finished step (detokenize, stop strings, emit) while the
device computes; then await step N and fold its sampled ids into the scheduler. The loop never
awaits a consumer; when there is no work it sleeps on an event.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus

from asyncllm.device import DeviceCall, DeviceWorker
from asyncllm.errors import EngineDeadError
from asyncllm.output_processor import OutputProcessor
from asyncllm.request import PLACEHOLDER, Request
from asyncllm.runner import ModelRunner, SequenceInput, StepBatch, StepOutput
from asyncllm.scheduler import Scheduler, SchedulerOutput, TokenEvent
from asyncllm.stream import RequestStream

logger = logging.getLogger("asyncllm")


@dataclass(slots=True)
class LoopTimings:
    """Seconds the step loop spent in each of its phases, summed over all steps."""

    schedule: float = 0.0
    prepare: float = 0.0
    """Building the step's batch (token ids, positions, block tables) for the device thread."""
    output: float = 0.0
    """Detokenizing, stop strings, pushing to streams."""


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


class EngineCore:
    """Owns the scheduler, the output processor and the step loop.

    Args:
        scheduler: Decides each step.
        worker: The device thread.
        runner: Runs steps (called on the device thread only).
        outputs: Routes tokens to streams.
        async_scheduling: Schedule step N+1 while step N runs (one token of lookahead).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        worker: DeviceWorker,
        runner: ModelRunner,
        outputs: OutputProcessor,
        *,
        async_scheduling: bool = True,
    ) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.runner = runner
        self.outputs = outputs
        self.async_scheduling = async_scheduling
        self.timings = LoopTimings()
        self._finished_ids: list[int] = []  # ended requests the runner has not been told about
        self._lookahead = LookaheadExecutor(runner)
        self.requests: dict[int, Request] = {}
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_finished = 0
        self.dead: EngineDeadError | None = None
        self._aborts: deque[int] = deque()  # appended from any thread (a stream's __del__ may run anywhere)
        self._stopping = False
        self._wakeup = anyio.Event()
        self._loop_thread = threading.get_ident()

    def add(self, request: Request, stream: RequestStream) -> None:
        """Queue a validated request (with its other samples when n > 1); output goes to ``stream``."""
        for sample in request.group or [request]:
            self.requests[sample.request_id] = sample
            self.outputs.register(sample.request_id, stream, sample.sample_index)
        self.scheduler.add(request)
        self._wake()

    def abort_nowait(self, request_id: int) -> None:
        """Ask the loop to end a request with finish_reason "abort" before its next step. Never blocks."""
        self._aborts.append(request_id)
        if threading.get_ident() == self._loop_thread:
            self._wake()

    def stop_nowait(self) -> None:
        """Abort every request and end the loop after the step in flight."""
        self._stopping = True
        self._aborts.extend(self.requests)
        self._wake()

    def _wake(self) -> None:
        self._wakeup.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The step loop; returns once stopped (or dead, after failing every stream)."""
        task_status.started()
        try:
            await self._loop()
        except Exception as exc:
            self._die(exc)

    async def _loop(self) -> None:
        events: list[TokenEvent] = []  # the last finished step's, not yet delivered
        in_flight: tuple[SchedulerOutput, DeviceCall[StepOutput]] | None = None
        while True:
            events += self._apply_aborts()
            if self._stopping:
                if in_flight is not None:
                    await in_flight[1].wait()
                self._finish_stopped(self.outputs.process(events))
                return
            step = None
            # With async scheduling the next step is scheduled while the previous one still runs
            # (its sampled tokens are placeholders the device thread fills in): the device never
            # waits for the loop. Without it, one step at a time.
            if self.scheduler.has_work() and (in_flight is None or self.async_scheduling):
                started = time.perf_counter()
                step = self.scheduler.schedule()
                self.timings.schedule += time.perf_counter() - started
                if not step.scheduled:
                    # Nothing to run; the ids of requests that ended go with the next real step.
                    self._finished_ids += step.finished_request_ids
                    step = None
            if step is None and in_flight is None:
                if events:
                    self._deliver(events)
                    events = []
                    continue
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            call = None
            if step is not None:
                started = time.perf_counter()
                batch = self._batch(step)
                self.timings.prepare += time.perf_counter() - started
                call = self.worker.submit(functools.partial(self._lookahead.execute, batch))
            # The overlap: the previous step's tokens reach their streams while the device computes.
            self._deliver(events)
            events = []
            if in_flight is not None:
                result = await in_flight[1].wait()
                events = self._update(in_flight[0], result)
            in_flight = None if step is None or call is None else (step, call)

    def _deliver(self, events: list[TokenEvent]) -> None:
        started = time.perf_counter()
        # Requests a stop string ended are finished at once. Their blocks may still be written by
        # a step in flight, but any new owner's steps run after it on the same device thread.
        self._finish_stopped(self.outputs.process(events))
        self.timings.output += time.perf_counter() - started

    def _batch(self, step: SchedulerOutput) -> StepBatch:
        finished, self._finished_ids = self._finished_ids + step.finished_request_ids, []
        kv = self.scheduler.kv_cache
        sequences = [
            SequenceInput(
                request_id=s.request.request_id,
                token_ids=s.request.token_ids(s.start, s.start + s.num_new_tokens),
                start_position=s.start,
                block_table=list(kv.block_table(s.request.request_id)),
                sample=s.sample,
                params=s.request.params,
                num_generated=len(s.request.output_token_ids) + s.request.num_pending_tokens - s.sample,
                prompt_token_ids=s.request.prompt_token_ids,
                bad_words_token_ids=s.request.bad_words_token_ids,
                epoch=s.epoch,
            )
            for s in step.scheduled
        ]
        return StepBatch(sequences, finished)

    def _update(self, step: SchedulerOutput, sampled: StepOutput) -> list[TokenEvent]:
        self.num_steps += 1
        for item in step.scheduled:
            prompt_len = len(item.request.prompt_token_ids)
            self.num_prompt_tokens += max(0, min(item.start + item.num_new_tokens, prompt_len) - item.start)
        events = self.scheduler.update(step, sampled)
        self.num_generated_tokens += len(events)
        for event in events:
            if event.finish_reason is not None:
                self._forget(event.request)
        return events

    def _apply_aborts(self) -> list[TokenEvent]:
        events = []
        while self._aborts:
            aborted = self.requests.get(self._aborts.popleft())
            if aborted is None:
                continue
            # A stream is one request id; with n > 1 aborting it ends every sample.
            for request in aborted.group or [aborted]:
                if not request.finished:
                    self.scheduler.finish(request, "abort")
                    self._forget(request)
                    events.append(TokenEvent(request, [], "abort"))
        return events

    def _finish_stopped(self, requests: list[Request]) -> None:
        """End in the scheduler the requests the output processor stopped (on a stop string)."""
        for request in requests:
            if not request.finished:
                self.scheduler.finish(request, "stop")
                self._forget(request)

    def _forget(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self.num_finished += 1

    def _die(self, cause: BaseException) -> None:
        error = cause if isinstance(cause, EngineDeadError) else EngineDeadError(f"a model step failed: {cause!r}")
        if error is not cause:
            error.__cause__ = cause
        logger.error("asyncllm engine died: %r", cause)
        self.dead = error
        self.outputs.fail_all(error)
        for request in list(self.requests.values()):
            self.scheduler.finish(request, "abort")
        self.requests.clear()
