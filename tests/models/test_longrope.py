"""Phi-3 LongRoPE token for token against transformers across the original context (96 in the tiny model).

transformers rotates a forward by the short factors while the sequence fits the original context and
by the long ones (every position) once it is longer; when a sequence first grows past it, it drops
its cache and recomputes the whole sequence with the long factors. The engine does the same: a
request longer than the original context is computed long from its first token, and one that grows
past it is recomputed from position 0 (``Scheduler.num_long_rope_recomputes``), its blocks hashed
apart from the short ones. Prompts below, at and past the switch, generations across it: greedy
float32 tokens must equal ``generate`` in one batch, through chunked prefill, through recompute
preemption, from the prefix cache and with n > 1 samples, on the torch and cpu backends. (The rotation is the
model's, before any backend; the CUDA-graph path's flags: tests/backends/triton/test_graphs.py.)
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.testing.parity import stream_all, transformers_greedy
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

ORIGINAL = 96
"""The tiny model's ``original_max_position_embeddings``."""
PROMPT_LENGTHS = (80, 95, 96, 97, 120)  # crosses while generating (3), long from the start (2)
MAX_NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)

VARIANTS: dict[str, dict[str, Any]] = {
    "one-batch": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    # 48 blocks of 4: the first two prompts fit (20 + 24 blocks), then grow and cross: preemption.
    "preemption": {"block_size": 4, "kv_cache_blocks": 48},
    "prefix-hit": {"block_size": 4},
}


def _model_dir(cache_root: Path) -> Path:
    return tiny_model_path(cache_root, "phi3", rope_scaling="longrope")


def _prompts(vocab_size: int, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(1234)
    allowed = list(range(3, vocab_size))
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


def _recomputes(engine: Engine) -> int:
    assert engine._core is not None
    return engine._core.scheduler.num_long_rope_recomputes


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
async def test_greedy_across_the_original_context_matches_transformers(
    tiny_cache: Path, variant: str, backend: str
) -> None:
    model_dir = _model_dir(tiny_cache)
    options = {"attention_backend": backend, "enable_prefix_caching": variant == "prefix-hit", **VARIANTS[variant]}
    async with Engine.open(model_dir, device="cpu", **options) as engine:
        assert engine._info is not None and engine._info.long_rope_length == ORIGINAL
        prompts = _prompts(engine._info.vocab_size)
        got = await stream_all(engine, prompts, GREEDY)
        if variant == "prefix-hit":  # again: short prompts hit the short blocks, long ones the long blocks
            hits_before = engine.statistics().prefix_cache_hits
            got = await stream_all(engine, prompts, GREEDY)
            assert engine.statistics().prefix_cache_hits > hits_before
        stats, recomputes = engine.statistics(), _recomputes(engine)
    assert got == transformers_greedy(model_dir, tuple(map(tuple, prompts)), MAX_NEW_TOKENS)
    # The three prompts within the original context cross it while generating (unless preempted
    # past it first: then they come back long).
    assert 0 < recomputes <= 3 * (2 if variant == "prefix-hit" else 1)
    assert stats.kv_blocks_free == stats.kv_blocks_total
    if variant == "preemption":
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("backend", ["torch", "cpu"])
async def test_samples_across_the_original_context_match_transformers(tiny_cache: Path, backend: str) -> None:
    # The first sample crosses the switch and is recomputed long; the others, admitted short, must not
    # share its (long) blocks, and cross on their own.
    model_dir = _model_dir(tiny_cache)
    async with Engine.open(model_dir, device="cpu", attention_backend=backend, block_size=4) as engine:
        assert engine._info is not None
        (prompt,) = _prompts(engine._info.vocab_size, (90,))
        result = await engine.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=16))
        stats = engine.statistics()
    expected = transformers_greedy(model_dir, (tuple(prompt),), 16)[0]
    assert [list(s.token_ids) for s in result.samples] == [expected] * 3
    assert stats.kv_blocks_free == stats.kv_blocks_total
