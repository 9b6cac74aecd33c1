"""Priority scheduling through the Engine: the order requests get their first token, preemption to
admit, n > 1, structured output, the admission limits, and the checks of ``priority`` at the call.

Most tests use the scripted runner (exact and fast; its steps are recorded, so the order is read off
them); two run the tiny random model to show the real path: outputs are unchanged by the
preemptions priority causes, and a request whose grammar compiles takes its rank once compiled.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm import (
    Engine,
    EngineOptions,
    EngineOverloadedError,
    InvalidRequestError,
    RequestStream,
    SamplingParams,
    StreamChunk,
)
from asyncllm.core._scheduler import Scheduler, SchedulerOutput
from asyncllm.testing import ByteTokenizer, ScriptedRunner

pytestmark = pytest.mark.anyio

SCRIPT = b"abcdefghij"  # every request emits these, in order and round again; never EOS


def scripted(**options: object) -> tuple[Engine, ScriptedRunner]:
    runner = ScriptedRunner(SCRIPT)
    engine = Engine.open(runner=runner, tokenizer=ByteTokenizer(), **options)  # type: ignore[arg-type]
    return engine, runner


def first_sampled(runner: ScriptedRunner, prompts: Sequence[str]) -> list[str]:
    """``prompts`` in the order their requests first sampled a token (step, then place in the step)."""
    order: list[str] = []
    for step in runner.steps:
        for seq in step.sequences:
            prompt = bytes(seq.prompt_token_ids).decode()
            if seq.sample and prompt in prompts and prompt not in order:
                order.append(prompt)
    return order


def script_text(max_tokens: int) -> str:
    return (SCRIPT * (max_tokens // len(SCRIPT) + 1))[:max_tokens].decode()


async def drain(stream: RequestStream) -> list[StreamChunk]:
    async with stream:
        return [chunk async for chunk in stream]


async def test_a_high_priority_request_gets_its_first_token_before_the_waiting_low_ones() -> None:
    engine, runner = scripted(scheduling_policy="priority", max_num_seqs=1)
    short = SamplingParams(max_tokens=3)
    async with engine:
        # Saturated: one seat, held by a request that runs until it is closed.
        blocker = engine.stream("blocker", SamplingParams(max_tokens=1500), priority=1)
        await anext(blocker)
        lows = [engine.stream(f"low-{i}", short, priority=5) for i in range(3)]
        await anext(blocker)  # steps ran with the low ones waiting
        assert (engine.statistics().num_running, engine.statistics().num_waiting) == (1, 3)
        high = engine.stream("high", short, priority=2)  # later, better than the waiting ones, not the running one
        await anext(blocker)
        assert engine.statistics().num_waiting == 4
        await blocker.aclose()
        texts = {}
        async with anyio.create_task_group() as group:

            async def read(name: str, stream: RequestStream) -> None:
                texts[name] = "".join(chunk.text for chunk in await drain(stream))

            for name, stream in [*((f"low-{i}", low) for i, low in enumerate(lows)), ("high", high)]:
                group.start_soon(read, name, stream)
        stats = engine.statistics()
    assert first_sampled(runner, ["high", "low-0", "low-1", "low-2"]) == ["high", "low-0", "low-1", "low-2"]
    assert texts == {name: script_text(3) for name in ("high", "low-0", "low-1", "low-2")}
    assert stats.num_preemptions == 0  # 2 does not outrank 1: the blocker kept its seat until closed
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_fcfs_is_the_default_and_keeps_arrival_order() -> None:
    engine, runner = scripted(max_num_seqs=1)
    async with engine:
        assert engine.options.scheduling_policy == "fcfs"
        blocker = engine.stream("blocker", SamplingParams(max_tokens=1500))
        await anext(blocker)
        streams = [engine.stream(name, SamplingParams(max_tokens=3), priority=0) for name in ("a", "b", "c")]
        await blocker.aclose()
        for stream in streams:
            await drain(stream)
    assert first_sampled(runner, ["a", "b", "c"]) == ["a", "b", "c"]


async def test_a_better_priority_preempts_a_sample_of_a_running_group() -> None:
    # Both samples of an n=2 request hold the two seats; the high request takes the seat of one,
    # which is recomputed afterwards: every output is whole.
    engine, _ = scripted(scheduling_policy="priority", max_num_seqs=2)
    async with engine:
        group = engine.stream("group", SamplingParams(n=2, max_tokens=40), priority=3)
        chunks = [await anext(group)]
        assert engine.statistics().num_running == 2
        high = await engine.generate("high", SamplingParams(max_tokens=5), priority=-1)
        assert not group.finished  # it got its tokens while the group still ran
        chunks += await drain(group)
        stats = engine.statistics()
    assert high.text == script_text(5)
    assert stats.num_preemptions == 1
    texts = ["", ""]
    for chunk in chunks:
        texts[chunk.index] += chunk.text
    assert texts == [script_text(40)] * 2
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_the_waiting_queue_bound_holds_for_every_priority() -> None:
    engine, _ = scripted(scheduling_policy="priority", max_num_seqs=1, max_waiting_requests=2)
    async with engine:
        blocker = engine.stream("blocker", SamplingParams(max_tokens=1500), priority=0)
        await anext(blocker)
        waiting = [engine.stream(f"w{i}", SamplingParams(max_tokens=2), priority=5) for i in range(2)]
        with pytest.raises(EngineOverloadedError):
            engine.stream("vip", SamplingParams(max_tokens=2), priority=-100)
        await blocker.aclose()
        for stream in waiting:
            await drain(stream)


@pytest.mark.parametrize("bad", ["1", 1.5, True, None])
async def test_a_priority_that_is_not_an_int_is_refused_at_the_call(bad: object) -> None:
    engine, _ = scripted(scheduling_policy="priority")
    async with engine:
        with pytest.raises(InvalidRequestError, match="priority must be an int") as info:
            engine.stream("x", SamplingParams(max_tokens=1), priority=bad)  # type: ignore[arg-type]
        assert info.value.param == "priority"
        with pytest.raises(InvalidRequestError, match="priority must be an int"):
            await engine.generate("x", SamplingParams(max_tokens=1), priority=bad)  # type: ignore[arg-type]
        big = await engine.generate("x", SamplingParams(max_tokens=1), priority=-(10**30))  # any int
        assert big.text == "a"
        assert engine.statistics().num_waiting == 0


async def test_fcfs_refuses_a_priority_it_would_ignore() -> None:
    engine, _ = scripted()
    async with engine:
        for call in (
            lambda: engine.stream("x", priority=1),
            # Refused before its (here impossible: no chat template) rendering.
            lambda: engine.chat_stream([{"role": "user", "content": "x"}], priority=-1),
        ):
            with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'") as info:
                call()
            assert info.value.param == "priority"
        with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'"):
            await engine.generate("x", priority=2)
        with pytest.raises(InvalidRequestError, match="scheduling_policy='priority'"):
            await engine.chat([{"role": "user", "content": "x"}], priority=2)
        assert (await engine.generate("x", SamplingParams(max_tokens=2), priority=0)).text == "ab"


def test_the_policy_is_checked_at_open() -> None:
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority'"):
        EngineOptions(scheduling_policy="lifo")  # type: ignore[arg-type]
    assert EngineOptions().scheduling_policy == "fcfs"


# -- the tiny model --------------------------------------------------------------------------------


async def test_priority_on_the_tiny_model_preempts_without_changing_outputs(tiny_llama: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    async with Engine.open(
        tiny_llama, device="cpu", kv_cache_blocks=64, scheduling_policy="priority", max_num_seqs=1
    ) as engine:
        alone_blocker = await engine.generate("the blocker runs for a while", long)
        alone = {p: await engine.generate(p, greedy) for p in ("high one", "low one", "low two")}
        pair = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
        alone_pair = await engine.generate("high one", pair)
        engine.reset_prefix_cache()
        order: list[str] = []
        tokens: dict[str, list[tuple[int, ...]]] = {}
        started = anyio.Event()

        async def read(name: str, stream: RequestStream) -> None:
            samples: dict[int, list[int]] = {}
            async with stream:
                async for chunk in stream:
                    if not samples:
                        order.append(name)
                        started.set()
                    samples.setdefault(chunk.index, []).extend(chunk.token_ids)
            tokens[name] = [tuple(samples[i]) for i in sorted(samples)]

        blocker = engine.stream("the blocker runs for a while", long, priority=1)
        async with anyio.create_task_group() as group:
            group.start_soon(read, "blocker", blocker)
            await started.wait()  # the blocker has its first token: it holds the only seat
            for name in ("low one", "low two"):
                group.start_soon(read, name, engine.stream(name, greedy, priority=2))
            # n=2, later than the low ones but better, and better than the blocker: it preempts it.
            group.start_soon(read, "high one", engine.stream("high one", pair, priority=0))
        stats = engine.statistics()
        vectors = await engine.embed(["low one"], priority=3)
    assert order == ["blocker", "high one", "low one", "low two"]
    assert stats.num_preemptions >= 1
    assert tokens["blocker"] == [alone_blocker.token_ids]  # recomputed after its preemption, unchanged
    assert tokens["high one"] == [s.token_ids for s in alone_pair.samples]
    assert tokens["low one"] == [alone["low one"].token_ids] and tokens["low two"] == [alone["low two"].token_ids]
    assert len(vectors) == 1
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_a_request_whose_grammar_compiles_takes_its_rank_when_compiled(tiny_llama: Path) -> None:
    async with Engine.open(
        tiny_llama, device="cpu", kv_cache_blocks=64, scheduling_policy="priority", max_num_seqs=1
    ) as engine:
        blocker = engine.stream("blocker", SamplingParams(max_tokens=900, ignore_eos=True), priority=1)
        await anext(blocker)
        low = engine.stream("low", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), priority=2)
        # stream() does not compile: the request waits outside the scheduler until its grammar is ready.
        constrained = SamplingParams(temperature=0.0, max_tokens=8, structured_output={"regex": "[a-z]{2,6}"})
        high = engine.stream("high", constrained, priority=0)
        assert engine.statistics().num_waiting == 2
        text = "".join(chunk.text for chunk in await drain(high))
        stats = engine.statistics()
        # It ran while the blocker, preempted, was unfinished (so before the low one, behind the blocker).
        assert (stats.num_preemptions, blocker.finished) == (1, False) and stats.num_waiting >= 1
        await blocker.aclose()
        low_chunks = await drain(low)
    assert re.fullmatch("[a-z]{2,6}", text)
    assert low_chunks[-1].finish_reason == "length"


# -- random workloads through the engine -----------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    block_size = draw(st.sampled_from([4, 16]))
    num_blocks = draw(st.integers(3, 7))
    capacity = num_blocks * block_size
    requests = []
    for _ in range(draw(st.integers(2, 6))):
        prompt_len = draw(st.integers(1, capacity - 1))
        requests.append(
            {
                "prompt_len": prompt_len,
                "max_tokens": draw(st.integers(1, capacity - prompt_len)),
                "n": draw(st.sampled_from([1, 1, 2, 3])),
                "priority": draw(st.integers(-2, 2)),
                "cancel_after": draw(st.none() | st.integers(0, 3)),
                "stop": draw(st.booleans()),
            }
        )
    return {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "async_scheduling": draw(st.booleans()),
        "prefix_caching": draw(st.booleans()),
        "max_batched": draw(st.sampled_from([block_size, 2 * block_size + 1, 2048])),
        "max_num_seqs": draw(st.integers(1, 3)),
        "requests": requests,
    }


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_random_priority_workloads_end_whole_and_free_every_block(backend: str, workload: dict[str, Any]) -> None:
    # Priorities, arrivals a checkpoint apart, n > 1, stop strings, cancellation, tiny caches (every
    # kind of preemption), async scheduling on and off: every request ends by itself with exactly its
    # script's text (or is cancelled), and every block comes back.
    async def main() -> None:
        size, blocks = workload["block_size"], workload["num_blocks"]
        runner = ScriptedRunner(b"abc", num_kv_blocks=blocks, block_size=size, max_model_len=blocks * size)
        async with Engine.open(
            runner=runner,
            tokenizer=ByteTokenizer(),
            scheduling_policy="priority",
            async_scheduling=workload["async_scheduling"],
            enable_prefix_caching=workload["prefix_caching"],
            max_num_batched_tokens=workload["max_batched"],
            max_num_seqs=workload["max_num_seqs"],
        ) as engine:
            finished: list[tuple[dict[str, Any], list[str], list[str | None]]] = []

            async def consume(spec: dict[str, Any], stream: RequestStream) -> None:
                texts, reasons = [""] * spec["n"], [None] * spec["n"]
                async with stream:
                    count = 0
                    async for chunk in stream:
                        texts[chunk.index] += chunk.text
                        if chunk.finished:
                            reasons[chunk.index] = chunk.finish_reason
                        count += 1
                        if spec["cancel_after"] is not None and count > spec["cancel_after"]:
                            return  # leaving the `async with` aborts the rest
                finished.append((spec, texts, reasons))

            with anyio.fail_after(30):
                async with anyio.create_task_group() as group:
                    for spec in workload["requests"]:
                        stop = ("ca",) if spec["stop"] else ()
                        params = SamplingParams(n=spec["n"], max_tokens=spec["max_tokens"], ignore_eos=True, stop=stop)
                        stream = engine.stream("p" * spec["prompt_len"], params, priority=spec["priority"])
                        group.start_soon(consume, spec, stream)
                        await anyio.lowlevel.checkpoint()
                await engine.generate("z", SamplingParams(max_tokens=1, ignore_eos=True))  # aborts applied
            stats = engine.statistics()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.kv_blocks_free == stats.kv_blocks_total
        for spec, texts, reasons in finished:
            length = 2 if spec["stop"] and spec["max_tokens"] > 3 else spec["max_tokens"]
            assert reasons == ["stop" if length < spec["max_tokens"] else "length"] * spec["n"]
            assert texts == [("abc" * length)[:length]] * spec["n"]

    anyio.run(main, backend=backend)


# -- review: a preempted request's step in flight --------------------------------------------------


async def test_a_prompt_only_request_preempted_while_its_last_chunk_runs_keeps_its_prompt_logprobs(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A max_tokens=0 request with prompt_logprobs (lm-eval's loglikelihood: HTTP echo + max_tokens 0)
    # has its one chunk in flight when a better priority takes its seat. The step computed its whole
    # prompt (its blocks are reused only by later steps): the request ends with that step's prompt
    # logprobs. Recomputing it instead lost them, as the runner sends a request's prompt logprobs once.
    prompt, scoring = "score this prompt please", SamplingParams(max_tokens=0, prompt_logprobs=1)
    engine = Engine.open(
        tiny_llama, device="cpu", kv_cache_blocks=64, scheduling_policy="priority", max_num_seqs=2,
        async_scheduling=True,
    )  # fmt: skip
    streams: dict[str, RequestStream] = {}
    schedule = Scheduler.schedule

    def submit_high_while_scored_runs(scheduler: Scheduler) -> SchedulerOutput:
        # The step loop schedules the next step while the last one runs: `scored`'s only chunk is in
        # flight when it is running with its whole prompt counted. `high` arrives exactly then.
        if "high" not in streams and any(r.prefill_only and r.num_computed_tokens for r in scheduler.running):
            streams["high"] = engine.stream("high", SamplingParams(max_tokens=3, ignore_eos=True), priority=1)
        return schedule(scheduler)

    async with engine:
        alone = await engine.generate(prompt, scoring)
        monkeypatch.setattr(Scheduler, "schedule", submit_high_while_scored_runs)
        async with engine.stream("blocker", SamplingParams(max_tokens=400, ignore_eos=True), priority=0) as blocker:
            await anext(blocker)
            chunks = await drain(engine.stream(prompt, scoring, priority=5))
            await drain(streams["high"])
        await engine.generate("z", SamplingParams(max_tokens=1))  # the blocker's abort is applied
        stats = engine.statistics()
    assert stats.num_preemptions == 1  # `high` took the seat of the scored request while its step ran
    assert chunks[-1].finish_reason == "length"
    assert alone.prompt_logprobs is not None
    assert [chunk.prompt_logprobs for chunk in chunks if chunk.prompt_logprobs is not None] == [alone.prompt_logprobs]
    assert stats.kv_blocks_free == stats.kv_blocks_total
