"""Gemma 2 and Gemma 3 (text) token for token against HF transformers (greedy, float32).

The tiny configs carry every quirk (``asyncllm.testing.tiny_models``): sliding and global layers
(a window of 8, shorter than most prompts), attention (gemma2) and final logit soft-caps, scaled
embeddings, GeGLU, four offset RMSNorms per layer, ``query_pre_attn_scalar``, and (gemma3) q/k norms
and a rope per layer type. Each runs one batch, chunked prefill, recompute preemption and prefix-cache
hits, on the torch and cpu attention backends; gemma3 also on triton here, and both on triton (their
sliding pool, gemma2's soft-capped kernels) in tests/models/test_hybrid_kv.py.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.models import build_model
from asyncllm.testing.parity import stream_all, transformers_greedy
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

PROMPT_LENGTHS = (1, 5, 9, 17, 30, 45)
MAX_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)

MODELS = {"gemma2": {"num_layers": 4}, "gemma3": {"num_layers": 6}}
VARIANTS = {
    "one-batch": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "preemption": {"block_size": 4, "kv_cache_blocks": 24, "max_model_len": 96},
}
BACKENDS = ("torch", "cpu")


@cache
def _model_dir(cache_root: str, family: str) -> Path:
    return tiny_model_path(cache_root, family, **MODELS[family])


def _prompts(vocab_size: int, lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    allowed = list(range(3, vocab_size))  # 0-2 are pad and the special tokens (eos among them)
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


def test_specs_carry_the_quirks(tiny_cache: Path) -> None:
    from transformers import AutoConfig

    gemma2 = build_model(AutoConfig.from_pretrained(_model_dir(str(tiny_cache), "gemma2"))).spec
    assert gemma2.layer_sliding == (True, False, True, False) and gemma2.sliding_window == 8
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.query_pre_attn_scalar) == (1.5, 10.0, 24.0)
    assert gemma2.embed_scale == 8.0 and gemma2.norm_offset and gemma2.sandwich_norms and not gemma2.llama_layer
    assert not gemma2.tie_word_embeddings  # see tiny_models: tied, the tiny model would mostly echo its input
    gemma3 = build_model(AutoConfig.from_pretrained(_model_dir(str(tiny_cache), "gemma3"))).spec
    assert gemma3.layer_sliding == (True,) * 5 + (False,) and gemma3.qk_norm and gemma3.attn_softcap is None
    assert gemma3.rope["rope_type"] == "linear" and gemma3.local_rope == {"rope_theta": 10000.0, "rope_type": "default"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("family", sorted(MODELS))
async def test_greedy_matches_transformers(tiny_cache: Path, family: str, variant: str, backend: str) -> None:
    model_dir = _model_dir(str(tiny_cache), family)
    options = {"attention_backend": backend, "enable_prefix_caching": False, **VARIANTS[variant]}
    async with Engine.open(model_dir, device="cpu", **options) as engine:
        assert engine._info is not None
        prompts = _prompts(engine._info.vocab_size)
        got = await stream_all(engine, prompts, GREEDY)
        stats = engine.statistics()
    assert got == transformers_greedy(model_dir, tuple(map(tuple, prompts)), MAX_NEW_TOKENS)
    assert stats.kv_blocks_free == stats.kv_blocks_total
    if variant == "preemption":
        assert stats.num_preemptions > 0
    if variant == "chunked-prefill":
        assert stats.num_steps > MAX_NEW_TOKENS + sum(PROMPT_LENGTHS) // 16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(MODELS))
async def test_prefix_cache_hits_match_transformers(tiny_cache: Path, family: str, backend: str) -> None:
    # A first round caches long prompts; the second shares their first 24-36 tokens (several blocks,
    # far more than the window of 8), so sliding and global layers both read cached blocks.
    model_dir = _model_dir(str(tiny_cache), family)
    async with Engine.open(model_dir, device="cpu", attention_backend=backend, block_size=4) as engine:
        assert engine._info is not None
        first = _prompts(engine._info.vocab_size, (40, 44))
        tails = _prompts(engine._info.vocab_size, (3, 7), seed=99)
        second = [first[0][:24] + tails[0], first[1][:36] + tails[1]]
        got_first = await stream_all(engine, first, GREEDY)
        got_second = await stream_all(engine, second, GREEDY)
        stats = engine.statistics()
    assert stats.prefix_cache_hits >= 24 + 36 - 8  # full blocks only
    assert got_first == transformers_greedy(model_dir, tuple(map(tuple, first)), MAX_NEW_TOKENS)
    assert got_second == transformers_greedy(model_dir, tuple(map(tuple, second)), MAX_NEW_TOKENS)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the interpreter is slow: one loop, one short case
async def test_gemma3_triton_interpreter_matches_transformers(tiny_cache: Path) -> None:
    # gemma3's sliding and global layers through the Triton kernels (a window cleared per global layer);
    # TRITON_INTERPRET is set by tests/conftest.py where there is no GPU.
    pytest.importorskip("triton")
    model_dir = _model_dir(str(tiny_cache), "gemma3")
    async with Engine.open(
        model_dir, device="cpu", attention_backend="triton", max_num_batched_tokens=16, enable_prefix_caching=False
    ) as engine:
        assert engine._info is not None
        prompts = _prompts(engine._info.vocab_size, (5, 20))
        got = await stream_all(engine, prompts, GREEDY)
    assert got == transformers_greedy(model_dir, tuple(map(tuple, prompts)), MAX_NEW_TOKENS)
