"""``Engine.embed``: pooled final hidden states, proven against HF transformers on the same weights, and
pooling requests riding the generation scheduler (chunks, mixed batches, prefix cache, cancellation)."""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from asyncllm import Engine, InvalidPromptError, InvalidRequestError, PromptTooLongError, SamplingParams
from asyncllm.core._request import Request
from asyncllm.core._scheduler import Scheduler
from asyncllm.core.kv._manager import KVCacheManager
from asyncllm.engine._pooling import pooling_defaults
from asyncllm.executor._runner import StepOutput
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

PROMPT_LENGTHS = (1, 5, 17, 40)
FAMILIES = ("llama", "qwen3")


@cache
def _model_dir(cache_root: str, family: str) -> Path:
    return tiny_model_path(cache_root, family)


def _prompts(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(n)] for n in PROMPT_LENGTHS]


@cache
def _hf_hidden(model_dir: Path, prompts: tuple[tuple[int, ...], ...]) -> list[np.ndarray]:
    """HF's final hidden states (after the final norm) per prompt: ``AutoModel``'s last_hidden_state, checked
    to be the causal LM's ``hidden_states[-1]``."""
    base = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    causal = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    states = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            hidden = base(ids).last_hidden_state[0]
            assert torch.equal(hidden, causal(ids, output_hidden_states=True).hidden_states[-1][0])
            states.append(hidden.numpy().astype(np.float64))
    return states


def _expected(hidden: np.ndarray, pooling: str, normalize: bool, dimensions: int | None = None) -> np.ndarray:
    vector = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
    vector = vector[:dimensions]
    return vector / np.linalg.norm(vector) if normalize else vector


def _close(got: list[float] | tuple[float, ...], want: np.ndarray, tol: float = 1e-5) -> bool:
    return bool(np.allclose(np.asarray(got), want, atol=tol, rtol=tol))


@pytest.mark.parametrize("attention_backend", ["auto", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_pooling_matches_transformers(tiny_cache: Path, family: str, attention_backend: str) -> None:
    model_dir = _model_dir(str(tiny_cache), family)
    prompts = _prompts()
    hidden = _hf_hidden(model_dir, tuple(map(tuple, prompts)))
    async with Engine.open(model_dir, device="cpu", attention_backend=attention_backend) as engine:
        for pooling in ("last", "mean"):
            for normalize in (True, False):
                got = await engine.embed(prompts, pooling=pooling, normalize=normalize)  # type: ignore[arg-type]
                for result, prompt, states in zip(got, prompts, hidden):
                    assert result.prompt_token_ids == tuple(prompt)
                    assert _close(result.embedding, _expected(states, pooling, normalize)), (pooling, normalize)
        truncated = await engine.embed(prompts[2], pooling="mean", dimensions=8)
        assert len(truncated[0].embedding) == 8
        assert _close(truncated[0].embedding, _expected(hidden[2], "mean", True, 8))
        stats = engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_embedding_requests == 4 * len(prompts) + 1
    assert stats.num_generated_tokens == 0


async def test_text_inputs_default_pooling_and_sentence_transformers_config(tiny_cache: Path, tmp_path: Path) -> None:
    model_dir = _model_dir(str(tiny_cache), "qwen3")
    async with Engine.open(model_dir, device="cpu") as engine:
        ids = list(engine.tokenizer.encode("hello embeddings"))
        (one,) = await engine.embed("hello embeddings")  # defaults: last token, normalized
        (by_ids,) = await engine.embed(ids)
    hidden = _hf_hidden(model_dir, (tuple(ids),))[0]
    assert one.prompt_token_ids == tuple(ids) and one.embedding == by_ids.embedding
    assert _close(one.embedding, _expected(hidden, "last", True))
    # A sentence-transformers folder (Qwen3-Embedding's layout) sets the defaults.
    (tmp_path / "1_Pooling").mkdir()
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False})
    )
    defaults = pooling_defaults("auto", tmp_path)
    assert (defaults.pooling, defaults.normalize) == ("mean", False)
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    defaults = pooling_defaults("auto", tmp_path)
    assert (defaults.pooling, defaults.normalize) == ("last", True)
    assert pooling_defaults("mean", tmp_path).pooling == "mean"  # the option wins over the folder
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    defaults = pooling_defaults("auto", tmp_path)
    assert defaults.pooling is None and defaults.problem is not None and "cls" in defaults.problem


