"""Soak and teardown: many requests, random cancellations, repeated open/close; nothing leaks.

CI runs a shortened soak (200 requests). The full one (2,000 requests) runs locally with
``ASYNCLLM_SOAK_REQUESTS=2000 python -m pytest tests/engine/test_soak.py -s``; both print their figures.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import threading
import time
import weakref
from pathlib import Path

import anyio
import pytest

from asyncllm import Engine, SamplingParams

pytestmark = pytest.mark.anyio

SOAK_REQUESTS = int(os.environ.get("ASYNCLLM_SOAK_REQUESTS", "200"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _device_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asyncllm-device"]


async def _one(engine: Engine, rng: random.Random, index: int, outcome: dict[str, int]) -> None:
    prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 64))]
    max_tokens = rng.randint(1, 32)
    params = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=max_tokens, ignore_eos=True)
    cancel_how = rng.choice(["break", "scope", "timeout"]) if rng.random() < 0.3 else None
    cancel_after = rng.randint(0, max_tokens)  # chunks to read first; chunks can merge, so it may finish
    received = 0
    chunks = 0
    if cancel_how is None:
        async for chunk in engine.stream(prompt, params):
            received += len(chunk.token_ids)
        if received != max_tokens:
            outcome["wrong_length"] += 1
        outcome["completed"] += 1
        return
    with anyio.CancelScope() as scope:
        try:
            with anyio.fail_after(3600) as deadline:
                async for _ in engine.stream(prompt, params):
                    chunks += 1
                    if chunks >= cancel_after:
                        if cancel_how == "break":
                            break
                        if cancel_how == "scope":
                            scope.cancel()
                        else:
                            deadline.deadline = anyio.current_time()
                        await anyio.lowlevel.checkpoint()
        except TimeoutError:
            pass
    outcome["cancelled"] += 1


async def _soak(engine: Engine, count: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    outcome = {"completed": 0, "cancelled": 0, "wrong_length": 0}
    async with anyio.create_task_group() as tg:
        for index in range(count):
            tg.start_soon(_one, engine, random.Random(rng.random()), index, outcome)
    return outcome


async def test_soak_random_cancellations(tiny_llama: Path, anyio_backend: str) -> None:
    start = time.perf_counter()
    async with Engine.open(
        tiny_llama, device="cpu", block_size=8, kv_cache_blocks=256, max_num_seqs=64, max_num_batched_tokens=512
    ) as engine:
        first = await _soak(engine, SOAK_REQUESTS // 2, seed=1)
        gc.collect()
        rss_middle = _rss_bytes()
        second = await _soak(engine, SOAK_REQUESTS - SOAK_REQUESTS // 2, seed=2)
        await engine.generate("barrier", SamplingParams(max_tokens=1))
        gc.collect()
        rss_end = _rss_bytes()
        stats = engine.statistics()
    elapsed = time.perf_counter() - start
    total = {k: first[k] + second[k] for k in first}
    growth_mb = (rss_end - rss_middle) / 2**20
    print(
        f"\nsoak[{anyio_backend}]: {SOAK_REQUESTS} requests, {total['cancelled']} cancelled, "
        f"{total['completed']} completed in {elapsed:.1f} s; "
        f"blocks free {stats.kv_blocks_free}/{stats.kv_blocks_total}; "
        f"preemptions {stats.num_preemptions}; RSS growth over the second half {growth_mb:.1f} MiB"
    )
    assert total["completed"] + total["cancelled"] == SOAK_REQUESTS
    assert total["wrong_length"] == 0
    assert 0.15 * SOAK_REQUESTS < total["cancelled"] < 0.45 * SOAK_REQUESTS
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_running == stats.num_waiting == 0
    assert growth_mb < 64
    assert _device_threads() == []


async def test_open_close_cycles_return_memory(tiny_llama: Path) -> None:
    kv_blocks = 8192  # 64 MiB of KV for the tiny model: a leak of one engine is plain to see
    samples: list[int] = []
    kv_refs: list[weakref.ref[object]] = []
    filled_mb = released_mb = 0.0
    for cycle in range(20):
        async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=kv_blocks) as engine:
            await engine.generate("hello", SamplingParams(max_tokens=3))
            runner = engine._core.runner if engine._core else None
            kv_caches = getattr(runner, "kv_caches", [])
            kv_refs += [weakref.ref(tensor) for pair in kv_caches for tensor in pair]
            if cycle == 0:
                # Touch every KV page (CPU KV pages are mapped lazily), so closing has 64 MiB to return.
                before_fill = _rss_bytes()
                for pair in kv_caches:
                    for tensor in pair:
                        tensor.fill_(0.0)
                del pair, tensor
                held = _rss_bytes()
                filled_mb = (held - before_fill) / 2**20
            del runner, kv_caches
        gc.collect()
        samples.append(_rss_bytes())
        if cycle == 0:
            released_mb = (held - samples[0]) / 2**20
        assert _device_threads() == []
    growth_mb = (samples[-1] - samples[2]) / 2**20
    print(
        f"\nopen/close x20: RSS growth after warm-up {growth_mb:.1f} MiB; "
        f"KV touched {filled_mb:.1f} MiB, released on close {released_mb:.1f} MiB"
    )
    assert len(kv_refs) == 20 * 4 and all(ref() is None for ref in kv_refs)  # every KV tensor freed
    assert released_mb > 48  # and its memory given back to the system
    assert growth_mb < 32  # twenty cycles did not accumulate anything
