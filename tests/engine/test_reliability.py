"""Reliability: faults end every request cleanly, cancellation never leaks, load is bounded."""

from __future__ import annotations

import threading

import anyio
import pytest

from asyncllm import (
    Completion,
    DeviceOutOfMemoryError,
    DeviceStepTimeoutError,
    Engine,
    EngineClosedError,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    SamplingParams,
)
from asyncllm.executor._runner import SequenceInput, StepBatch, StepOutput
from asyncllm.testing import EOS_ID, ByteTokenizer, ScriptedRunner

pytestmark = pytest.mark.anyio

LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def _scripted(**kwargs: object) -> tuple[Engine, ScriptedRunner]:
    runner = ScriptedRunner(b"abc", **kwargs)  # type: ignore[arg-type]
    return Engine.open(runner=runner, tokenizer=ByteTokenizer()), runner


def _device_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asyncllm-device"]


async def test_a_failing_step_kills_the_engine_cleanly() -> None:
    engine, _ = _scripted(fail_at_step=3)
    errors: list[BaseException] = []
    with pytest.raises(EngineDeadError) as exited:
        async with engine:

            async def consume(prompt: str) -> None:
                try:
                    async for _ in engine.stream(prompt, LONG):
                        pass
                except EngineDeadError as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as tg:
                for prompt in ("one", "two", "three"):
                    tg.start_soon(consume, prompt)
            with pytest.raises(EngineDeadError):
                engine.stream("after death", LONG)
    assert len(errors) == 3
    assert isinstance(errors[0].__cause__, RuntimeError)
    assert "scripted failure" in str(errors[0].__cause__)
    assert isinstance(exited.value.__cause__, RuntimeError)
    assert _device_threads() == []


class _OutOfMemoryRunner(ScriptedRunner):
    def execute(self, batch: StepBatch) -> StepOutput:
        if self.steps:
            raise DeviceOutOfMemoryError("CUDA out of memory (simulated)")
        return super().execute(batch)


async def test_device_out_of_memory_is_a_dead_engine() -> None:
    runner = _OutOfMemoryRunner(b"x")
    with pytest.raises(DeviceOutOfMemoryError):
        async with Engine.open(runner=runner, tokenizer=ByteTokenizer()) as engine:
            with pytest.raises(DeviceOutOfMemoryError):
                await engine.generate("hello", LONG)
    assert runner.closed
    assert _device_threads() == []


async def test_torch_oom_is_translated_by_the_model_runner(tiny_llama: object) -> None:
    import torch

    from asyncllm.worker._model_runner import TorchModelRunner
    class Exploding(TorchModelRunner):
        def _execute(self, sequences, after=None):  # type: ignore[no-untyped-def]
            raise torch.OutOfMemoryError("simulated allocation failure")

    runner = Exploding(tiny_llama, device="cpu", kv_cache_blocks=16)  # type: ignore[arg-type]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    with pytest.raises(DeviceOutOfMemoryError) as raised:
        async with Engine.open(runner=runner, tokenizer=tokenizer) as engine:
            await engine.generate("hello", SamplingParams(max_tokens=4))
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)


async def test_overload_is_refused_at_once_and_the_engine_keeps_serving() -> None:
    runner = ScriptedRunner(b"z", num_kv_blocks=4, block_size=16)
    async with Engine.open(runner=runner, tokenizer=ByteTokenizer(), max_num_seqs=1, max_waiting_requests=2) as engine:
        running = engine.stream("r", SamplingParams(max_tokens=40, ignore_eos=True))
        first = await running.__anext__()  # admitted: no longer waiting
        queued = [engine.stream(f"w{i}", SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(2)]
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
            engine.stream("one too many", SamplingParams(max_tokens=3))
        results = []
        for stream in [running, *queued]:
            results.append([c async for c in stream])
        stats = engine.statistics()
    assert [sum(len(c.token_ids) for c in r) for r in results] == [40 - len(first.token_ids), 3, 3]
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("point", ["before-first", "after-first", "generate", "start-of-generate", "nested-timeout"])
async def test_cancellation_at_every_await_point_leaks_nothing(point: str) -> None:
    engine, _ = _scripted(num_kv_blocks=32)
    async with engine:
        if point == "before-first":
            with anyio.move_on_after(0):  # cancelled at the first checkpoint: the first __anext__
                async for _ in engine.stream("x" * 40, LONG):
                    pytest.fail("no chunk can arrive inside an expired scope")
        elif point == "after-first":
            with anyio.CancelScope() as scope:
                async for _ in engine.stream("x" * 40, LONG):
                    scope.cancel()
        elif point == "generate":
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.generate, "x" * 40, LONG)
                await anyio.wait_all_tasks_blocked()
                tg.cancel_scope.cancel()
        elif point == "start-of-generate":
            with anyio.CancelScope() as scope:
                scope.cancel()
                await engine.generate("x" * 40, LONG)
        elif point == "nested-timeout":
            with pytest.raises(TimeoutError):
                with anyio.fail_after(3600) as outer:
                    async with engine.stream("x" * 40, LONG) as stream:
                        first = await stream.__anext__()
                        assert first.token_ids
                        outer.deadline = anyio.current_time()
                        await stream.__anext__()
        await engine.generate("barrier", SamplingParams(max_tokens=1))
        stats = engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_finished_requests == 2


