"""``SamplingParams(max_tokens=0)``: the prompt is computed (its ``prompt_logprobs`` when asked) and nothing
is generated, through the same prefill-only path as embeddings (a request that ends with its last prompt
chunk and never samples)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncllm import Engine, PromptTooLongError, SamplingParams
from asyncllm.core._request import Request
from asyncllm.core._scheduler import Scheduler
from asyncllm.core.kv._manager import KVCacheManager
from asyncllm.executor._runner import StepOutput

pytestmark = pytest.mark.anyio

PROMPT = [5, 17, 33, 2, 90, 41, 7, 63, 12, 8, 99, 100, 3, 44, 61, 19, 27]


def _open(model: Path, **options: object) -> Engine:
    return Engine.open(model, device="cpu", kv_cache_blocks=64, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_num_batched_tokens", [64, 5])  # one step, and chunked prefill
async def test_max_tokens_0_gives_the_prompt_logprobs_of_max_tokens_1(
    tiny_llama: Path, max_num_batched_tokens: int
) -> None:
    async with _open(tiny_llama, max_num_batched_tokens=max_num_batched_tokens) as engine:
        one = await engine.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3))
        zero = await engine.generate(PROMPT, SamplingParams(max_tokens=0, temperature=0.0, prompt_logprobs=3))
        chunks = [c async for c in engine.stream(PROMPT, SamplingParams(max_tokens=0, prompt_logprobs=0))]
        stats = engine.statistics()
    assert zero.token_ids == () and zero.text == "" and zero.finish_reason == "length"
    assert zero.prompt_logprobs is not None and zero.prompt_logprobs == one.prompt_logprobs
    assert len(zero.prompt_logprobs) == len(PROMPT) and zero.prompt_logprobs[0] is None
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].finish_reason == "length"
    assert chunks[0].token_ids == () and chunks[0].prompt_logprobs is not None
    assert all(e is None or e.top == () for e in chunks[0].prompt_logprobs)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == stats.num_waiting == 0


async def test_a_prompt_of_max_model_len_fits_when_nothing_is_generated(tiny_llama: Path) -> None:
    async with _open(tiny_llama, max_model_len=32, max_num_batched_tokens=16) as engine:
        prompt = (PROMPT * 2)[:32]
        done = await engine.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
        with pytest.raises(PromptTooLongError):
            await engine.generate(prompt, SamplingParams(max_tokens=1))
        with pytest.raises(PromptTooLongError):
            await engine.generate([*prompt, 1], SamplingParams(max_tokens=0))
        stats = engine.statistics()
    assert done.finish_reason == "length" and done.prompt_logprobs is not None and len(done.prompt_logprobs) == 32
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_n_samples_of_max_tokens_0_all_end_with_length(tiny_llama: Path) -> None:
    async with _open(tiny_llama, enable_prefix_caching=True) as engine:
        params = SamplingParams(max_tokens=0, n=3, prompt_logprobs=2)
        chunks = [c async for c in engine.stream(PROMPT, params)]
        again = await engine.generate(PROMPT, SamplingParams(max_tokens=0, n=2))  # no prompt_logprobs: cache hit
        stats = engine.statistics()
    assert sorted(c.index for c in chunks) == [0, 1, 2]
    assert all(c.finished and c.finish_reason == "length" and c.token_ids == () for c in chunks)
    assert sum(c.prompt_logprobs is not None for c in chunks) == 1  # reported once, with sample 0
    assert [s.finish_reason for s in again.samples] == ["length", "length"]
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_the_scheduler_ends_max_tokens_0_with_its_last_prompt_chunk_without_sampling() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=6)
    request = Request(1, list(range(10)), SamplingParams(max_tokens=0), frozenset(), max_total_tokens=10)
    scheduler.add(request)
    steps = []
    while scheduler.has_work():
        output = scheduler.schedule()
        steps.append([(s.num_new_tokens, s.sample, s.pool) for s in output.scheduled])
        events = scheduler.update(output, StepOutput([]))  # nothing sampled: no ids to return
    assert steps == [[(6, False, False)], [(4, False, True)]]
    assert [(e.new_token_ids, e.finish_reason) for e in events] == [([], "length")]
    assert request.finish_reason == "length" and kv.num_free_blocks == 16
