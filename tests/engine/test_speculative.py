"""Speculative decoding through the whole engine: the same outputs, fewer steps, nothing leaked.

Most tests run on the scripted runner (it verifies drafts the way a greedy model would: see
``ScriptedRunner``), whose script repeats with variations, so n-gram drafts are both accepted and
rejected. The tests at the end run the real tiny model: greedy outputs must be token-identical with
and without speculation, with drafts actually accepted.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from asyncllm import Completion, Engine, InvalidSamplingParamsError, SamplingParams
from asyncllm.executor._runner import RunnerInfo, StepBatch, StepOutput
from asyncllm.http import create_app
from asyncllm.outputs import EngineStatistics
from asyncllm.testing import ByteTokenizer, ScriptedRunner

pytestmark = pytest.mark.anyio

SCRIPT = b"the cat sat on the mat. the cat sat on the hat. a dog sat on the cat. "
PROMPT = "the cat sat on the mat. the cat sat on the hat. a dog"


def scripted(**options: Any) -> Engine:
    return Engine.open(runner=ScriptedRunner(SCRIPT), tokenizer=ByteTokenizer(), **options)


async def generate(params: SamplingParams, prompt: str = PROMPT, **options: Any) -> tuple[Completion, EngineStatistics]:
    async with scripted(**options) as engine:
        completion = await engine.generate(prompt, params)
        stats = engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == stats.num_waiting == 0
    return completion, stats


def check_counters(stats: EngineStatistics, num_tokens: int = 4) -> None:
    drafted, accepted = stats.spec_draft_tokens_per_position, stats.spec_accepted_tokens_per_position
    assert len(drafted) == len(accepted) == len(stats.spec_acceptance_rate_per_position) == num_tokens
    assert drafted[0] == stats.spec_num_drafts and list(drafted) == sorted(drafted, reverse=True)
    assert all(a <= d for a, d in zip(accepted, drafted)) and list(accepted) == sorted(accepted, reverse=True)
    assert stats.spec_draft_tokens == sum(drafted) and stats.spec_accepted_tokens == sum(accepted)
    assert stats.spec_acceptance_rate == pytest.approx(sum(accepted) / sum(drafted))


@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_the_same_outputs_in_fewer_steps(async_scheduling: bool) -> None:
    params = SamplingParams(max_tokens=120, ignore_eos=True, n=2)
    plain, plain_stats = await generate(params, async_scheduling=async_scheduling)
    fast, stats = await generate(params, async_scheduling=async_scheduling, speculative_method="ngram")
    assert [s.token_ids for s in fast.samples] == [s.token_ids for s in plain.samples]
    assert [s.text for s in fast.samples] == [s.text for s in plain.samples]
    assert stats.spec_accepted_tokens > 100 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert stats.num_steps < plain_stats.num_steps / 2
    assert stats.num_generated_tokens == plain_stats.num_generated_tokens == 240
    check_counters(stats)


async def test_max_tokens_is_never_exceeded() -> None:
    async with scripted(speculative_method="ngram", num_speculative_tokens=7) as engine:
        for max_tokens in range(1, 30):
            completion = await engine.generate(PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            assert len(completion.token_ids) == max_tokens and completion.finish_reason == "length"
            assert completion.text == SCRIPT.decode()[:max_tokens]
        assert engine.statistics().spec_accepted_tokens > 0


async def test_max_model_len_is_never_exceeded() -> None:
    async with scripted(speculative_method="ngram", max_model_len=len(PROMPT) + 11) as engine:
        completion = await engine.generate(PROMPT, SamplingParams(max_tokens=11, ignore_eos=True))
    assert len(completion.token_ids) == 11 and completion.finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_string_inside_an_accepted_draft_ends_the_output_at_it(include: bool) -> None:
    params = SamplingParams(max_tokens=200, ignore_eos=True, stop=("on the h",), include_stop_str_in_output=include)
    plain, _ = await generate(params)
    chunks = []
    async with scripted(speculative_method="ngram", num_speculative_tokens=8) as engine:
        async with engine.stream(PROMPT, params) as stream:
            async for chunk in stream:
                chunks.append(chunk)
        stats = engine.statistics()
    text = "".join(c.text for c in chunks)
    token_ids = [t for c in chunks for t in c.token_ids]
    assert text == plain.text and tuple(token_ids) == plain.token_ids
    assert text.endswith("the cat sat on the h" if include else "the cat sat ")
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == "on the h"
    # The step that completed the stop string had verified tokens beyond it: they were dropped.
    assert any(len(c.token_ids) > 1 for c in chunks) and stats.spec_accepted_tokens > 0


async def test_a_stop_token_inside_an_accepted_draft_ends_the_output_at_it() -> None:
    params = SamplingParams(max_tokens=200, stop_token_ids=(ord("g"),))
    plain, _ = await generate(params)
    fast, stats = await generate(params, speculative_method="ngram")
    assert fast.token_ids == plain.token_ids and fast.token_ids[-1] == ord("g")
    assert fast.finish_reason == "stop" and fast.stop_reason == ord("g")
    assert stats.spec_accepted_tokens > 0


async def test_a_request_may_draft_less_or_not_at_all() -> None:
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    async with scripted(speculative_method="ngram", num_speculative_tokens=4) as engine:
        await engine.generate(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True, num_speculative_tokens=0))
        assert engine.statistics().spec_num_drafts == 0
        await engine.generate(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True, num_speculative_tokens=2))
        stats = engine.statistics()
        assert stats.spec_num_drafts > 0 and stats.spec_draft_tokens_per_position[2:] == (0, 0)
        with pytest.raises(InvalidSamplingParamsError, match="num_speculative_tokens=5 is more than") as caught:
            engine.stream(PROMPT, SamplingParams(num_speculative_tokens=5))
        assert caught.value.param == "num_speculative_tokens"
        await engine.generate(PROMPT, params)
    async with scripted() as engine:
        with pytest.raises(InvalidSamplingParamsError, match="speculative_method=None"):
            await engine.generate(PROMPT, SamplingParams(num_speculative_tokens=1))
        await engine.generate(PROMPT, SamplingParams(num_speculative_tokens=0))


class _PlainRunner(ScriptedRunner):
    """A runner that does not verify drafts."""

    def load(self) -> RunnerInfo:
        info = super().load()
        return RunnerInfo(info.num_kv_blocks, info.block_size, info.vocab_size, info.max_model_len, info.eos_token_ids)

    def execute(self, batch: StepBatch) -> StepOutput:
        raise AssertionError("never reached")


async def test_a_runner_that_cannot_verify_drafts_is_refused_at_start() -> None:
    engine = Engine.open(runner=_PlainRunner(SCRIPT), tokenizer=ByteTokenizer(), speculative_method="ngram")
    with pytest.raises(ValueError, match="needs a model runner that verifies drafts"):
        async with engine:
            pass


async def test_bad_speculative_options_are_refused_at_open() -> None:
    with pytest.raises(ValueError, match="speculative_method must be 'ngram', 'draft_model' or None"):
        Engine.open(runner=ScriptedRunner(SCRIPT), tokenizer=ByteTokenizer(), speculative_method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens must be <= 16"):
        Engine.open(runner=ScriptedRunner(SCRIPT), tokenizer=ByteTokenizer(), num_speculative_tokens=17)
    with pytest.raises(ValueError, match="speculative_ngram_min"):
        Engine.open(runner=ScriptedRunner(SCRIPT), tokenizer=ByteTokenizer(), speculative_ngram_min=0)


async def test_cancelled_and_concurrent_requests_leave_no_block_behind() -> None:
    # Many streams at once in a cache too small for them (preemptions), half of them left after a few
    # chunks (aborted, drafts in flight).
    runner = ScriptedRunner(SCRIPT, num_kv_blocks=40)
    async with Engine.open(runner=runner, tokenizer=ByteTokenizer(), speculative_method="ngram") as engine:

        async def one(index: int) -> None:
            params = SamplingParams(max_tokens=40 + index, ignore_eos=True)
            async with engine.stream(PROMPT[index % 7 :], params) as stream:
                seen = 0
                async for chunk in stream:
                    seen += len(chunk.token_ids)
                    if index % 2 and seen > 5:
                        break

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for index in range(24):
                    group.start_soon(one, index)
        await engine.generate("z", SamplingParams(max_tokens=1, ignore_eos=True))  # every abort applied
        stats = engine.statistics()
    assert stats.spec_accepted_tokens > 0 and stats.num_preemptions > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == stats.num_waiting == 0


@asynccontextmanager
async def client(engine: Engine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def test_metrics_export_drafts_and_acceptance_per_position() -> None:
    async with scripted(speculative_method="ngram", num_speculative_tokens=3) as engine:
        async with client(engine) as http:
            response = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 50})
            assert response.status_code == 200
            text = (await http.get("/metrics")).text
        stats = engine.statistics()
    samples = {m[0]: float(m[1]) for m in re.findall(r"^(asyncllm_spec_decode\S*) (\S+)$", text, re.MULTILINE)}
    assert samples["asyncllm_spec_decode_num_drafts_total"] == stats.spec_num_drafts > 0
    assert samples["asyncllm_spec_decode_num_draft_tokens_total"] == stats.spec_draft_tokens
    assert samples["asyncllm_spec_decode_num_accepted_tokens_total"] == stats.spec_accepted_tokens > 0
    assert samples["asyncllm_spec_decode_acceptance_rate"] == pytest.approx(stats.spec_acceptance_rate)
    for position in range(3):
        label = f'{{position="{position}"}}'
        drafted = samples[f"asyncllm_spec_decode_num_draft_tokens_per_pos_total{label}"]
        accepted = samples[f"asyncllm_spec_decode_num_accepted_tokens_per_pos_total{label}"]
        assert (drafted, accepted) == (
            stats.spec_draft_tokens_per_position[position],
            stats.spec_accepted_tokens_per_position[position],
        )
        assert samples[f"asyncllm_spec_decode_acceptance_rate_per_pos{label}"] == pytest.approx(accepted / drafted)
    async with scripted() as engine, client(engine) as http:
        text = (await http.get("/metrics")).text
    assert "asyncllm_spec_decode_num_drafts_total 0" in text and "per_pos" not in text


# ----------------------------------------------------------------------------------------------
# The real (tiny) model
# ----------------------------------------------------------------------------------------------

REPETITIVE = "one two three four five six one two three four five six one two three four"


async def _real(
    model: Path, params: SamplingParams, prompt: str = REPETITIVE, **options: Any
) -> tuple[Completion, EngineStatistics]:
    async with Engine.open(model, device="cpu", kv_cache_blocks=64, **options) as engine:
        completion = await engine.generate(prompt, params)
        stats = engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    return completion, stats


async def test_greedy_outputs_of_the_real_model_are_token_identical(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, n=2, logprobs=2)
    plain, plain_stats = await _real(tiny_llama, params)
    fast, stats = await _real(tiny_llama, params, speculative_method="ngram", speculative_ngram_min=1)
    assert [s.token_ids for s in fast.samples] == [s.token_ids for s in plain.samples]
    assert [s.text for s in fast.samples] == [s.text for s in plain.samples]
    assert stats.spec_accepted_tokens > 0 and stats.num_steps < plain_stats.num_steps
    for fast_sample, plain_sample in zip(fast.samples, plain.samples):
        assert fast_sample.logprobs is not None and plain_sample.logprobs is not None
        assert len(fast_sample.logprobs) == 48
        for a, b in zip(fast_sample.logprobs, plain_sample.logprobs):
            assert a.token.token_id == b.token.token_id and a.token.rank == b.token.rank
            assert a.token.logprob == pytest.approx(b.token.logprob, abs=1e-3)


async def test_penalties_and_stop_strings_on_the_real_model(tiny_llama: Path) -> None:
    plain_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.1)
    plain, _ = await _real(tiny_llama, plain_params)
    # A stop string from the middle of the plain output: both runs must stop at the same token.
    stop = plain.text[len(plain.text) // 2 :][:6]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.1, stop=(stop,))
    expected, _ = await _real(tiny_llama, params)
    fast, stats = await _real(tiny_llama, params, speculative_method="ngram", speculative_ngram_min=1)
    assert fast.token_ids == expected.token_ids and fast.text == expected.text
    assert fast.finish_reason == expected.finish_reason and stats.spec_num_drafts > 0
    free, free_stats = await _real(tiny_llama, plain_params, speculative_method="ngram", speculative_ngram_min=1)
    assert free.token_ids == plain.token_ids and free_stats.spec_num_drafts > 0


async def test_structured_output_checks_drafts_on_the_real_model(tiny_llama: Path) -> None:
    # The prompt repeats "one two three four"; the grammar allows only "one two three" repeated, so
    # drafts that continue with " four" are refused by the grammar at that token.
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_output={"regex": "( ?one two three)+"})
    plain, _ = await _real(tiny_llama, params, prompt="one two three four one two three four one two three")
    fast, stats = await _real(
        tiny_llama, params, prompt="one two three four one two three four one two three",
        speculative_method="ngram", speculative_ngram_min=1,
    )  # fmt: skip
    assert fast.token_ids == plain.token_ids and fast.text == plain.text
    assert re.fullmatch("( ?one two three)+", fast.text)
    assert stats.spec_num_drafts > 0


@pytest.mark.parametrize("block_size", [1, 2])
async def test_a_table_keeps_its_epoch_only_while_it_grows(block_size: int) -> None:
    # The runner's rows (InputBatch, and the ranks' table sync) take a table of the epoch they hold for
    # a grown one after O(1) checks. A rejected draft's blocks leave the end of the table, and a tight
    # pool hands some back to it at other indices: such a table must come in a new epoch.
    runner = ScriptedRunner(SCRIPT, num_kv_blocks=48 // block_size, block_size=block_size)
    options: dict[str, Any] = {"speculative_method": "ngram", "max_model_len": 48}
    async with Engine.open(runner=runner, tokenizer=ByteTokenizer(), **options) as engine:

        async def one(index: int) -> None:
            await engine.generate(PROMPT[index * 4 : index * 4 + 6], SamplingParams(max_tokens=40, ignore_eos=True))

        async with anyio.create_task_group() as group:
            for index in range(6):
                group.start_soon(one, index)
        stats = engine.statistics()
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 0
    held: dict[int, tuple[int, int, list[int]]] = {}
    for step in runner.steps:
        now = {}
        for seq in step.sequences:
            table = list(seq.block_table)
            before = held.get(seq.request_id)
            if before is not None and before[:2] == (seq.epoch, seq.block_offset):
                assert table[: len(before[2])] == before[2], f"request {seq.request_id}'s table changed in its epoch"
            now[seq.request_id] = (seq.epoch, seq.block_offset, table)
        held = now
