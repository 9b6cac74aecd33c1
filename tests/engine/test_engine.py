"""The whole request journey on a real (tiny, random) model: streaming, early exits, seeds, errors."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import msgspec
import pytest

from asyncllm import (
    Completion,
    Engine,
    EngineClosedError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    SamplingParams,
)

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Too long to finish on its own during a test: only an abort can free its blocks.
ABANDONED = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


def _open(model: Path, **options: object) -> Engine:
    return Engine.open(model, device="cpu", kv_cache_blocks=64, **options)  # type: ignore[arg-type]


async def test_stream_text_equals_completion_and_decode(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    async with _open(tiny_llama) as engine:
        chunks = [chunk async for chunk in engine.stream("héllo wörld 你好", params)]
        completion = await engine.generate("héllo wörld 你好", params)
        decoded = engine.tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
    assert "".join(c.text for c in chunks) == completion.text == decoded
    assert tuple(t for c in chunks for t in c.token_ids) == completion.token_ids
    assert len(completion.token_ids) == 40
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason == completion.finish_reason == "length"


async def test_prompt_as_text_and_as_ids_agree(tiny_llama: Path) -> None:
    async with _open(tiny_llama) as engine:
        ids = engine.tokenizer.encode("the quick brown fox")
        by_text = await engine.generate("the quick brown fox", GREEDY)
        by_ids = await engine.generate(ids, GREEDY)
    assert by_text.prompt_token_ids == tuple(ids)
    assert by_text.token_ids == by_ids.token_ids


async def _early_exit(engine: Engine, how: str) -> int:
    """Leave a stream after two chunks in the way named; return how many chunks were read."""
    read = 0
    if how == "break":
        async for _ in engine.stream("abandoned", ABANDONED):
            read += 1
            if read == 2:
                break
    elif how == "aclose":
        stream = engine.stream("abandoned", ABANDONED)
        async for _ in stream:
            read += 1
            if read == 2:
                await stream.aclose()
        assert stream.finished is False or read == 2
    elif how == "cancel":
        with anyio.CancelScope() as scope:
            async with engine.stream("abandoned", ABANDONED) as stream:
                async for _ in stream:
                    read += 1
                    if read == 2:
                        scope.cancel()
        assert scope.cancelled_caught
    elif how == "timeout":
        with pytest.raises(TimeoutError):
            with anyio.fail_after(3600) as scope:
                async for _ in engine.stream("abandoned", ABANDONED):
                    read += 1
                    if read == 2:
                        scope.deadline = anyio.current_time()  # expire at the next checkpoint
    elif how == "task-cancel":
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                nonlocal read
                async for _ in engine.stream("abandoned", ABANDONED):
                    read += 1
                    if read == 2:
                        tg.cancel_scope.cancel()

            tg.start_soon(consume)
    return read


@pytest.mark.parametrize("how", ["break", "aclose", "cancel", "timeout", "task-cancel"])
async def test_leaving_a_stream_early_frees_its_blocks(tiny_llama: Path, how: str) -> None:
    async with _open(tiny_llama) as engine:
        reference = await engine.generate("the other request", GREEDY)
        total = engine.statistics().kv_blocks_total
        result: dict[str, object] = {}

        async def other() -> None:
            result["completion"] = await engine.generate("the other request", GREEDY)

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            read = await _early_exit(engine, how)
        # One more request is a barrier: aborts are applied before the next step is scheduled.
        await engine.generate("barrier", SamplingParams(max_tokens=1))
        stats = engine.statistics()
    assert read == 2
    # The same completion; its prompt is now partly cached (counted in num_cached_tokens).
    completion = result["completion"]
    assert isinstance(completion, Completion)
    assert msgspec.structs.replace(completion, num_cached_tokens=reference.num_cached_tokens) == reference
    assert stats.kv_blocks_free == total
    assert stats.num_running == stats.num_waiting == 0


async def test_abort_by_id_ends_the_stream_from_another_task_and_frees_its_blocks(tiny_llama: Path) -> None:
    async with _open(tiny_llama, max_num_seqs=1) as engine:
        total = engine.statistics().kv_blocks_total
        running = engine.stream("abandoned", ABANDONED)
        # max_num_seqs=1: this one waits behind the first and is aborted before it ever runs.
        waiting = engine.stream("never scheduled", ABANDONED)
        samples = engine.stream("several", SamplingParams(n=3, temperature=1.0, max_tokens=900, ignore_eos=True))
        first = await running.__anext__()
        outcomes: dict[str, bool] = {}

        async def supervisor() -> None:  # holds ids, not streams
            for name, request_id in (("running", running.request_id), ("waiting", waiting.request_id)):
                outcomes[name] = engine.abort(request_id)
            outcomes["samples"] = engine.abort(samples.request_id)

        async with anyio.create_task_group() as tg:
            tg.start_soon(supervisor)
        rest = [chunk async for chunk in running]
        waited = [chunk async for chunk in waiting]
        ended = [chunk async for chunk in samples if chunk.finished]
        await engine.generate("barrier", SamplingParams(max_tokens=1))
        stats = engine.statistics()
        again = engine.abort(running.request_id)
        unknown = engine.abort(10**9)
    assert outcomes == {"running": True, "waiting": True, "samples": True}
    assert first.finished is False and rest[-1].finish_reason == "abort"
    assert len(rest) + 1 < ABANDONED.max_tokens
    assert [c.finish_reason for c in waited] == ["abort"] and waited[0].token_ids == ()
    assert sorted((c.index, c.finish_reason) for c in ended) == [(0, "abort"), (1, "abort"), (2, "abort")]
    assert (again, unknown) == (False, False)
    assert stats.kv_blocks_free == total
    assert stats.num_running == stats.num_waiting == 0


async def test_abort_by_id_after_the_end_is_false_and_after_close_raises(tiny_llama: Path) -> None:
    async with _open(tiny_llama) as engine:
        stream = engine.stream("short", GREEDY)
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].finish_reason == "length"
        assert engine.abort(stream.request_id) is False
    with pytest.raises(EngineClosedError):
        engine.abort(stream.request_id)


async def test_seeded_sampling_is_reproducible(tiny_llama: Path) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    async with _open(tiny_llama) as engine:
        alone = await engine.generate("once upon", seeded)
        again = await engine.generate("once upon", seeded)
        crowd: list[object] = []
        async with anyio.create_task_group() as tg:

            async def noisy(i: int) -> None:
                await engine.generate(f"noise {i}", SamplingParams(temperature=1.5, max_tokens=20))

            async def target() -> None:
                crowd.append(await engine.generate("once upon", seeded))

            for i in range(6):
                tg.start_soon(noisy, i)
            tg.start_soon(target)
        other_seed = await engine.generate("once upon", SamplingParams(temperature=1.0, seed=99, max_tokens=20))
    assert alone.token_ids == again.token_ids == crowd[0].token_ids  # type: ignore[attr-defined]
    assert other_seed.token_ids != alone.token_ids


async def test_stop_token_ids_and_length(tiny_llama: Path) -> None:
    async with _open(tiny_llama) as engine:
        free_run = await engine.generate("stop here", GREEDY)
        stop_id = free_run.token_ids[3]
        first = free_run.token_ids.index(stop_id)
        stopped = await engine.generate(
            "stop here", SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(stop_id,))
        )
    assert free_run.finish_reason == "length"
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[: first + 1]


async def test_bad_requests_fail_at_the_call_and_the_engine_keeps_serving(tiny_llama: Path) -> None:
    async with _open(tiny_llama, max_model_len=64) as engine:
        with pytest.raises(PromptTooLongError, match="max_model_len=64"):
            engine.stream(list(range(5, 65)), SamplingParams(max_tokens=8))
        with pytest.raises(InvalidPromptError, match="empty"):
            engine.stream("", GREEDY)
        with pytest.raises(InvalidPromptError, match="vocabulary"):
            engine.stream([1, 2, 10**6], GREEDY)
        with pytest.raises(InvalidSamplingParamsError, match="params must be a SamplingParams"):
            engine.stream("x", 42)  # type: ignore[arg-type]
        with pytest.raises(InvalidSamplingParamsError, match=r"unknown sampling option.*bogus"):
            engine.stream("x", {"max_tokens": 3, "bogus": 1})
        with pytest.raises(InvalidRequestError):
            await engine.generate([], GREEDY)
        ok = await engine.generate("still serving", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        stats = engine.statistics()
    assert len(ok.token_ids) == 5
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_finished_requests == 1


async def test_leaving_the_engine_aborts_open_streams_and_joins_the_device_thread(tiny_llama: Path) -> None:
    async with _open(tiny_llama) as engine:
        stream = engine.stream("never finishes", SamplingParams(max_tokens=500, ignore_eos=True))
        first = await stream.__anext__()
        assert any(t.name == "asyncllm-device" for t in threading.enumerate())
    rest = [chunk async for chunk in stream]
    assert first.finished is False
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    assert not any(t.name in ("asyncllm-device", "asyncllm-kv-prefault") for t in threading.enumerate())
    with pytest.raises(EngineClosedError):
        engine.stream("too late", GREEDY)


async def test_engine_options_are_checked_at_open(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="block_size"):
        Engine.open(tiny_llama, block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        Engine.open(tiny_llama, dtype="float8")
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=2, max_model_len=1000):
            pass
    assert not any(t.name == "asyncllm-device" for t in threading.enumerate())