async def test_a_stalled_consumer_does_not_slow_the_others() -> None:
    engine, runner = _scripted(num_kv_blocks=64)
    async with engine:
        stalled = engine.stream("stalled", SamplingParams(max_tokens=200, ignore_eos=True))
        others = [await engine.generate(f"other {i}", SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(3)]
        steps_while_stalled = len(runner.steps)
        chunks = [c async for c in stalled]
    assert [len(o.token_ids) for o in others] == [50, 50, 50]
    # The stalled request kept running (it was stepped with the others) ...
    assert steps_while_stalled >= 150
    # ... and its deltas were merged: far fewer chunks than tokens, every token there.
    assert len(chunks) < 60
    assert sum(len(c.token_ids) for c in chunks) == 200
    assert "".join(c.text for c in chunks) == ("abc" * 67)[:200]


async def test_generate_is_woken_once_with_the_whole_output(monkeypatch: pytest.MonkeyPatch) -> None:
    # generate() reads the output only at the end: one wake-up of its task, not one per step.
    from asyncllm.engine._stream import RequestStream
    reads = []
    original = RequestStream.__anext__

    async def counting(self: RequestStream) -> object:
        reads.append(self.request_id)
        return await original(self)

    monkeypatch.setattr(RequestStream, "__anext__", counting)
    engine, _ = _scripted(num_kv_blocks=64)
    async with engine:
        streamed = [c async for c in engine.stream("streamed", SamplingParams(max_tokens=50, ignore_eos=True))]
        reads.clear()
        completion = await engine.generate("generated", SamplingParams(max_tokens=50, ignore_eos=True))
        two = await engine.generate("two samples", SamplingParams(n=2, max_tokens=20, ignore_eos=True))
    assert len(streamed) >= 10  # a streaming consumer is woken step by step (lagging reads merge)
    assert len(completion.token_ids) == 50 and completion.text == ("abc" * 17)[:50]
    assert completion.finish_reason == "length"
    assert [len(s.token_ids) for s in two.samples] == [20, 20]
    # one chunk per sample, then the end of the iteration
    assert len(reads) == 2 + 3


async def test_generate_decodes_its_text_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # generate() reads the text only at the end, so without stop strings it is decoded once then, not
    # twice per step; the text is the one a stream sends, multi-byte characters split across tokens
    # included. A stop string needs the text step by step, and still gets it.
    decodes = []
    original = ByteTokenizer.decode

    def counting(self: ByteTokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        decodes.append(len(token_ids))
        return original(self, token_ids, skip_special_tokens)

    monkeypatch.setattr(ByteTokenizer, "decode", counting)
    script = "héllo wörld, 3€ ".encode()
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    async with Engine.open(runner=ScriptedRunner(script), tokenizer=ByteTokenizer()) as engine:
        streamed = "".join([c.text async for c in engine.stream("streamed", params)])
        decodes.clear()
        completion = await engine.generate("generated", params)
        at_end = [length for length in decodes if length]  # decodes of no ids cost nothing
        decodes.clear()
        stopped = await engine.generate("stopped", SamplingParams(max_tokens=60, stop=["3€"]))
    expected = (script * 4)[:60].decode(errors="replace")
    assert streamed == completion.text == expected
    assert at_end == [60]  # the whole output once, at the end: not 2 x 60 windows, nor push then flush
    assert stopped.text == "héllo wörld, " and stopped.finish_reason == "stop"
    assert len(decodes) > 10


async def test_generate_text_decoded_at_the_end_equals_the_streamed_text() -> None:
    # The deferred decode (generate without stop strings) against the step-by-step one (stream): several
    # samples of one request, a special token kept in the text (spaced apart), and the end by EOS.
    script = [*"ab é".encode(), EOS_ID]
    async with Engine.open(runner=ScriptedRunner(script), tokenizer=ByteTokenizer()) as engine:
        for params in (
            SamplingParams(n=3, max_tokens=20, ignore_eos=True, skip_special_tokens=False),
            SamplingParams(max_tokens=20, skip_special_tokens=False),
            SamplingParams(max_tokens=20),
        ):
            streamed: dict[int, str] = {}
            async for chunk in engine.stream("prompt", params):
                streamed[chunk.index] = streamed.get(chunk.index, "") + chunk.text
            generated = await engine.generate("prompt", params)
            assert {s.index: s.text for s in generated.samples} == streamed
    assert streamed[0] == "ab é"  # EOS ended the last request and is left out


async def test_generate_aborted_by_closing_the_engine_ends_cleanly() -> None:
    # A deferred request ended by an abort (the engine closing under it) ends like any other: its text is
    # that of every token it carries.
    fiftieth = threading.Event()

    def script(seq: SequenceInput) -> int:
        if seq.num_generated >= 50:
            fiftieth.set()
        return b"abc"[seq.num_generated % 3]

    results: list[object] = []

    async def generate(engine: Engine) -> None:
        try:
            results.append(await engine.generate("prompt", SamplingParams(max_tokens=1_000, ignore_eos=True)))
        except EngineClosedError as exc:
            results.append(exc)

    async with anyio.create_task_group() as tg:
        async with Engine.open(runner=ScriptedRunner(script), tokenizer=ByteTokenizer()) as engine:
            tg.start_soon(generate, engine)
            await anyio.to_thread.run_sync(fiftieth.wait, abandon_on_cancel=True)
    assert len(results) == 1
    outcome = results[0]
    if isinstance(outcome, Completion):
        assert outcome.finish_reason == "abort" and len(outcome.token_ids) >= 50
        assert outcome.text == ("abc" * len(outcome.token_ids))[: len(outcome.token_ids)]
    else:
        assert isinstance(outcome, EngineClosedError)


async def test_device_work_stays_on_one_thread() -> None:
    engine, runner = _scripted()
    async with engine:
        await engine.generate("hello", SamplingParams(max_tokens=5))
    assert len(runner.thread_ids) == 1
    assert threading.get_ident() not in runner.thread_ids
    assert runner.closed


class _HangingRunner(ScriptedRunner):
    """A runner whose step ``hang_at`` blocks until the test releases it: a device that never returns."""

    def __init__(self, hang_at: int) -> None:
        super().__init__(b"abc")
        self.hang_at = hang_at
        self.release = threading.Event()

    def execute(self, batch: StepBatch) -> StepOutput:
        if len(self.steps) == self.hang_at:
            self.release.wait()
        return super().execute(batch)


async def test_a_hung_step_kills_the_engine_after_step_timeout_and_close_returns() -> None:
    runner = _HangingRunner(hang_at=3)
    engine = Engine.open(runner=runner, tokenizer=ByteTokenizer(), step_timeout=0.5)
    try:
        with anyio.fail_after(60), pytest.raises(DeviceStepTimeoutError):
            async with engine:
                worker = engine._core.worker  # type: ignore[union-attr]
                with pytest.raises(DeviceStepTimeoutError, match="step_timeout"):
                    async for _ in engine.stream("hello", LONG):
                        pass
                # Dead: /health fails and new requests are refused at once.
                with pytest.raises(EngineDeadError):
                    engine.check_health()
                with pytest.raises(EngineDeadError):
                    engine.stream("after", LONG)
        # Leaving `async with` returned although the device thread is still stuck in its step.
        assert worker.thread.is_alive()
        assert not runner.closed
    finally:
        runner.release.set()
    # Once the step returns, the abandoned thread ends by itself.
    await anyio.to_thread.run_sync(worker.thread.join, 60)
    assert not worker.thread.is_alive()


async def test_close_under_a_hung_step_is_bounded_by_step_timeout() -> None:
    runner = _HangingRunner(hang_at=2)
    stream_errors: list[BaseException] = []
    try:
        with anyio.fail_after(60), pytest.raises(DeviceStepTimeoutError):
            async with Engine.open(runner=runner, tokenizer=ByteTokenizer(), step_timeout=0.5) as engine:
                stream = engine.stream("hello", LONG)
                await stream.__anext__()
                worker = engine._core.worker  # type: ignore[union-attr]
            # (leaving the block while the step hangs)
    finally:
        runner.release.set()
    try:
        async for _ in stream:
            pass
    except (EngineDeadError, EngineClosedError) as exc:
        stream_errors.append(exc)
    assert len(stream_errors) == 1
    await anyio.to_thread.run_sync(worker.thread.join, 60)


def test_step_timeout_is_checked() -> None:
    for bad in (0, -1.0, float("nan"), float("inf"), "10", True):
        with pytest.raises(ValueError, match="step_timeout"):
            Engine.open(runner=ScriptedRunner(b"a"), tokenizer=ByteTokenizer(), step_timeout=bad)  # type: ignore[arg-type]
    Engine.open(runner=ScriptedRunner(b"a"), tokenizer=ByteTokenizer(), step_timeout=None)


class _FragileTokenizer(ByteTokenizer):
    """Raises on one token, as a tokenizer with a bug (or a corrupt vocabulary entry) would."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if 7 in token_ids:
            raise RuntimeError("tokenizer bug on token 7")
        return super().decode(token_ids, skip_special_tokens)


@pytest.mark.parametrize("n", [1, 3])
async def test_a_failure_in_one_requests_output_ends_that_request_only(n: int) -> None:
    def script(seq: SequenceInput) -> int:
        if seq.prompt_token_ids[0] == ord("!") and seq.num_generated == 4:
            return 7
        return b"abc"[seq.num_generated % 3]

    async with Engine.open(runner=ScriptedRunner(script), tokenizer=_FragileTokenizer()) as engine:
        healthy = engine.stream("healthy", SamplingParams(max_tokens=60, ignore_eos=True))
        with pytest.raises(RequestFailedError, match="tokenizer bug") as failed:
            async for _ in engine.stream("!fragile", SamplingParams(n=n, max_tokens=60, ignore_eos=True)):
                pass
        assert isinstance(failed.value.__cause__, RuntimeError)
        text = "".join([c.text async for c in healthy])
        engine.check_health()
        after = await engine.generate("after", SamplingParams(max_tokens=5, ignore_eos=True))
        stats = engine.statistics()
    assert text == ("abc" * 20)[:60]
    assert after.text == "abcab"
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_a_call_queued_behind_a_long_one_is_not_charged_with_its_time() -> None:
    # With async scheduling, step N+1 is queued while step N runs: its timeout counts from when the
    # engine starts waiting for it (N has returned by then), not from its submission.
    from asyncllm.executor._device import DeviceWorker

    worker = DeviceWorker()
    try:
        queued = worker.submit(lambda: "done")
        queued.submitted_at -= 100.0  # as if it had waited 100 s behind a step that ran that long
        assert await queued.wait(timeout=5.0) == "done"
    finally:
        await worker.stop()


async def test_calls_queued_behind_a_failure_are_discarded_not_run() -> None:
    from asyncllm.executor._device import DeviceWorker

    worker = DeviceWorker()
    release = threading.Event()
    ran: list[str] = []
    try:
        started = threading.Event()

        def blocking() -> bool:
            started.set()
            return release.wait()

        running = worker.submit(blocking)
        queued = worker.submit(lambda: ran.append("queued"))
        await anyio.to_thread.run_sync(started.wait)  # the thread is inside the first call
        worker.discard_queued(EngineDeadError("the engine died"))
        with pytest.raises(EngineDeadError, match="the engine died"):
            await queued.wait()
        release.set()
        assert await running.wait() is True
    finally:
        release.set()
        await worker.stop()
    assert ran == []


async def test_close_after_a_failed_step_is_bounded_when_the_next_step_hangs() -> None:
    release = threading.Event()

    class FailThenHang(ScriptedRunner):
        def execute(self, batch: StepBatch) -> StepOutput:
            if len(self.steps) == 3:
                self.steps.append(None)  # type: ignore[arg-type]
                raise RuntimeError("step failed")
            if len(self.steps) >= 4:
                release.wait()
            return super().execute(batch)

    runner = FailThenHang(b"abc")
    try:
        with anyio.fail_after(60), pytest.raises(EngineDeadError):
            async with Engine.open(runner=runner, tokenizer=ByteTokenizer(), step_timeout=0.5) as engine:
                worker = engine._core.worker  # type: ignore[union-attr]
                with pytest.raises(EngineDeadError):
                    async for _ in engine.stream("hello", LONG):
                        pass
    finally:
        release.set()
    await anyio.to_thread.run_sync(worker.thread.join, 60)
    assert not worker.thread.is_alive()


async def test_a_failure_after_a_requests_last_chunk_still_ends_its_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncllm.engine._output_processor import OutputProcessor

    def broken(*args: object) -> None:
        raise RuntimeError("metrics bug")

    monkeypatch.setattr(OutputProcessor, "_record_finish", broken)
    async with Engine.open(runner=ScriptedRunner(b"abc"), tokenizer=ByteTokenizer()) as engine:
        with anyio.fail_after(60):
            chunks = [c async for c in engine.stream("x", SamplingParams(max_tokens=3, ignore_eos=True))]
        engine.check_health()
    assert "".join(c.text for c in chunks) == "abc" and chunks[-1].finish_reason == "length"
