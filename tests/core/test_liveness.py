"""Liveness: every request ends and every KV block comes back, whatever the cache size, n, lengths,
async scheduling and cancellation (the scheduler's sample groups under preemption, the watchdog)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm import Engine, SamplingParams, SchedulerStalledError
from asyncllm.core._scheduler import Scheduler, SchedulerOutput
from asyncllm.testing import ByteTokenizer, ScriptedRunner

HANG_BOUND = 30.0
"""Seconds after which a run counts as hung (each run takes milliseconds)."""

SCRIPT = b"abc"


def _expected_text(max_tokens: int) -> str:
    return (SCRIPT.decode() * max_tokens)[:max_tokens]


async def _drain(stream: object) -> list[object]:
    return [chunk async for chunk in stream]  # type: ignore[attr-defined]


async def _settled(engine: Engine) -> None:
    # One more request through the loop: every abort asked for before it has been applied.
    await engine.generate("z", SamplingParams(max_tokens=1, ignore_eos=True))


pytestmark = pytest.mark.anyio


async def test_n_greater_than_one_survives_its_first_sample_preempted_mid_prompt() -> None:
    """The first sample is preempted while its prompt step runs, then finishes on that step's token:
    the other sample used to wait for it forever (running 0, waiting 0, /health ok)."""
    runner = ScriptedRunner(SCRIPT, num_kv_blocks=5, max_model_len=80)
    async with Engine.open(runner=runner, tokenizer=ByteTokenizer(), block_size=16) as engine:
        a = engine.stream("A" * 32, SamplingParams(max_tokens=40, ignore_eos=True))
        b = engine.stream("B" * 40, SamplingParams(n=2, max_tokens=1, ignore_eos=True))
        results: dict[str, list[object]] = {}

        async def drain(name: str, stream: object) -> None:
            results[name] = await _drain(stream)

        with anyio.fail_after(HANG_BOUND):
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain, "a", a)
                tg.start_soon(drain, "b", b)
        stats = engine.statistics()
    assert stats.num_preemptions >= 1  # the situation the test is about did arise
    assert sum(len(c.token_ids) for c in results["a"]) == 40  # type: ignore[attr-defined]
    b_finished = sorted(c.index for c in results["b"] if c.finished)  # type: ignore[attr-defined]
    assert b_finished == [0, 1]
    assert stats.kv_blocks_free == stats.kv_blocks_total


@dataclass(frozen=True)
class _Case:
    num_blocks: int
    async_scheduling: bool
    n: int
    prompt_len: int
    max_tokens: int
    other_prompt_len: int


def _sweep() -> list[_Case]:
    cases = []
    for num_blocks, async_scheduling, n, prompt_len, max_tokens, other_len in itertools.product(
        (4, 5, 6), (True, False), (2, 4), (15, 16, 17, 31, 32, 33), (1, 2, 16, 17), (16, 32)
    ):
        capacity = num_blocks * 16
        if prompt_len + max_tokens <= capacity and other_len + 8 <= capacity:
            cases.append(_Case(num_blocks, async_scheduling, n, prompt_len, max_tokens, other_len))
    return cases


async def test_sweep_over_small_caches_never_hangs() -> None:
    """Cache sizes of 4-6 blocks, lengths around block boundaries, n of 2 and 4, async scheduling on
    and off, beside a long n=1 request that fills the cache: every sample ends with all its tokens."""
    cases = _sweep()
    assert len(cases) > 250
    failures = []
    for case in cases:
        capacity = case.num_blocks * 16
        runner = ScriptedRunner(SCRIPT, num_kv_blocks=case.num_blocks, max_model_len=capacity)
        other_tokens = capacity - case.other_prompt_len
        async with Engine.open(
            runner=runner, tokenizer=ByteTokenizer(), async_scheduling=case.async_scheduling
        ) as engine:
            other = engine.stream("A" * case.other_prompt_len, SamplingParams(max_tokens=other_tokens, ignore_eos=True))
            group = engine.stream(
                "B" * case.prompt_len, SamplingParams(n=case.n, max_tokens=case.max_tokens, ignore_eos=True)
            )
            outputs: list[list[object]] = [[], []]

            async def drain(index: int, stream: object, outputs: list[list[object]] = outputs) -> None:
                outputs[index] = await _drain(stream)

            with anyio.move_on_after(HANG_BOUND) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(drain, 0, other)
                    tg.start_soon(drain, 1, group)
            if scope.cancelled_caught:
                failures.append((case, "hung"))
                continue
            texts = [""] * case.n
            for chunk in outputs[1]:
                texts[chunk.index] += chunk.text  # type: ignore[attr-defined]
            other_text = "".join(c.text for c in outputs[0])  # type: ignore[attr-defined]
            if texts != [_expected_text(case.max_tokens)] * case.n or other_text != _expected_text(other_tokens):
                failures.append((case, "wrong output"))
            stats = engine.statistics()
            if stats.kv_blocks_free != stats.kv_blocks_total or stats.num_running or stats.num_waiting:
                failures.append((case, f"leak: {stats}"))
    assert failures == [], f"{len(failures)} of {len(cases)} configurations failed: {failures[:5]}"


@dataclass(frozen=True)
class _Submitted:
    prompt_len: int
    max_tokens: int
    n: int
    cancel_after: int | None
    stop: bool


@st.composite
def _workloads(draw: st.DrawFn) -> tuple[int, int, bool, bool, int, list[_Submitted]]:
    block_size = draw(st.sampled_from([4, 16]))
    num_blocks = draw(st.integers(3, 7))
    capacity = num_blocks * block_size
    requests = []
    for _ in range(draw(st.integers(1, 5))):
        prompt_len = draw(st.integers(1, capacity - 1))
        requests.append(
            _Submitted(
                prompt_len,
                draw(st.integers(1, capacity - prompt_len)),
                draw(st.sampled_from([1, 1, 2, 3, 4])),
                draw(st.none() | st.integers(0, 4)),
                draw(st.booleans()),
            )
        )
    max_batched = draw(st.sampled_from([block_size, 2 * block_size + 1, 2048]))
    return block_size, num_blocks, draw(st.booleans()), draw(st.booleans()), max_batched, requests


def _run_workload(backend: str, workload: tuple[int, int, bool, bool, int, list[_Submitted]]) -> None:
    block_size, num_blocks, async_scheduling, prefix_caching, max_batched, submitted = workload

    async def main() -> None:
        runner = ScriptedRunner(
            SCRIPT, num_kv_blocks=num_blocks, block_size=block_size, max_model_len=num_blocks * block_size
        )
        async with Engine.open(
            runner=runner,
            tokenizer=ByteTokenizer(),
            async_scheduling=async_scheduling,
            enable_prefix_caching=prefix_caching,
            max_num_batched_tokens=max_batched,
            max_num_seqs=3,
        ) as engine:
            finished: list[tuple[_Submitted, list[str], list[str | None]]] = []

            async def consume(spec: _Submitted) -> None:
                params = SamplingParams(
                    n=spec.n, max_tokens=spec.max_tokens, ignore_eos=True, stop=("ca",) if spec.stop else ()
                )
                texts, reasons = [""] * spec.n, [None] * spec.n
                async with engine.stream("p" * spec.prompt_len, params) as stream:
                    count = 0
                    async for chunk in stream:
                        texts[chunk.index] += chunk.text
                        if chunk.finished:
                            reasons[chunk.index] = chunk.finish_reason
                        count += 1
                        if spec.cancel_after is not None and count > spec.cancel_after:
                            return  # leaving the `async with` aborts the rest
                finished.append((spec, texts, reasons))

            with anyio.fail_after(HANG_BOUND):
                async with anyio.create_task_group() as tg:
                    for spec in submitted:
                        tg.start_soon(consume, spec)
                await _settled(engine)
            stats = engine.statistics()
        assert stats.num_running == stats.num_waiting == 0
        assert stats.kv_blocks_free == stats.kv_blocks_total
        for spec, texts, reasons in finished:
            # Every sample ended by itself; none was lost or cut short by preemption.
            if spec.stop:
                assert reasons == ["stop" if spec.max_tokens > 3 else "length"] * spec.n
                assert texts == [_expected_text(2 if spec.max_tokens > 3 else spec.max_tokens)] * spec.n
            else:
                assert reasons == ["length"] * spec.n
                assert texts == [_expected_text(spec.max_tokens)] * spec.n

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=_workloads())
def test_every_request_ends_and_every_block_returns(backend: str, workload: tuple) -> None:  # type: ignore[type-arg]
    _run_workload(backend, workload)


class _StuckScheduler(Scheduler):
    """Admits nothing, as a scheduler bug might: the watchdog must fail the request, not wait forever."""

    def schedule(self) -> SchedulerOutput:
        return SchedulerOutput([])


async def test_a_stalled_scheduler_fails_the_stuck_requests_and_the_engine_keeps_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = ScriptedRunner(SCRIPT)
    async with Engine.open(runner=runner, tokenizer=ByteTokenizer()) as engine:
        core = engine._core
        assert core is not None
        healthy = core.scheduler
        stuck = _StuckScheduler(healthy.kv_cache, max_num_seqs=4, max_num_batched_tokens=64)
        core.scheduler = stuck
        with anyio.fail_after(HANG_BOUND), pytest.raises(SchedulerStalledError):
            await engine.generate("hello", SamplingParams(max_tokens=4))
        core.scheduler = healthy
        completion = await engine.generate("hello again", SamplingParams(max_tokens=4, ignore_eos=True))
        engine.check_health()
    assert completion.text == "abca"
