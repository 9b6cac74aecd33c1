"""n > 1: one prompt, n samples; the prompt's full blocks are computed once and shared by reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncllm import Engine, InvalidSamplingParamsError, SamplingParams
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

# 38 tokens: 9 full blocks of 4 are shared, 2 tokens are computed per sample.
PROMPT = [(7 * i * i + 3 * i + 11) % 480 + 3 for i in range(38)]


@pytest.fixture(scope="module")
def model(tiny_cache: Path) -> Path:
    # The tiny mistral's greedy continuations vary from token to token, so a wrong shared block shows.
    return tiny_model_path(tiny_cache, "mistral")


def _open(model: Path, **options: object) -> Engine:
    return Engine.open(model, device="cpu", block_size=4, kv_cache_blocks=128, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefix_caching", [True, False])
async def test_prompt_is_computed_once_and_greedy_samples_agree(model: Path, prefix_caching: bool) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    async with _open(model, enable_prefix_caching=prefix_caching) as engine:
        single = await engine.generate(PROMPT, greedy)
        engine.reset_prefix_cache()
        before = engine.statistics().num_prompt_tokens
        several = await engine.generate(PROMPT, SamplingParams(n=4, temperature=0.0, max_tokens=10, ignore_eos=True))
        forwarded = engine.statistics().num_prompt_tokens - before
        stats = engine.statistics()
    assert forwarded == len(PROMPT) + 3 * (len(PROMPT) - 36)
    assert [s.index for s in several.samples] == [0, 1, 2, 3]
    # Shared blocks hold the right KV: every greedy sample continues exactly like the single run.
    assert all(s.token_ids == single.token_ids for s in several.samples)
    assert several.token_ids == single.token_ids
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_samples_differ_and_each_is_reproducible_with_a_seed(model: Path) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    async with _open(model) as engine:
        first = await engine.generate(PROMPT, params)
        again = await engine.generate(PROMPT, params)
        single = await engine.generate(PROMPT, SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True))
    token_ids = [s.token_ids for s in first.samples]
    assert len(set(token_ids)) == 4
    assert token_ids == [s.token_ids for s in again.samples]
    assert first.samples[0].token_ids == single.token_ids  # sample 0 uses the seed itself
    assert all(len(t) == 12 for t in token_ids)


async def test_stream_tags_chunks_by_index_and_matches_generate(model: Path) -> None:
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=9, ignore_eos=True)
    async with _open(model) as engine:
        texts = ["", "", ""]
        finished = [0, 0, 0]
        async with engine.stream(PROMPT, params) as stream:
            assert stream.num_samples == 3
            async for chunk in stream:
                texts[chunk.index] += chunk.text
                finished[chunk.index] += chunk.finished
        completion = await engine.generate(PROMPT, params)
    assert finished == [1, 1, 1]
    assert texts == [s.text for s in completion.samples]


async def test_aborting_the_stream_ends_every_sample(model: Path) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_tokens=200, ignore_eos=True)
    async with _open(model) as engine:
        seen: set[int] = set()
        async for chunk in engine.stream(PROMPT, params):
            seen.add(chunk.index)
            if len(seen) == 4:
                break
        await engine.generate("barrier", SamplingParams(max_tokens=1))
        stats = engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_running == stats.num_waiting == 0


def test_n_is_validated() -> None:
    with pytest.raises(InvalidSamplingParamsError, match="n must be"):
        SamplingParams(n=0)
    with pytest.raises(InvalidSamplingParamsError, match="n must be <= 64"):
        SamplingParams(n=65)


async def test_http_completions_return_n_choices(model: Path) -> None:
    import httpx

    from asyncllm.http import create_app
    async with _open(model) as engine:
        app = create_app(engine)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            response = await http.post(
                "/v1/completions",
                json={"prompt": PROMPT, "n": 3, "max_tokens": 5, "temperature": 1.0, "seed": 3, "ignore_eos": True},
            )
        stats = engine.statistics()
    assert response.status_code == 200, response.text
    body = response.json()
    assert sorted(choice["index"] for choice in body["choices"]) == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 15
    assert stats.kv_blocks_free == stats.kv_blocks_total
