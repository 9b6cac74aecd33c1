"""Sliding-window models token for token against transformers, with the blocks that leave the window freed.

A tiny Mistral (every layer slides, window 24) and a tiny Gemma 3 whose five layers all slide (window
20) free the KV blocks that leave the window (``RunnerInfo.sliding_window``); a tiny Qwen2 that slides
only on its second layer (``layer_types``) keeps every block of its global layer and frees its sliding
layer's in a pool of their own (``RunnerInfo.sliding_group``; tests/models/test_hybrid_kv.py). Prompts
and generations run well past the window, with blocks of 16: greedy float32 tokens must equal
transformers' ``generate`` in one batch, through chunked prefill across the window's edge, through
recompute preemption, and from the prefix cache (a second round sharing prefixes far longer than the
window, and n > 1 samples), on the torch and cpu backends (and triton's interpreter for one case). A
long generation holds a bounded number of blocks, and every block is back in the pool at the end.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.testing.parity import stream_all, transformers_greedy
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

BLOCK = 16
PROMPT_LENGTHS = (5, 40, 70)
MAX_NEW_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)

# name -> (family, build arguments, the window the KV cache frees by, or None)
MODELS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    "mistral": ("mistral", {"sliding_window": 24}, 24),
    "gemma3-all-sliding": ("gemma3", {"num_layers": 5, "sliding_window": 20}, 20),
    "qwen2-hybrid": ("qwen2", {"sliding_window": 16}, None),
}

# name -> (engine options, prompt lengths)
VARIANTS: dict[str, tuple[dict[str, Any], tuple[int, ...]]] = {
    "one-batch": ({}, PROMPT_LENGTHS),
    "chunked-prefill": ({"max_num_batched_tokens": 16}, PROMPT_LENGTHS),
    # Four prompts of two blocks fill the 8 blocks; each needs a third block within a few steps.
    "preemption": ({"kv_cache_blocks": 8}, (20, 24, 28, 30)),
}


@cache
def _model_dir(cache_root: str, name: str) -> Path:
    family, kwargs, _ = MODELS[name]
    return tiny_model_path(cache_root, family, **kwargs)


def _prompts(vocab_size: int, lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    allowed = list(range(3, vocab_size))  # 0-2: pad and the special tokens (eos among them)
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


def _expected(model_dir: Path, prompts: list[list[int]], max_new_tokens: int = MAX_NEW_TOKENS) -> list[list[int]]:
    return transformers_greedy(model_dir, tuple(map(tuple, prompts)), max_new_tokens)


def _freed(engine: Engine) -> int:
    assert engine._core is not None
    return engine._core.scheduler.kv_cache.num_window_freed_blocks


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(MODELS))
async def test_greedy_matches_transformers(tiny_cache: Path, name: str, variant: str, backend: str) -> None:
    model_dir = _model_dir(str(tiny_cache), name)
    window = MODELS[name][2]
    variant_options, lengths = VARIANTS[variant]
    options = {"attention_backend": backend, "block_size": BLOCK, "enable_prefix_caching": False, **variant_options}
    async with Engine.open(model_dir, device="cpu", **options) as engine:
        assert engine._info is not None and engine._info.sliding_window == window
        prompts = _prompts(engine._info.vocab_size, lengths)
        got = await stream_all(engine, prompts, GREEDY)
        stats, freed = engine.statistics(), _freed(engine)
    assert got == _expected(model_dir, prompts)
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert (freed > 0) == (window is not None)
    assert (engine._info.sliding_group is not None) == (window is None)  # qwen2-hybrid: a sliding group
    if variant == "preemption":
        assert stats.num_preemptions > 0
    if variant == "chunked-prefill":
        assert stats.num_steps >= MAX_NEW_TOKENS + max(PROMPT_LENGTHS) // 16  # the longest prompt in chunks


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", ["mistral", "gemma3-all-sliding"])
async def test_prefix_hits_longer_than_the_window_match_transformers(tiny_cache: Path, name: str, backend: str) -> None:
    # The first round's blocks leave the window and go back to the pool, still cached. The second
    # round shares 64 and 96 tokens of them (four and six blocks, several windows) and takes only
    # the blocks within the window of its first token to compute; the n=2 request shares its prompt.
    model_dir = _model_dir(str(tiny_cache), name)
    async with Engine.open(model_dir, device="cpu", attention_backend=backend, block_size=BLOCK) as engine:
        assert engine._info is not None
        first = _prompts(engine._info.vocab_size, (100, 110))
        tails = _prompts(engine._info.vocab_size, (3, 9), seed=99)
        second = [first[0][:64] + tails[0], first[1][:96] + tails[1]]
        got_first = await stream_all(engine, first, GREEDY)
        hits_before = engine.statistics().prefix_cache_hits
        got_second = await stream_all(engine, second, GREEDY)
        hits = engine.statistics().prefix_cache_hits - hits_before
        samples = await engine.generate(second[1], SamplingParams(n=2, temperature=0.0, max_tokens=24))
        stats = engine.statistics()
    assert hits >= 64 + 96
    assert got_first == _expected(model_dir, first)
    assert got_second == _expected(model_dir, second)
    assert [list(s.token_ids) for s in samples.samples] == [got_second[1][:24]] * 2
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("backend", ["torch", "cpu"])
async def test_a_long_generation_holds_a_bounded_number_of_blocks(tiny_cache: Path, backend: str) -> None:
    # 40 + 200 tokens would fill 15 blocks of 16; with a window of 24, a request holds the blocks of
    # its window (at most ceil(24 / 16) + 1 of them), plus one the step in flight may still read.
    model_dir = _model_dir(str(tiny_cache), "mistral")
    window, max_tokens = 24, 200
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    async with Engine.open(model_dir, device="cpu", attention_backend=backend, block_size=BLOCK) as engine:
        assert engine._info is not None
        (prompt,) = _prompts(engine._info.vocab_size, (40,))
        total = engine.statistics().kv_blocks_total
        held: list[int] = []
        tokens: list[int] = []
        async with engine.stream(prompt, params) as stream:
            async for chunk in stream:
                tokens.extend(chunk.token_ids)
                held.append(total - engine.statistics().kv_blocks_free)
        stats = engine.statistics()
    assert tokens == _expected(model_dir, [prompt], max_tokens)[0]
    assert max(held) <= -(-window // BLOCK) + 2 < -(-(40 + max_tokens) // BLOCK)
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the interpreter is slow: one loop, one short case
async def test_triton_interpreter_matches_transformers(tiny_cache: Path) -> None:
    # The kernels never load the positions before a window's start (their blocks may be back in the
    # pool, their table entries zeroed); chunked prefill across the window's edge, blocks freed.
    pytest.importorskip("triton")
    model_dir = _model_dir(str(tiny_cache), "mistral")
    params = SamplingParams(temperature=0.0, max_tokens=20)
    async with Engine.open(
        model_dir, device="cpu", attention_backend="triton", block_size=BLOCK, max_num_batched_tokens=16
    ) as engine:
        assert engine._info is not None
        prompts = _prompts(engine._info.vocab_size, (5, 44))
        got = await stream_all(engine, prompts, params)
        freed = _freed(engine)
    assert got == _expected(model_dir, prompts, 20)
    assert freed > 0


def test_qwen2_slides_only_where_layer_types_say(tiny_cache: Path) -> None:
    from transformers import AutoConfig

    from asyncllm.models import build_model

    spec = build_model(AutoConfig.from_pretrained(_model_dir(str(tiny_cache), "qwen2-hybrid"))).spec
    assert spec.sliding_window == 16 and spec.layer_sliding == (False, True)
    assert spec.uniform_sliding_window is None
    mistral = build_model(AutoConfig.from_pretrained(_model_dir(str(tiny_cache), "mistral"))).spec
    assert mistral.layer_sliding is None and mistral.uniform_sliding_window == 24
