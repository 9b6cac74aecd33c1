"""The KV cache sized from memory: bytes or a fraction of what the weights and activations leave."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asyncllm import Engine
from asyncllm.worker._memory import (
    DEFAULT_CPU_CAP_BYTES,
    check_kv_cache_memory,
    host_available_bytes,
    peak_resident_bytes,
    reset_peak_rss,
    size_kv_cache,
)

# The tiny llama: 2 layers x (K and V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
TINY_BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4


def test_sizing_rules() -> None:
    common = {"available_bytes": 10 << 30, "activation_peak_bytes": 2 << 30, "bytes_per_block": 1 << 20}
    assert size_kv_cache(64 << 20, device_type="cpu", **common).num_blocks == 64
    assert size_kv_cache(0.5, device_type="cpu", **common).num_blocks == 4096  # half of the 8 GiB left
    assert size_kv_cache(None, device_type="cuda", **common).num_blocks == int(0.9 * 8192)
    assert size_kv_cache(None, device_type="cpu", **common).budget_bytes == min(2 << 30, DEFAULT_CPU_CAP_BYTES)
    assert size_kv_cache(0.5, device_type="cpu", max_blocks=100, **common).num_blocks == 100
    starved = {"available_bytes": 1 << 20, "activation_peak_bytes": 2 << 20, "bytes_per_block": 1 << 20}
    assert size_kv_cache(0.9, device_type="cpu", **starved).num_blocks == 1


@pytest.mark.parametrize("bad", [0, -5, 0.0, 1.5, "1GB", True])
def test_bad_kv_cache_memory_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        check_kv_cache_memory(bad)


def test_host_memory_probes() -> None:
    assert host_available_bytes() > 0
    if reset_peak_rss():
        assert peak_resident_bytes() > 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_sizes_its_cache_from_memory(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="asyncllm"):
        async with Engine.open(tiny_llama, device="cpu", kv_cache_memory=8 << 20) as engine:
            by_bytes = engine.statistics().kv_blocks_total
        async with Engine.open(tiny_llama, device="cpu", kv_cache_memory=0.0005) as engine:
            by_fraction = engine.statistics().kv_blocks_total
    assert by_bytes == (8 << 20) // TINY_BYTES_PER_BLOCK
    expected = 0.0005 * host_available_bytes() / TINY_BYTES_PER_BLOCK
    assert 0.5 * expected < by_fraction < 1.5 * expected
    assert any("max concurrency" in record.getMessage() for record in caplog.records)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        Engine.open(tiny_llama, kv_cache_memory=2.0)