async def test_chunked_prefill_gives_the_same_vectors(tiny_cache: Path) -> None:
    model_dir = _model_dir(str(tiny_cache), "llama")
    prompts = _prompts()
    hidden = _hf_hidden(model_dir, tuple(map(tuple, prompts)))
    async with Engine.open(model_dir, device="cpu", max_num_batched_tokens=8, block_size=4) as engine:
        for pooling in ("last", "mean"):
            got = await engine.embed(prompts, pooling=pooling, normalize=False)  # type: ignore[arg-type]
            for result, states in zip(got, hidden):
                assert _close(result.embedding, _expected(states, pooling, False))
        stats = engine.statistics()
    assert stats.num_steps >= sum(PROMPT_LENGTHS) // 8 * 2  # really chunked
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_mixed_batch_leaves_generation_unchanged(tiny_cache: Path) -> None:
    model_dir = _model_dir(str(tiny_cache), "qwen3")
    prompts = _prompts(seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def generate_all(engine: Engine, embed: bool) -> tuple[list[tuple[int, ...]], list[np.ndarray]]:
        streams = [engine.stream(prompt, params) for prompt in prompts]  # queued at once, before any step
        results: list[tuple[int, ...]] = []
        vectors: list[np.ndarray] = []

        async def embed_all() -> None:
            for pooling in ("mean", "last"):
                got = await engine.embed(prompts, pooling=pooling, normalize=False)  # type: ignore[arg-type]
                vectors.extend(np.asarray(e.embedding) for e in got)

        async with anyio.create_task_group() as group:
            if embed:
                group.start_soon(embed_all)
            for stream in streams:
                ids: list[int] = []
                async with stream:
                    async for chunk in stream:
                        ids.extend(chunk.token_ids)
                results.append(tuple(ids))
        return results, vectors

    async with Engine.open(model_dir, device="cpu", max_num_batched_tokens=24) as engine:
        alone, _ = await generate_all(engine, embed=False)
        mixed, vectors = await generate_all(engine, embed=True)
        stats = engine.statistics()
    assert mixed == alone
    assert all(len(ids) == 12 for ids in alone)
    hidden = _hf_hidden(model_dir, tuple(map(tuple, prompts)))
    for index, states in enumerate(hidden):
        assert _close(vectors[index], _expected(states, "mean", False))
        assert _close(vectors[len(prompts) + index], _expected(states, "last", False))
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_scheduler_batches_pooling_with_generation_and_never_samples_it() -> None:
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=6)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    generating = Request(0, [1, 2, 3], params, frozenset(), 64)
    pooled = Request(1, list(range(10, 19)), SamplingParams(max_tokens=1), frozenset(), 64, pooling="mean")
    scheduler.add(generating)
    scheduler.add(pooled)
    first = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.sample, s.pool) for s in first.scheduled] == [
        (0, 3, True, False),
        (1, 3, False, False),
    ]
    events = scheduler.update(first, StepOutput([7]))
    assert [e.request.request_id for e in events] == [0]
    second = scheduler.schedule()  # the decode and the pooling request's next chunk, in one step
    assert [(s.request.request_id, s.num_new_tokens, s.sample, s.pool) for s in second.scheduled] == [
        (0, 1, True, False),
        (1, 5, False, False),
    ]
    scheduler.update(second, StepOutput([8]))
    third = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.sample, s.pool) for s in third.scheduled] == [
        (0, 1, True, False),
        (1, 1, False, True),
    ]
    vector = np.ones(4, dtype=np.float32)
    events = scheduler.update(third, StepOutput([9], pooled={1: vector}))
    by_id = {e.request.request_id: e for e in events}
    assert by_id[1].finish_reason == "stop" and by_id[1].embedding is vector and by_id[1].new_token_ids == []
    assert by_id[0].finish_reason == "length"
    assert pooled.finished and not scheduler.has_work()
    assert kv.num_free_blocks == 64


