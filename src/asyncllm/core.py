"""``EngineCore``: the step loop that keeps the device busy.

One iteration: apply aborts, schedule a step, hand it to the device thread, and, while the device
computes, deliver the previous step's tokens (detokenize, emit). Then fold the step's sampled ids
into the scheduler. The loop never awaits a consumer; when there is no work it sleeps on an event.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque

import anyio
from anyio.abc import TaskStatus

from asyncllm.device import DeviceWorker
from asyncllm.errors import EngineDeadError
from asyncllm.output_processor import OutputProcessor
from asyncllm.request import Request
from asyncllm.runner import ModelRunner, SequenceInput, StepBatch, StepOutput
from asyncllm.scheduler import Scheduler, SchedulerOutput, TokenEvent
from asyncllm.stream import RequestStream

logger = logging.getLogger("asyncllm")


class EngineCore:
    """Owns the scheduler, the output processor and the step loop.

    Args:
        scheduler: Decides each step.
        worker: The device thread.
        runner: Runs steps (called on the device thread only).
        outputs: Routes tokens to streams.
    """

    def __init__(
        self, scheduler: Scheduler, worker: DeviceWorker, runner: ModelRunner, outputs: OutputProcessor
    ) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.runner = runner
        self.outputs = outputs
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
        pending: list[TokenEvent] = []
        while True:
            pending += self._apply_aborts()
            if self._stopping:
                self._finish_stopped(self.outputs.process(pending))
                return
            step = self.scheduler.schedule() if self.scheduler.has_work() else None
            if step is None or not step.scheduled:
                if pending:
                    self._finish_stopped(self.outputs.process(pending))
                    pending = []
                    continue
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            call = self.worker.submit(functools.partial(self.runner.execute, self._batch(step)))
            # The overlap: the previous step's tokens reach their streams while this one computes.
            stopped = self.outputs.process(pending)
            sampled = await call.wait()
            # Requests a stop string ended are finished only now: their blocks are not freed while
            # the step in flight still writes to them, and update() drops their tokens of that step.
            self._finish_stopped(stopped)
            pending = self._update(step, sampled)

    def _batch(self, step: SchedulerOutput) -> StepBatch:
        kv = self.scheduler.kv_cache
        sequences = [
            SequenceInput(
                request_id=s.request.request_id,
                token_ids=s.request.token_ids(s.start, s.start + s.num_new_tokens),
                start_position=s.start,
                block_table=list(kv.block_table(s.request.request_id)),
                sample=s.sample,
                params=s.request.params,
                num_generated=len(s.request.output_token_ids),
                prompt_token_ids=s.request.prompt_token_ids,
                bad_words_token_ids=s.request.bad_words_token_ids,
            )
            for s in step.scheduled
        ]
        return StepBatch(sequences, step.finished_request_ids)

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
