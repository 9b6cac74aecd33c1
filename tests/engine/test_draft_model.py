"""Speculative decoding with a draft model (``speculative_method="draft_model"``) on real tiny models.

The target is a tiny random llama; the drafts are the target's own weights (every proposal is the
target's argmax: acceptance near 1), the target's weights with noise (proposals often rejected) and a
tiny llama of another shape with the same tokenizer. Greedy outputs must be token-identical with and without the draft
either way, through chunked prefill, prefix-cache hits, preemptions, ``n`` > 1, stop strings,
``max_tokens``, logprobs and a grammar; every KV block comes back. The sampled rule's distribution is
tested in ``tests/worker/test_draft_sampling.py``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import torch
from transformers import AutoTokenizer

from asyncllm import Engine, SamplingParams
from asyncllm.http import create_app
from asyncllm.outputs import EngineStatistics
from asyncllm.testing import ByteTokenizer, ScriptedRunner
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._device_ops import CpuOps
from asyncllm.worker._model_runner import TorchModelRunner

pytestmark = pytest.mark.anyio

PROMPTS = ["def add(a, b):", "one two three four", "The quick brown fox jumps over"]


@pytest.fixture(scope="session")
def target(tiny_cache: Path) -> Path:
    return tiny_model_path(tiny_cache, "llama", seed=1)


@pytest.fixture(scope="session")
def other_draft(target: Path, tiny_cache: Path) -> Path:
    """The target's weights with noise (half their spread) in every projection: proposals often rejected.

    (Tiny random models soon repeat one token, which any other tiny model guesses too: an unrelated
    tiny model is accepted about as often as the target itself.)
    """
    from safetensors.torch import load_file, save_file

    folder = tiny_cache / "draft-noisy"
    if not (folder / "config.json").is_file():
        shutil.copytree(target, folder)
        tensors = load_file(folder / "model.safetensors")
        generator = torch.Generator().manual_seed(0)
        for name, tensor in tensors.items():
            if "layers" in name and name.endswith("proj.weight"):
                noise = torch.randn(tensor.shape, generator=generator)
                tensors[name] = tensor + 0.5 * tensor.std() * noise
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def small_draft(tiny_cache: Path) -> Path:
    """Another tiny llama of the same tokenizer, of another shape (one layer, other heads and width)."""
    return tiny_model_path(tiny_cache, "llama", seed=2, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)


def check_counters(stats: EngineStatistics) -> None:
    drafted, accepted = stats.spec_draft_tokens_per_position, stats.spec_accepted_tokens_per_position
    assert stats.spec_draft_tokens == sum(drafted) > 0 and stats.spec_accepted_tokens == sum(accepted)
    assert all(a <= d for a, d in zip(accepted, drafted)) and drafted[0] == stats.spec_num_drafts
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == stats.num_waiting == 0


async def run(
    model: Path, params: SamplingParams, prompts: list[str] = PROMPTS, repeat: int = 1, **options: Any
) -> tuple[list[list[tuple[int, ...]]], EngineStatistics]:
    """Every prompt at once (``repeat`` rounds: later rounds hit the prefix cache), then the statistics."""
    outputs: list[list[tuple[int, ...]]] = []
    options = {"device": "cpu", "kv_cache_blocks": 64, "block_size": 4, **options}
    async with Engine.open(model, **options) as engine:
        results: list[Any] = [None] * len(prompts)

        async def one(index: int) -> None:
            results[index] = await engine.generate(prompts[index], params)

        for _ in range(repeat):
            async with anyio.create_task_group() as group:
                for index in range(len(prompts)):
                    group.start_soon(one, index)
            outputs.extend([s.token_ids for s in c.samples] for c in results)
        stats = engine.statistics()
    return outputs, stats


async def test_greedy_outputs_are_identical_with_any_draft(target: Path, other_draft: Path, small_draft: Path) -> None:
    # n=2 with logprobs, two rounds (the second hits the prefix cache), chunked prefill (budget 8).
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2, logprobs=1)
    options: dict[str, Any] = {"max_num_batched_tokens": 8, "repeat": 2}
    plain, plain_stats = await run(target, params, **options)
    same, same_stats = await run(
        target, params, speculative_method="draft_model", speculative_model=str(target), **options
    )
    other, other_stats = await run(
        target, params, speculative_method="draft_model", speculative_model=str(other_draft), **options
    )
    small, small_stats = await run(
        target, params, speculative_method="draft_model", speculative_model=str(small_draft), **options
    )
    assert same == plain and other == plain and small == plain
    check_counters(same_stats)
    check_counters(other_stats)
    check_counters(small_stats)
    assert same_stats.spec_acceptance_rate > 0.95 and same_stats.num_steps < plain_stats.num_steps
    assert 0.0 < other_stats.spec_acceptance_rate < 0.9
    assert same_stats.prefix_cache_hits > 0


async def test_preemption_stop_strings_max_tokens(target: Path, other_draft: Path) -> None:
    # A cache too small for every request at once: requests are preempted and recomputed mid-draft.
    plain_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    options: dict[str, Any] = {"kv_cache_blocks": 14, "num_speculative_tokens": 3}
    plain, _ = await run(target, plain_params, **options)
    fast, stats = await run(
        target, plain_params, speculative_method="draft_model", speculative_model=str(other_draft), **options
    )
    assert fast == plain and stats.num_preemptions > 0
    check_counters(stats)
    async with Engine.open(
        target,
        device="cpu",
        kv_cache_blocks=64,
        speculative_method="draft_model",
        speculative_model=str(target),
        num_speculative_tokens=5,
    ) as engine:
        reference = await engine.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        for max_tokens in (1, 2, 3, 7, 11):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            done = await engine.generate(PROMPTS[2], params)
            assert done.token_ids == reference.token_ids[:max_tokens] and done.finish_reason == "length"
        stop = reference.text[len(reference.text) // 2 :][:3]
        stopped = await engine.generate(
            PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=(stop,))
        )
        assert stopped.finish_reason == "stop" and reference.text.startswith(stopped.text)
        assert len(stopped.text) == reference.text.index(stop)
        stats = engine.statistics()
    assert stats.spec_acceptance_rate > 0.95
    check_counters(stats)
    # max_model_len within reach: proposals (and their scratch positions) stop short of it.
    prompt_length = len(AutoTokenizer.from_pretrained(target)(PROMPTS[2])["input_ids"])
    options = {"speculative_method": "draft_model", "speculative_model": str(target), "num_speculative_tokens": 5}
    async with Engine.open(
        target, device="cpu", kv_cache_blocks=64, max_model_len=prompt_length + 11, **options
    ) as engine:
        done = await engine.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True))
        stats = engine.statistics()
    assert done.token_ids == reference.token_ids[:11] and done.finish_reason == "length"
    assert stats.spec_accepted_tokens > 0
    check_counters(stats)


async def test_a_grammar_checks_the_proposals(target: Path) -> None:
    # The target's own weights propose tokens the grammar refuses: verification rejects them.
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_output={"regex": "[ab]{3,12}"})
    plain, _ = await run(target, params, PROMPTS[:1])
    options: dict[str, Any] = {"speculative_method": "draft_model", "speculative_model": str(target)}
    fast, stats = await run(target, params, PROMPTS[:1], **options)
    assert fast == plain
    check_counters(stats)


async def test_sampled_requests_run_and_return_every_block(target: Path, other_draft: Path) -> None:
    # Without async scheduling: each step's result is in before the next is scheduled.
    # Unseeded: a seeded sampled request never drafts (its draws must not depend on the batch).
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, ignore_eos=True, n=2)
    options: dict[str, Any] = {"speculative_method": "draft_model", "async_scheduling": False}
    outputs, stats = await run(target, params, speculative_model=str(other_draft), **options)
    assert all(len(tokens) == 16 for sample in outputs for tokens in sample)
    check_counters(stats)


async def test_a_seeded_sampled_request_gets_plain_decodings_tokens_and_no_proposal_passes(
    target: Path, other_draft: Path
) -> None:
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5)
    plain, _ = await run(target, params)
    drafted, stats = await run(target, params, speculative_method="draft_model", speculative_model=str(other_draft))
    assert drafted == plain
    # Not even proposed: the draft's passes would be compute spent on a draft never verified.
    assert stats.spec_draft_tokens == 0 and stats.spec_num_drafts == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


def _copy(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


async def test_refusals_at_open(target: Path, tmp_path: Path, tiny_cache: Path) -> None:
    with pytest.raises(ValueError, match="needs speculative_model"):
        Engine.open(target, speculative_method="draft_model")
    with pytest.raises(ValueError, match="speculative_model is for"):
        Engine.open(target, speculative_method="ngram", speculative_model=str(target))
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        Engine.open(target, speculative_method="draft_model", speculative_model=str(target), tensor_parallel_size=2)

    async def refused(draft: Path | str, match: str) -> None:
        engine = Engine.open(target, device="cpu", kv_cache_blocks=16, speculative_method="draft_model",
                             speculative_model=str(draft))  # fmt: skip
        with pytest.raises(ValueError, match=match):
            async with engine:
                pass

    await refused(tmp_path / "missing", "not a local model folder")
    await refused(tiny_model_path(tiny_cache, "llama", vocab_size=600), "vocabulary of 600 tokens")
    swapped = _copy(target, tmp_path / "swapped")
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    await refused(swapped, "another tokenizer than the target's")
    foreign = _copy(target, tmp_path / "foreign")
    config = json.loads((foreign / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (foreign / "config.json").write_text(json.dumps(config))
    await refused(foreign, "unsupported draft model")
    engine = Engine.open(runner=ScriptedRunner(b"abc"), tokenizer=ByteTokenizer(), speculative_method="draft_model",
                         speculative_model=str(target))  # fmt: skip
    with pytest.raises(ValueError, match="needs a model runner that runs a draft model"):
        async with engine:
            pass


class _AsynchronousCpuOps(CpuOps):
    """The CPU's ops claiming to be asynchronous: the engine takes the lookahead path (launch, then collect)."""

    asynchronous = True


