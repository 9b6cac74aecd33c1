"""Logprobs and prompt logprobs equal ``log_softmax`` of transformers' logits on the same weights.

They come from the raw logits, before penalties, biases and temperature (as vLLM returns them), so
a request that uses all of those must still match the plain model.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncllm import Completion, Engine, Logprobs, SamplingParams

pytestmark = pytest.mark.anyio

TOLERANCE = 1e-3
PROMPT = "Once upon a time there was a small town at the edge of a large forest, and the people"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # these tests are about numbers; the engine runs on both backends elsewhere


@pytest.fixture(scope="module")
def hf_model(tiny_llama: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.eval()
    return model


def _hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the distribution of the token after ids[: i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check(entry: Logprobs, reference: torch.Tensor, token_id: int, num_top: int) -> None:
    assert entry.token.token_id == token_id
    assert entry.token.logprob == pytest.approx(reference[token_id].item(), abs=TOLERANCE)
    assert entry.token.rank == int((reference > reference[token_id] + TOLERANCE).sum()) + 1
    values, ids = reference.topk(num_top)
    assert [t.token_id for t in entry.top] == ids.tolist()
    assert [t.rank for t in entry.top] == list(range(1, num_top + 1))
    for top, value in zip(entry.top, values.tolist()):
        assert top.logprob == pytest.approx(value, abs=TOLERANCE)


async def test_logprobs_are_the_raw_model_distribution(tiny_llama: Path, hf_model: torch.nn.Module) -> None:
    # Penalties, a bias and temperature shape the draw but not the returned logprobs.
    params = SamplingParams(
        temperature=0.7,
        seed=3,
        max_tokens=20,
        ignore_eos=True,
        repetition_penalty=1.4,
        frequency_penalty=0.5,
        logit_bias={40: 3.0},
        logprobs=5,
    )
    async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=64) as engine:
        completion = await engine.generate(PROMPT, params)
        tokenizer = engine.tokenizer
    prompt = list(completion.prompt_token_ids)
    output = list(completion.token_ids)
    reference = _hf_logprobs(hf_model, prompt + output)
    assert completion.logprobs is not None and len(completion.logprobs) == len(output) == 20
    assert completion.prompt_logprobs is None
    for i, entry in enumerate(completion.logprobs):
        _check(entry, reference[len(prompt) - 1 + i], output[i], 5)
        assert entry.token.text == tokenizer.decode([output[i]], skip_special_tokens=False)
    assert any(entry.token.rank > 1 for entry in completion.logprobs)  # it sampled, not only argmax


async def test_prompt_logprobs_across_prefill_chunks(tiny_llama: Path, hf_model: torch.nn.Module) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3, logprobs=0)
    # A 16-token budget prefills the prompt in several chunks.
    async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=64, max_num_batched_tokens=16) as engine:
        chunks = [chunk async for chunk in engine.stream(PROMPT, params)]
        completion = await engine.generate(PROMPT, params)
    prompt = list(completion.prompt_token_ids)
    assert len(prompt) > 40
    assert completion.prompt_logprobs is not None and len(completion.prompt_logprobs) == len(prompt)
    assert completion.prompt_logprobs[0] is None  # nothing predicts the first token
    reference = _hf_logprobs(hf_model, prompt + list(completion.token_ids))
    for i, entry in enumerate(completion.prompt_logprobs[1:], start=1):
        assert entry is not None
        _check(entry, reference[i - 1], prompt[i], 3)
    # logprobs=0: the chosen token only.
    assert completion.logprobs is not None
    assert [len(entry.top) for entry in completion.logprobs] == [0, 0, 0]
    # Streamed: the prompt logprobs ride on the first chunk only; logprobs align with token_ids.
    assert chunks[0].prompt_logprobs == completion.prompt_logprobs
    assert all(chunk.prompt_logprobs is None for chunk in chunks[1:])
    for chunk in chunks:
        assert chunk.logprobs is not None and len(chunk.logprobs) == len(chunk.token_ids)


async def test_requests_with_and_without_logprobs_share_a_batch(tiny_llama: Path) -> None:
    variants = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=7, prompt_logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0),
    ]
    prompts = ["alpha beta", "gamma delta epsilon", "the end.", "hello, world! this is a test"]
    async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=64) as engine:
        alone = [await engine.generate(p, v) for p, v in zip(prompts, variants)]
        together: dict[int, Completion] = {}
        async with anyio.create_task_group() as tg:

            async def run(i: int) -> None:
                together[i] = await engine.generate(prompts[i], variants[i])

            for i in range(len(variants)):
                tg.start_soon(run, i)
    for i, completion in enumerate(alone):
        batched = together[i]
        assert batched.token_ids == completion.token_ids
        assert (batched.logprobs is None) == (variants[i].logprobs is None)
        assert (batched.prompt_logprobs is None) == (variants[i].prompt_logprobs is None)
        if completion.logprobs is not None:
            assert batched.logprobs is not None
            assert [e.token.token_id for e in batched.logprobs] == list(completion.token_ids)
            assert [len(e.top) for e in batched.logprobs] == [variants[i].logprobs] * 12
            for a, b in zip(batched.logprobs, completion.logprobs):
                assert a.token.logprob == pytest.approx(b.token.logprob, abs=TOLERANCE)
        if completion.prompt_logprobs is not None:
            assert batched.prompt_logprobs is not None
            assert len(batched.prompt_logprobs) == len(completion.prompt_token_ids)