def test_mean_pooling_skips_the_prefix_cache_and_last_token_uses_it() -> None:
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(10, 22))
    for request_id, pooling in enumerate(("last", "last", "mean")):
        request = Request(request_id, prompt, SamplingParams(max_tokens=1), frozenset(), 64, pooling=pooling)  # type: ignore[arg-type]
        scheduler.add(request)
        step = scheduler.schedule()
        (item,) = step.scheduled
        # The first computes everything; a repeat starts after its cached full blocks, but computes the
        # last token (its hidden state is the vector); mean pooling computes every position again.
        assert item.start == {0: 0, 1: 8, 2: 0}[request_id], pooling
        assert item.pool
        scheduler.update(step, StepOutput([], pooled={request_id: np.zeros(4, dtype=np.float32)}))
    assert kv.num_free_blocks == 64


async def test_prefix_cache_repeat_gives_the_same_vector(tiny_cache: Path) -> None:
    model_dir = _model_dir(str(tiny_cache), "llama")
    prompt = _prompts()[3]  # 40 tokens: two cached blocks of 16 on a repeat
    async with Engine.open(model_dir, device="cpu", enable_prefix_caching=True) as engine:
        results = {}
        for pooling in ("last", "mean"):
            (first,) = await engine.embed(prompt, pooling=pooling)  # type: ignore[arg-type]
            before = engine.statistics().prefix_cache_hits
            (again,) = await engine.embed(prompt, pooling=pooling)  # type: ignore[arg-type]
            results[pooling] = engine.statistics().prefix_cache_hits - before
            assert _close(again.embedding, np.asarray(first.embedding))
        stats = engine.statistics()
    assert results["last"] == 32 and results["mean"] == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_cancelling_embed_aborts_its_requests_and_frees_blocks(tiny_cache: Path) -> None:
    model_dir = _model_dir(str(tiny_cache), "llama")
    prompts = [_prompts()[3]] * 6
    async with Engine.open(model_dir, device="cpu", max_num_batched_tokens=8, enable_prefix_caching=False) as engine:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(engine.embed, prompts)
                # Wait until some of the inputs hold KV blocks, then cancel the call.
                while engine.statistics().kv_blocks_free == engine.statistics().kv_blocks_total:
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
        assert scope.cancelled_caught
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=2))  # a step carries the aborts
        stats = engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_embedding_requests < len(prompts)


async def test_bad_inputs_fail_at_the_call(tiny_cache: Path) -> None:
    model_dir = _model_dir(str(tiny_cache), "llama")
    async with Engine.open(model_dir, device="cpu", max_model_len=64, max_embedding_inputs=3) as engine:
        hidden_size = engine.embedding_size
        assert hidden_size is not None
        cases: list[tuple[object, dict[str, object], type[Exception], str]] = [
            ([], {}, InvalidPromptError, "input"),
            ("", {}, InvalidPromptError, "input"),
            (["a", ""], {}, InvalidPromptError, "input"),
            ([[1, 2], []], {}, InvalidPromptError, "input"),
            ([1, 10**9], {}, InvalidPromptError, "input"),
            ([[1]] * 4, {}, InvalidRequestError, "input"),
            ([1] * 65, {}, PromptTooLongError, "input"),
            ("x", {"dimensions": 0}, InvalidRequestError, "dimensions"),
            ("x", {"dimensions": hidden_size + 1}, InvalidRequestError, "dimensions"),
            ("x", {"dimensions": True}, InvalidRequestError, "dimensions"),
            ("x", {"pooling": "cls"}, InvalidRequestError, "pooling"),
            ("x", {"normalize": "yes"}, InvalidRequestError, "normalize"),
            ([b"x"], {}, InvalidPromptError, "input"),
        ]
        for inputs, keywords, error, param in cases:
            with pytest.raises(error) as caught:
                await engine.embed(inputs, **keywords)  # type: ignore[arg-type]
            assert isinstance(caught.value, ValueError)
            assert caught.value.param == param, (inputs, keywords)  # type: ignore[attr-defined]
        (exact,) = await engine.embed([1] * 64)  # a prompt of max_model_len tokens fits: nothing is generated
        assert len(exact.embedding) == hidden_size
        stats = engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_waiting == 0