async def test_the_lookahead_pipeline(target: Path) -> None:
    # One request never drafts (it runs overlapped, its placeholders filled on the device in the
    # draft's pass too); the others draft from the target's own weights.
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_speculative_tokens=0),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True, seed=5),
    ]
    tokenizer = AutoTokenizer.from_pretrained(target)

    async def generate(**options: Any) -> tuple[list[tuple[int, ...]], EngineStatistics]:
        runner = TorchModelRunner(target, device="cpu", kv_cache_blocks=64, block_size=4, **options)
        runner.ops = _AsynchronousCpuOps()
        async with Engine.open(runner=runner, tokenizer=tokenizer, **options) as engine:
            results: list[tuple[int, ...]] = [() for _ in PROMPTS]

            async def one(index: int) -> None:
                results[index] = (await engine.generate(PROMPTS[index], params[index])).token_ids

            async with anyio.create_task_group() as group:
                for index in range(len(PROMPTS)):
                    group.start_soon(one, index)
            return results, engine.statistics()

    plain, _ = await generate()
    fast, stats = await generate(speculative_method="draft_model", speculative_model=str(target))
    assert fast[:2] == plain[:2] and len(fast[2]) == 16
    assert stats.spec_acceptance_rate > 0.95
    check_counters(stats)


async def test_metrics_count_the_proposals(target: Path) -> None:
    options: dict[str, Any] = {"speculative_method": "draft_model", "speculative_model": str(target)}
    async with Engine.open(target, device="cpu", kv_cache_blocks=32, num_speculative_tokens=3, **options) as engine:
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            text = (await http.get("/metrics")).text
        stats = engine.statistics()
    samples = {m[0]: float(m[1]) for m in re.findall(r"^(asyncllm_spec_decode\S*) (\S+)$", text, re.MULTILINE)}
    assert samples["asyncllm_spec_decode_num_draft_tokens_total"] == stats.spec_draft_tokens > 0
    assert samples["asyncllm_spec_decode_num_accepted_tokens_total"] == stats.spec_accepted_tokens > 0
    for position in range(3):
        label = f'{{position="{position}"}}'
        assert (
            samples[f"asyncllm_spec_decode_num_draft_tokens_per_pos_total{label}"]
            == (stats.spec_draft_tokens_per_position[position])
        )
        assert samples[f"asyncllm_spec_decode_acceptance_rate_per_pos{label}"] == pytest.approx(
            stats.spec_acceptance_rate_per_position[position]
        )


async def test_a_table_cut_by_rejected_tokens_then_regrown_is_rewritten_in_the_runner(
    target: Path, other_draft: Path
) -> None:
    # Rejected proposals give back several blocks at a table's end (block_size 2, 4 draft tokens plus
    # the proposal's slots); with few free blocks the pool hands some of them back to the same table
    # at other indices, its old last block at its old place. The runner's rows, which take a table of
    # the same epoch for a grown one when its first and last known blocks stay, then kept stale
    # blocks: tokens were written to and read from blocks of other positions (and other requests).
    prompts = [
        "def add(a, b): return",
        "one two three four five",
        "The quick brown fox jumps over the lazy dog",
        "hello world and more",
        "a b c",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options: dict[str, Any] = {"block_size": 2, "kv_cache_blocks": 58}
    plain, _ = await run(target, params, prompts, **options)
    fast, stats = await run(
        target, params, prompts, speculative_method="draft_model", speculative_model=str(other_draft), **options
    )
    assert fast == plain
    check_counters(stats)
