"""Async scheduling (one step of lookahead) changes when work happens, never what comes out."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def model(tiny_cache: Path) -> Path:
    return tiny_model_path(tiny_cache, "mistral")  # varied greedy continuations


def _workload() -> list[tuple[list[int], SamplingParams]]:
    prompts = [[(13 * i * j + 7 * j + i) % 480 + 3 for j in range(5 + 9 * i)] for i in range(10)]
    work: list[tuple[list[int], SamplingParams]] = []
    for i, prompt in enumerate(prompts[:5]):
        work.append((prompt, SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True)))
    for i, prompt in enumerate(prompts[5:8]):
        work.append((prompt, SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=20, ignore_eos=True)))
    # A stop token id taken from the greedy run's own output, so it really fires mid-way.
    work.append((prompts[8], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)))
    work.append((prompts[9], SamplingParams(n=3, temperature=0.7, seed=7, max_tokens=12, ignore_eos=True)))
    return work


async def _run(model: Path, async_scheduling: bool, stop_id: int | None) -> tuple[list[object], object, int]:
    work = _workload()
    if stop_id is not None:
        prompt = work[8][0]
        work[8] = (prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop_id,)))
    results: list[object] = [None] * (len(work) + 1)
    async with Engine.open(
        model, device="cpu", block_size=4, kv_cache_blocks=80, max_num_batched_tokens=48,
        async_scheduling=async_scheduling,
    ) as engine:  # fmt: skip

        async def one(index: int) -> None:
            completion = await engine.generate(*work[index])
            results[index] = [(s.token_ids, s.finish_reason) for s in completion.samples]

        async def aborted() -> None:
            received: list[int] = []
            async for chunk in engine.stream(work[0][0], SamplingParams(temperature=0.0, max_tokens=200)):
                received.extend(chunk.token_ids)
                if len(received) >= 5:
                    break
            results[-1] = received[:5]

        async with anyio.create_task_group() as tg:
            for index in range(len(work)):
                tg.start_soon(one, index)
            tg.start_soon(aborted)
        await engine.generate("barrier", SamplingParams(max_tokens=1))
        stats = engine.statistics()
        filled = engine._core._lookahead.num_filled if engine._core else 0
    return results, stats, filled


async def test_outputs_are_identical_with_and_without_async_scheduling(model: Path) -> None:
    plain, _, _ = await _run(model, False, None)
    stop_id = plain[8][0][0][10]  # type: ignore[index]
    sync, sync_stats, sync_filled = await _run(model, False, stop_id)
    ahead, ahead_stats, ahead_filled = await _run(model, True, stop_id)
    assert ahead == sync
    assert sync[8][0][1] == "stop"  # type: ignore[index]
    assert sync_filled == 0
    assert ahead_filled > 0  # steps really were scheduled ahead of their predecessors' results
    for stats in (sync_stats, ahead_stats):
        assert stats.kv_blocks_free == stats.kv_blocks_total  # type: ignore[attr-defined]
        assert stats.num_preemptions > 0  # type: ignore[attr-defined]


async def test_loop_and_device_times_are_reported(model: Path) -> None:
    async with Engine.open(model, device="cpu") as engine:
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=16, ignore_eos=True))
        stats = engine.statistics()
    assert stats.device_busy > 0
    assert stats.time_schedule > 0 and stats.time_prepare > 0 and stats.time_output > 0
    assert stats.device_idle >= 0
    # the torch runner splits its steps' time; the parts fit inside the device thread's busy time
    parts = (stats.device_prepare, stats.device_forward, stats.device_sample)
    assert all(part > 0 for part in parts)
    assert sum(parts) <= stats.device_busy
    assert stats.device_forward > stats.device_prepare  # a real forward outweighs building its inputs


async def test_device_idle_counts_the_current_wait(model: Path) -> None:
    async with Engine.open(model, device="cpu") as engine:
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        # Idle now: each snapshot counts the wait so far, so a later one never reports less.
        first = engine.statistics().device_idle
        await anyio.lowlevel.checkpoint()
        second = engine.statistics().device_idle
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        third = engine.statistics().device_idle
    assert 0 < first <= second <= third
