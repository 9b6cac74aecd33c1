"""Phi-3, Granite, OLMo 2 and the scaled ropes (llama3, YaRN, LongRoPE) token for token against transformers.

Each tiny model carries its family's quirks (see ``asyncllm.testing.tiny_models``); greedy float32
tokens must equal transformers' ``generate`` on the same weights, on the torch and cpu attention
backends, in one batch, through chunked prefill, through recompute preemption, and on a second
pass served from the prefix cache.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncllm import Engine, SamplingParams
from asyncllm.models import SUPPORTED_ARCHITECTURES, build_model
from asyncllm.testing.parity import stream_all, transformers_greedy
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

PROMPT_LENGTHS = (1, 3, 7, 12, 20, 33, 48, 70)
MAX_NEW_TOKENS = 16

# name -> (family, build_tiny_model arguments)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-rope-yarn": ("llama", {"rope_scaling": "yarn"}),
    "qwen2-rope-yarn": ("qwen2", {"rope_scaling": "yarn"}),
    "qwen3-rope-yarn": ("qwen3", {"rope_scaling": "yarn"}),
    "phi3-partial-rotary": ("phi3", {}),
    # Within LongRoPE's original context (96): short factors and the attention factor (across it:
    # test_longrope.py).
    "phi3-longrope": ("phi3", {"rope_scaling": "longrope"}),
    "granite": ("granite", {}),
    "olmo2": ("olmo2", {}),
    # Mixture of Experts (their routing and expert tests: test_moe.py).
    "qwen3-moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
}

VARIANTS: dict[str, dict[str, Any]] = {
    "one-batch": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "preemption": {"block_size": 4, "kv_cache_blocks": 32, "max_model_len": 128},
    "prefix-hit": {"block_size": 4},
}


@cache
def _model_dir(cache_root: str, name: str) -> Path:
    family, kwargs = MODELS[name]
    return tiny_model_path(cache_root, family, **kwargs)


def _prompts(vocab_size: int, eos_ids: set[int]) -> list[list[int]]:
    rng = random.Random(1234)
    allowed = [t for t in range(3, vocab_size) if t not in eos_ids]
    return [[rng.choice(allowed) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("attention_backend", ["torch", "cpu"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(MODELS))
async def test_greedy_matches_transformers(tiny_cache: Path, name: str, variant: str, attention_backend: str) -> None:
    model_dir = _model_dir(str(tiny_cache), name)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    async with Engine.open(model_dir, device="cpu", attention_backend=attention_backend, **VARIANTS[variant]) as engine:
        assert engine._info is not None
        prompts = _prompts(engine._info.vocab_size, set(engine._info.eos_token_ids))
        expected = transformers_greedy(model_dir, tuple(map(tuple, prompts)), MAX_NEW_TOKENS)
        got = await stream_all(engine, prompts, params)
        if variant == "prefix-hit":
            hits_before = engine.statistics().prefix_cache_hits
            got = await stream_all(engine, prompts, params)  # the same prompts: their blocks are cached
            assert engine.statistics().prefix_cache_hits > hits_before
        stats = engine.statistics()
    assert got == expected
    assert stats.kv_blocks_free == stats.kv_blocks_total
    if variant == "preemption":
        assert stats.num_preemptions > 0
    if variant == "chunked-prefill":
        assert stats.num_steps > MAX_NEW_TOKENS + sum(PROMPT_LENGTHS) // 16


@pytest.mark.parametrize("architecture", ["Phi3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM"])
def test_families_are_supported(architecture: str) -> None:
    assert architecture in SUPPORTED_ARCHITECTURES


def test_granite_and_olmo2_leave_the_llama_fast_paths(tiny_cache: Path) -> None:
    # The fused-norm path, the cpu lean forward and the greedy head assume a Llama layer.
    from transformers import AutoConfig

    for name, llama_layer in (
        ("granite", False),
        ("olmo2", False),
        ("phi3-partial-rotary", False),
        ("qwen3-rope-yarn", True),
    ):
        with torch.device("meta"):
            model = build_model(AutoConfig.from_pretrained(_model_dir(str(tiny_cache), name)))
        assert model.spec.llama_layer is llama_layer, name


def test_dynamic_rope_is_refused() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64, vocab_size=300,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="dynamic"):
        build_model(config)


def test_longrope_rotates_past_the_original_context_as_transformers(tiny_cache: Path) -> None:
    # transformers rotates a whole forward by the long factors when it reaches past the original
    # context (its largest position + 1 exceeds it), by the short ones otherwise; asyncllm is told
    # per token whether its sequence is that long, and rotates exactly as transformers then.
    from transformers import AutoConfig

    from asyncllm.models._rotary import RotaryEmbedding

    model_dir = _model_dir(str(tiny_cache), "phi3-longrope")
    with torch.device("meta"):
        spec = build_model(AutoConfig.from_pretrained(model_dir)).spec
    ours = RotaryEmbedding.of(spec)
    assert ours.settings.long_inv_freq is not None and ours.settings.attention_scaling > 1.0
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).model.rotary_emb
    original = ours.settings.long_from_position
    for positions in (
        torch.arange(original),
        torch.arange(original + 5),
        torch.tensor([original - 1]),
        torch.tensor([original]),
        torch.tensor([3, original + 7]),
    ):
        expected_cos, expected_sin = reference(torch.zeros(1), positions[None])
        long = torch.full(positions.shape, bool(positions.max() + 1 > original))
        cos, sin = ours.cos_sin(positions, torch.float32, long)
        assert torch.equal(cos, expected_cos[0]) and torch.equal(sin, expected_sin[0])
    # No flag: the short factors (a sequence within the original context), whatever the positions.
    short_cos, _ = ours.cos_sin(torch.arange(original + 5), torch.float32)
    assert torch.equal(short_cos[:original], ours.cos_sin(torch.arange(original), torch.float32)[0])


# The families whose layers leave the llama fast paths, on the triton kernels (in the interpreter where
# there is no GPU: tests/conftest.py sets TRITON_INTERPRET): a few short prompts through chunked prefill
# (budget 8), recompute preemption (8 blocks of 4 for 3 requests of 11, 16 and 24 tokens) and a second pass
# served from the prefix cache, in one engine.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("name", ["granite", "olmo2", "phi3-longrope", "phi3-partial-rotary"])
async def test_triton_interpreter_matches_transformers(tiny_cache: Path, name: str) -> None:
    pytest.importorskip("triton")
    model_dir = _model_dir(str(tiny_cache), name)
    options: dict[str, Any] = {"block_size": 4, "kv_cache_blocks": 8, "max_num_batched_tokens": 8}
    params = SamplingParams(temperature=0.0, max_tokens=4)
    async with Engine.open(model_dir, device="cpu", attention_backend="triton", **options) as engine:
        assert engine._info is not None and engine._core is not None
        assert engine._core.runner.attention_backend == "triton"  # type: ignore[attr-defined]
        prompts = _prompts(engine._info.vocab_size, set(engine._info.eos_token_ids))[2:5]  # 7, 12, 20 tokens
        got = await stream_all(engine, prompts, params)
        again = await stream_all(engine, prompts, params)
        stats = engine.statistics()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    expected = transformers_greedy(model_dir, tuple(map(tuple, prompts)), 4)
    assert got == expected and again == expected
