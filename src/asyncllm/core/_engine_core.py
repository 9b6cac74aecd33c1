"""``EngineCore``: the step loop that keeps the device busy.

One iteration: apply aborts; schedule step N+1 and hand it to the device thread while step N may
still be running there (async scheduling: N's sampled tokens are placeholders the device thread
fills in); deliver the tokens of the last finished step (detokenize, stop strings, emit) while the
device computes; then await step N and fold its sampled ids into the scheduler. The loop never
awaits a consumer; when there is no work it sleeps on an event.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import anyio
from anyio.abc import TaskGroup, TaskStatus

from asyncllm.core._request import Request
from asyncllm.core._scheduler import Scheduler, SchedulerOutput, TokenEvent
from asyncllm.engine._output_processor import Delivery, OutputProcessor
from asyncllm.engine._stream import RequestStream
from asyncllm.errors import (
    DeviceStepTimeoutError,
    EngineDeadError,
    RequestFailedError,
    SchedulerStalledError,
    StructuredOutputError,
)
from asyncllm.executor._device import DeviceCall, DeviceWorker
from asyncllm.executor._lookahead import LookaheadExecutor
from asyncllm.executor._runner import ModelRunner, RunnerTimings, SequenceInput, StepBatch, StepOutput
from asyncllm.outputs import EngineStatistics
from asyncllm.sampling_params import StructuredOutput
from asyncllm.structured import GrammarCompiler

logger = logging.getLogger("asyncllm")


def _copied(table: list[int] | None) -> list[int] | None:
    """A snapshot of a block table (the manager keeps changing its own while the step is in flight)."""
    return None if table is None else list(table)


@dataclass(slots=True)
class LoopTimings:
    """Seconds the step loop spent in each of its phases, summed over all steps."""

    schedule: float = 0.0
    prepare: float = 0.0
    """Building the step's batch (token ids, positions, block tables) for the device thread."""
    output: float = 0.0
    """Detokenizing, stop strings, pushing to streams."""


