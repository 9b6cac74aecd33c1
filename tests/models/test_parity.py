"""The model path is proven token for token against HF transformers on the same weights."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncllm import Engine, SamplingParams
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

PROMPT_LENGTHS = (1, 3, 7, 12, 20, 33, 48, 70)
MAX_NEW_TOKENS = 16

MODELS = {
    "llama": {},
    "llama-rope-llama3": {"rope_scaling": "llama3"},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
}

# Each variant runs the same 8 prompts in one batch; the last two force chunked prefill and
# recompute preemption, which must not change a single token.
VARIANTS = {
    "one-batch": {},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    "preemption": {"block_size": 4, "kv_cache_blocks": 32, "max_model_len": 128},
}


@cache
def _model_dir(cache_root: str, name: str) -> Path:
    family = name.split("-")[0]
    return tiny_model_path(cache_root, family, **MODELS[name])


def _prompts(vocab_size: int, eos_ids: set[int]) -> list[list[int]]:
    rng = random.Random(1234)
    allowed = [t for t in range(3, vocab_size) if t not in eos_ids]
    return [[rng.choice(allowed) for _ in range(n)] for n in PROMPT_LENGTHS]


@cache
def _hf_greedy(model_dir: Path, prompts: tuple[tuple[int, ...], ...], max_new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


async def _generate_all(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    # Every request is added, in prompt order, before any is consumed: the scheduler sees the same
    # arrival order on asyncio and on trio (which runs ready tasks in a random order), so the
    # preemption variant's cache really overflows on both instead of only for some orders.
    streams = [engine.stream(prompt, params) for prompt in prompts]
    results: list[list[int]] = [[] for _ in prompts]

    async def consume(index: int) -> None:
        async with streams[index] as stream:
            async for chunk in stream:
                results[index].extend(chunk.token_ids)

    async with anyio.create_task_group() as tg:
        for index in range(len(prompts)):
            tg.start_soon(consume, index)
    return results


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", sorted(MODELS))
async def test_greedy_matches_transformers(tiny_cache: Path, name: str, variant: str) -> None:
    model_dir = _model_dir(str(tiny_cache), name)
    async with Engine.open(model_dir, device="cpu", **VARIANTS[variant]) as engine:
        config_eos = engine._info.eos_token_ids if engine._info else frozenset()
        prompts = _prompts(engine._info.vocab_size if engine._info else 0, set(config_eos))
        expected = _hf_greedy(model_dir, tuple(map(tuple, prompts)), MAX_NEW_TOKENS)
        got = await _generate_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
        stats = engine.statistics()
    assert got == expected
    assert stats.kv_blocks_free == stats.kv_blocks_total
    if variant == "preemption":
        assert stats.num_preemptions > 0
    if variant == "chunked-prefill":
        assert stats.num_steps > MAX_NEW_TOKENS + sum(PROMPT_LENGTHS) // 16


REAL_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three prime numbers.",
)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from asyncllm.default_model import default_model_path
    return default_model_path()


async def test_default_model_matches_transformers(smollm2_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for p in REAL_PROMPTS
    ]
    expected = _hf_greedy(smollm2_dir, tuple(map(tuple, prompts)), 32)
    async with Engine.open(device="cpu", kv_cache_blocks=256) as engine:
        got = await _generate_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=32))
        texts = [engine.tokenizer.decode(ids, skip_special_tokens=True) for ids in got]
    assert got == expected
    assert "Paris" in texts[0]