class EngineCore:
    """Owns the scheduler, the output processor and the step loop.

    Args:
        scheduler: Decides each step.
        worker: The device thread.
        runner: Runs steps (called on the device thread only).
        outputs: Routes tokens to streams.
        async_scheduling: Schedule step N+1 while step N runs (one token of lookahead).
        step_timeout: Seconds a step may take from submission before the engine counts the device
            as hung and dies (``DeviceStepTimeoutError``); None waits forever.
        grammars: Compiles the grammars of requests added before theirs was compiled.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        worker: DeviceWorker,
        runner: ModelRunner,
        outputs: OutputProcessor,
        *,
        async_scheduling: bool = True,
        step_timeout: float | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.runner = runner
        self.outputs = outputs
        self.async_scheduling = async_scheduling
        self.step_timeout = step_timeout
        self.grammars = grammars
        self.timings = LoopTimings()
        self._lookahead = LookaheadExecutor(runner)
        self.requests: dict[int, Request] = {}
        """Every unfinished request (each sample of a group is one) by id."""
        self._groups: dict[int, list[Request]] = {}  # n > 1: stream id -> samples, until all have ended
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.num_finished = 0
        self.num_embedding_requests = 0
        self.num_embedding_tokens = 0
        self.dead: EngineDeadError | None = None
        self._killed: EngineDeadError | None = None
        self._aborts: deque[int] = deque()  # appended from any thread (a stream's __del__ may run anywhere)
        self._stopping = False
        self._wakeup = anyio.Event()
        self._loop_thread = threading.get_ident()
        self._task_group: TaskGroup | None = None
        self._compiling: set[int] = set()  # requests (every sample) waiting for their grammar, not scheduled
        self._num_compiling = 0  # streams whose grammar compiles (aborted ones too, until the compile ends)

    @property
    def num_waiting(self) -> int:
        """Requests queued and not running (held samples of a group not counted), those whose grammar
        compiles included: they are queued as much as the others (``max_waiting_requests`` bounds them)."""
        return len(self.scheduler.waiting) + self._num_compiling

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (running requests keep their blocks); return how many were listed."""
        return self.scheduler.kv_cache.reset_prefix_cache()

    def statistics(self) -> EngineStatistics:
        """A snapshot of the scheduler's, the KV cache's, the loop's and the device's counters."""
        scheduler = self.scheduler
        kv = scheduler.kv_cache
        sliding = kv.sliding
        runner_timings = getattr(self.runner, "timings", None) or RunnerTimings()
        speculative = None if scheduler.speculator is None else scheduler.speculator.counters
        drafted = () if speculative is None else speculative.draft_tokens_per_position
        accepted = () if speculative is None else speculative.accepted_tokens_per_position
        return EngineStatistics(
            num_running=len(scheduler.running),
            num_waiting=self.num_waiting,
            kv_blocks_total=kv.pool.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_usage=1.0 - kv.num_free_blocks / kv.pool.num_blocks,
            kv_sliding_blocks_total=0 if sliding is None else sliding.pool.num_blocks,
            kv_sliding_blocks_free=0 if sliding is None else sliding.num_free_blocks,
            kv_sliding_usage=0.0 if sliding is None else 1.0 - sliding.num_free_blocks / sliding.pool.num_blocks,
            num_cached_blocks=kv.pool.num_cached_blocks,
            prefix_cache_queries=kv.num_query_tokens,
            prefix_cache_hits=kv.num_hit_tokens,
            prefix_cache_hit_rate=kv.num_hit_tokens / kv.num_query_tokens if kv.num_query_tokens else 0.0,
            time_schedule=self.timings.schedule,
            time_prepare=self.timings.prepare,
            time_output=self.timings.output,
            device_busy=self.worker.busy_seconds,
            device_idle=self.worker.idle_seconds,
            device_prepare=runner_timings.prepare,
            device_forward=runner_timings.forward,
            device_sample=runner_timings.sample,
            num_preemptions=scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_finished_requests=self.num_finished,
            grammars_compiled=0 if self.grammars is None else self.grammars.num_compiled,
            grammar_cache_hits=0 if self.grammars is None else self.grammars.num_cache_hits,
            grammar_compile_seconds=0.0 if self.grammars is None else self.grammars.compile_seconds,
            num_embedding_requests=self.num_embedding_requests,
            num_embedding_tokens=self.num_embedding_tokens,
            spec_num_drafts=0 if speculative is None else speculative.num_drafts,
            spec_draft_tokens=sum(drafted),
            spec_accepted_tokens=sum(accepted),
            spec_acceptance_rate=sum(accepted) / sum(drafted) if sum(drafted) else 0.0,
            spec_draft_tokens_per_position=drafted,
            spec_accepted_tokens_per_position=accepted,
            spec_acceptance_rate_per_position=tuple(a / d if d else 0.0 for a, d in zip(accepted, drafted)),
        )

    def add(self, request: Request, stream: RequestStream) -> None:
        """Queue a validated request (with its other samples when n > 1); output goes to ``stream``."""
        for sample in request.group or [request]:
            self.requests[sample.request_id] = sample
            self.outputs.register(sample.request_id, stream, sample.sample_index)
        if request.group:
            self._groups[request.request_id] = request.group
        spec = request.params.structured_output
        if spec is not None and request.grammar is None:
            # Compiled in a worker thread; the request joins the scheduler once it is ready, and
            # every other request keeps running meanwhile.
            assert self._task_group is not None and self.grammars is not None
            self._compiling.update(sample.request_id for sample in request.group or [request])
            self._num_compiling += 1
            self._task_group.start_soon(self._compile_then_add, request, spec)
            return
        self.scheduler.add(request)
        self._wake()

    async def _compile_then_add(self, request: Request, spec: StructuredOutput) -> None:
        assert self.grammars is not None
        try:
            grammar = await self.grammars.compile_async(spec)
        except StructuredOutputError as exc:
            self._num_compiling -= 1
            self._compiling.difference_update(sample.request_id for sample in request.group or [request])
            if request.request_id in self.requests:
                self._fail_request(request, exc)
            return
        self._compiling.difference_update(sample.request_id for sample in request.group or [request])
        self._num_compiling -= 1
        if request.request_id not in self.requests:  # aborted while it compiled
            return
        for sample in request.group or [request]:
            sample.grammar = grammar
        self.scheduler.add(request)
        self._wake()

    def abort_nowait(self, request_id: int) -> None:
        """Ask the loop to end a request with finish_reason "abort" before its next step. Never blocks."""
        self._aborts.append(request_id)
        if threading.get_ident() == self._loop_thread:
            self._wake()

    def is_live(self, request_id: int) -> bool:
        """Whether ``request_id`` is a stream's id (with n > 1, its first sample's) with a sample yet to end:
        what ``Engine.abort`` may still end (an abort already asked for but not yet applied counts as live)."""
        group = self._groups.get(request_id)
        if group is not None:
            return any(not sample.finished for sample in group)
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        return not request.group or request.group[0].request_id == request_id

    def stop_nowait(self) -> None:
        """Abort every request and end the loop after the step in flight."""
        self._stopping = True
        self._aborts.extend(self.requests)
        self._wake()

    def _wake(self) -> None:
        self._wakeup.set()

    def kill(self, error: EngineDeadError) -> None:
        """End the engine from outside the step loop (a tensor-parallel rank died), within moments.

        The step in flight, if any, fails with ``error`` at once (its device call is failed, the
        device thread abandoned: it may be stuck in a collective with the dead rank), and the loop
        dies with ``error``, failing every stream; an idle loop wakes to die.
        """
        if self.dead is not None or self._killed is not None:
            return
        self._killed = error
        self.worker.fail(error)
        self._wake()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The step loop; returns once stopped (or dead, after failing every stream)."""
        async with anyio.create_task_group() as task_group:  # grammar compilations
            self._task_group = task_group
            task_status.started()
            try:
                await self._loop()
            except Exception as exc:
                self._die(exc)
            task_group.cancel_scope.cancel()

    async def _loop(self) -> None:
        events: list[TokenEvent] = []  # the last finished step's, not yet delivered
        # The step on the device and the call that returns its output (None: its collect() is not
        # submitted yet, which the overlapping path does only after launching the next step).
        in_flight: tuple[SchedulerOutput, DeviceCall[StepOutput] | None] | None = None
        idle_with_work = 0  # schedules in a row that found nothing to run while requests were open
        while True:
            if self._killed is not None:
                raise self._killed
            events += self._apply_aborts()
            if self._stopping:
                if in_flight is not None:
                    await self._wait(self._result_call(in_flight[1]))
                self._end_delivered(self.outputs.process(events))
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
                    step = None
            if step is None and in_flight is None:
                if events:
                    self._deliver(events)
                    events = []
                    continue
                if any(request_id not in self._compiling for request_id in self.requests):
                    # Unfinished requests, yet nothing could be scheduled and nothing runs. One
                    # empty schedule is normal right after a preemption (admission waits a step);
                    # a second one means no step will ever come: fail them instead of waiting.
                    idle_with_work += 1
                    if idle_with_work < 2:
                        continue
                    self._fail_stalled()
                idle_with_work = 0
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
                continue
            call = None
            if step is not None:
                started = time.perf_counter()
                batch = self._batch(step)
                self.timings.prepare += time.perf_counter() - started
                if self._lookahead.overlaps:
                    # Launch N+1 on the device thread before it waits for N (collected just below).
                    self.worker.submit(functools.partial(self._lookahead.launch, batch))
                else:
                    call = self.worker.submit(functools.partial(self._lookahead.execute, batch))
            previous = None if in_flight is None else self._result_call(in_flight[1])
            # The overlap: the previous step's tokens reach their streams while the device computes.
            self._deliver(events)
            events = []
            idle_with_work = 0
            if in_flight is not None and previous is not None:
                result = await self._wait(previous)
                events = self._update(in_flight[0], result)
            in_flight = None if step is None else (step, call)

    def _result_call(self, call: DeviceCall[StepOutput] | None) -> DeviceCall[StepOutput]:
        """The call that returns an in-flight step's output: ``call``, or (overlapping) its collect()."""
        return call if call is not None else self.worker.submit(self._lookahead.collect)

    async def _wait(self, call: DeviceCall[StepOutput]) -> StepOutput:
        try:
            return await call.wait(self.step_timeout)
        except DeviceStepTimeoutError:
            self.worker.abandon()
            raise

    def _deliver(self, events: list[TokenEvent]) -> None:
        started = time.perf_counter()
        self._end_delivered(self.outputs.process(events))
        self.timings.output += time.perf_counter() - started

    def _batch(self, step: SchedulerOutput) -> StepBatch:
        kv = self.scheduler.kv_cache
        sequences = [
            SequenceInput(
                request_id=s.request.request_id,
                token_ids=s.request.token_ids(s.start, s.start + s.num_new_tokens - len(s.draft)) + s.draft,
                start_position=s.start,
                block_table=list(kv.block_table(s.request.request_id)),
                block_offset=kv.block_offset(s.request.request_id),
                sliding_block_table=_copied(kv.sliding_block_table(s.request.request_id)),
                sliding_block_offset=kv.sliding_block_offset(s.request.request_id),
                long_rope=s.request.long_rope,
                sample=s.sample,
                params=s.request.params,
                num_generated=len(s.request.output_token_ids) + s.request.num_pending_tokens - s.sample,
                prompt_token_ids=s.request.prompt_token_ids,
                bad_words_token_ids=s.request.bad_words_token_ids,
                # A trim cut the table: to the runner a new table, as after a preemption (both only grow).
                epoch=s.epoch + s.request.num_table_cuts,
                grammar=s.request.grammar,
                pooling=s.request.pooling,
                num_draft=len(s.draft),
                num_propose=s.num_propose,
            )
            for s in step.scheduled
        ]
        copies = tuple((copy.source, copy.target, copy.rows) for copy in step.block_copies)
        return StepBatch(sequences, step.finished_request_ids, copies)

    def _update(self, step: SchedulerOutput, sampled: StepOutput) -> list[TokenEvent]:
        self.num_steps += 1
        for item in step.scheduled:
            prompt_len = len(item.request.prompt_token_ids)
            self.num_prompt_tokens += max(0, min(item.start + item.num_new_tokens, prompt_len) - item.start)
        for request_id, reason in (sampled.failed or {}).items():
            failed = self.requests.get(request_id)
            if failed is not None:  # its token is discarded by update(): the request has ended
                self._fail_request(failed, RequestFailedError(reason))
        events = self.scheduler.update(step, sampled)
        for event in events:
            self.num_generated_tokens += len(event.new_token_ids)
            if event.embedding is not None:
                self.num_embedding_requests += 1
                self.num_embedding_tokens += len(event.request.prompt_token_ids)
            if event.finish_reason is not None:
                self._forget(event.request)
        return events

    def _apply_aborts(self) -> list[TokenEvent]:
        events = []
        while self._aborts:
            request_id = self._aborts.popleft()
            # A stream is one request id (its first sample's); with n > 1 aborting it ends every
            # sample, also once the first one has ended.
            group = self._groups.get(request_id)
            if group is None:
                aborted = self.requests.get(request_id)
                group = [] if aborted is None else [aborted]
            for request in group:
                if not request.finished:
                    self.scheduler.finish(request, "abort")
                    self._forget(request)
                    events.append(TokenEvent(request, [], "abort"))
        return events

    def _end_delivered(self, delivery: Delivery) -> None:
        """End in the scheduler what delivery ended: failed requests' groups, and stop-string matches.

        Requests a stop string ended are finished at once. Their blocks may still be written by a
        step in flight, but any new owner's steps run after it on the same device thread.
        """
        self.num_generated_tokens -= delivery.num_dropped_tokens  # counted when their step ended
        for failed in delivery.failed:
            for request in failed.group or [failed]:
                self.outputs.discard(request.request_id)
                if not request.finished:
                    self.scheduler.finish(request, "abort")
                    self._forget(request)
        for request in delivery.stopped:
            if not request.finished:
                self.scheduler.finish(request, "stop")
                self._forget(request)

    def _fail_stalled(self) -> None:
        stuck = [request for request in self.requests.values() if request.request_id not in self._compiling]
        logger.error(
            "asyncllm scheduler stalled: %d open requests (%d waiting, %d running), none schedulable, "
            "%d of %d KV blocks free; failing them",
            len(stuck),
            len(self.scheduler.waiting),
            len(self.scheduler.running),
            self.scheduler.kv_cache.num_free_blocks,
            self.scheduler.kv_cache.pool.num_blocks,
        )
        error = SchedulerStalledError(
            "the engine could not schedule this request although nothing else was running (an engine bug; see the log)"
        )
        for request in stuck:
            self.scheduler.finish(request, "abort")
            self._forget(request)
            self.outputs.fail_one(request.request_id, error)

    def _fail_request(self, request: Request, error: BaseException) -> None:
        """End a request's stream with ``error``, and every sample of it (a stream fails as a whole)."""
        self.outputs.fail_one(request.request_id, error)  # every sample's output goes to the one stream
        for sample in request.group or [request]:
            self.outputs.discard(sample.request_id)
            if not sample.finished:
                self.scheduler.finish(sample, "abort")
                self._forget(sample)

    def _forget(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self.num_finished += 1
        if request.group and all(sample.finished for sample in request.group):
            self._groups.pop(request.group[0].request_id, None)

    def _die(self, cause: BaseException) -> None:
        error = cause if isinstance(cause, EngineDeadError) else EngineDeadError(f"a model step failed: {cause!r}")
        if error is not cause:
            error.__cause__ = cause
        logger.error("asyncllm engine died: %r", cause)
        self.dead = error
        # A step queued behind the failed one would compute on tokens that will never come.
        self.worker.discard_queued(error)
        self.outputs.fail_all(error)
        for request in list(self.requests.values()):
            try:
                self.scheduler.finish(request, "abort")
            except Exception:  # the failure may have left the scheduler inconsistent: end the rest anyway
                logger.exception("asyncllm: request %d could not be finished cleanly", request.request_id)
        self.requests.clear()
        self._groups.clear()
