"""The parts of structured output below the engine: the compiler's cache, the sampler's matchers, and a
request whose grammar fails mid-output."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import anyio
import pytest
import torch
from transformers import AutoTokenizer

from asyncllm import Engine, RequestFailedError, SamplingParams, StructuredOutput, StructuredOutputError
from asyncllm.executor._runner import SequenceInput, StepBatch, StepOutput
from asyncllm.structured import GrammarCompiler
from asyncllm.structured._compiler import COMPILE_NICENESS, _low_priority
from asyncllm.structured._llguidance import LLGuidanceBackend
from asyncllm.testing import ByteTokenizer, ScriptedRunner
from asyncllm.worker._sampler import Sampler

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def backend(tiny_llama: Path) -> LLGuidanceBackend:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    return LLGuidanceBackend(tokenizer, len(tokenizer) + 8, [tokenizer.eos_token_id])


async def test_the_cache_is_bounded_and_keeps_the_recently_used(backend: LLGuidanceBackend) -> None:
    compiler = GrammarCompiler(lambda: backend, cache_size=2)
    specs = [StructuredOutput(regex=f"[a-z]{{{n}}}") for n in (1, 2, 3)]
    first = await compiler.compile_async(specs[0])
    await compiler.compile_async(specs[1])
    assert compiler.cached(specs[0]) is first  # used again: now the most recent
    await compiler.compile_async(specs[2])  # evicts specs[1], the least recently used
    assert compiler.cached(specs[1]) is None
    assert compiler.cached(specs[0]) is first
    assert compiler.num_compiled == 3


async def test_failures_are_cached_and_raised_again_without_compiling(backend: LLGuidanceBackend) -> None:
    compiler = GrammarCompiler(lambda: backend)
    bad = StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "nope"}}})
    for _ in range(3):
        with pytest.raises(StructuredOutputError, match="nope"):
            await compiler.compile_async(bad)
    with pytest.raises(StructuredOutputError, match="nope"):
        compiler.cached(bad)
    assert compiler.num_compiled == 1


def _seq(request_id: int, prompt: list[int], fed: list[int], start: int, grammar: object) -> SequenceInput:
    return SequenceInput(
        request_id=request_id,
        token_ids=fed,
        start_position=start,
        block_table=[0],
        sample=True,
        params=SamplingParams(temperature=0.0, max_tokens=50),
        prompt_token_ids=prompt,
        grammar=grammar,  # type: ignore[arg-type]
    )


def test_the_sampler_masks_by_the_grammar_and_follows_rewinds(tiny_llama: Path, backend: LLGuidanceBackend) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    grammar = backend.compile(StructuredOutput(choice=("hello world", "help")))
    sampler = Sampler(torch.device("cpu"), backend.vocab_size, frozenset({tokenizer.eos_token_id}))
    prompt = tokenizer.encode("x", add_special_tokens=False)
    logits = torch.zeros(1, backend.vocab_size)
    output: list[int] = []
    for _ in range(12):  # greedy over flat logits: the lowest id the grammar allows, until EOS
        fed = (prompt + output)[-1:] if output else prompt
        seq = _seq(1, prompt, fed, len(prompt) + len(output) - len(fed), grammar)
        sampler.record([seq])
        token = int(sampler.sample(logits, [seq]).token_ids[0])
        if token == tokenizer.eos_token_id:
            break
        output.append(token)
    text = tokenizer.decode(output)
    assert text in ("hello world", "help")
    # Preempted and recomputed from the start: the history rewinds to the prompt and comes back; the
    # matcher follows it and still allows nothing but the grammar's end.
    seq = _seq(1, prompt, prompt + output, 0, grammar)
    sampler.record([seq])
    assert int(sampler.sample(logits, [seq]).token_ids[0]) == tokenizer.eos_token_id
    assert not sampler.failed


def test_a_refused_token_is_reported_and_the_row_is_not_masked(tiny_llama: Path, backend: LLGuidanceBackend) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    grammar = backend.compile(StructuredOutput(regex="[0-9]+"))
    sampler = Sampler(torch.device("cpu"), backend.vocab_size, frozenset({tokenizer.eos_token_id}))
    prompt = tokenizer.encode("x", add_special_tokens=False)
    letter = tokenizer.encode("z", add_special_tokens=False)
    seq = _seq(5, prompt, prompt + letter, 0, grammar)  # a runner that fed a token the grammar refuses
    sampler.record([seq])
    logits = torch.zeros(1, backend.vocab_size)
    logits[0, 3] = 1.0
    assert int(sampler.sample(logits, [seq]).token_ids[0]) == 3  # unconstrained from now on
    assert list(sampler.failed) == [5] and "left its structured_output grammar" in sampler.failed[5]


class _FailingRunner(ScriptedRunner):
    """Reports the grammar of requests with a given prompt as failed on their third step."""

    def execute(self, batch: StepBatch) -> StepOutput:
        output = super().execute(batch)
        failed = {
            seq.request_id: "the output left its structured_output grammar: scripted"
            for seq in batch.sequences
            if seq.sample and bytes(seq.prompt_token_ids) == b"bad" and seq.num_generated == 2
        }
        return StepOutput(output.sampled_token_ids, output.logprobs, output.prompt_logprobs, failed or None)


async def test_a_grammar_failure_ends_that_request_only() -> None:
    runner = _FailingRunner(b"abc")
    async with Engine.open(runner=runner, tokenizer=ByteTokenizer()) as engine:
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        results: dict[str, object] = {}

        async def run(prompt: str) -> None:
            try:
                results[prompt] = (await engine.generate(prompt, params)).samples[0].text
            except RequestFailedError as exc:
                results[prompt] = exc

        async with anyio.create_task_group() as group:
            for prompt in ("good", "bad", "fine"):
                group.start_soon(run, prompt)
        assert isinstance(results["bad"], RequestFailedError)
        assert "scripted" in str(results["bad"])
        assert results["good"] == results["fine"] == ("abc" * 7)[:20]
        assert engine.statistics().kv_blocks_free == engine.statistics().kv_blocks_total


async def test_a_runner_without_grammars_refuses_structured_output() -> None:
    async with Engine.open(runner=ScriptedRunner(b"a"), tokenizer=ByteTokenizer()) as engine:
        with pytest.raises(StructuredOutputError, match="cannot apply structured_output"):
            engine.stream("x", SamplingParams(structured_output={"regex": "a"}))


def test_spec_validation_at_construction() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput(json_schema="{nope")
    with pytest.raises(ValueError, match="non-empty"):
        StructuredOutput(choice=())
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_output={"regex": "a"})
    with pytest.raises(ValueError, match="unknown structured_output"):
        SamplingParams(structured_output={"regexp": "a"})
    spec = SamplingParams(structured_output={"json_schema": json.dumps({"type": "integer"})}).structured_output
    assert spec is not None and spec.json_schema == {"type": "integer"} and spec.kind == "json_schema"
    assert (
        StructuredOutput(json_schema={"b": 1, "a": 2}).cache_key()
        == StructuredOutput(json_schema={"a": 2, "b": 1}).cache_key()
    )


async def test_lenient_ignores_what_strict_refuses(backend: LLGuidanceBackend) -> None:
    schema = {
        "type": "object",
        "properties": {"c": {"type": "string", "format": "color"}},
        "dependencies": {"a": ["b"]},
    }
    compiler = GrammarCompiler(lambda: backend)
    with pytest.raises(StructuredOutputError, match="dependencies"):
        await compiler.compile_async(StructuredOutput(json_schema=schema))
    await compiler.compile_async(StructuredOutput(json_schema=schema, lenient=True))
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    with pytest.raises(StructuredOutputError, match="oneOf"):
        await compiler.compile_async(StructuredOutput(json_schema=overlapping))
    await compiler.compile_async(StructuredOutput(json_schema=overlapping, lenient=True))
    with pytest.raises(ValueError, match="json_schema only"):
        StructuredOutput(regex="a", lenient=True)


async def test_the_size_limit_is_checked_at_the_call(tiny_llama: Path) -> None:
    async with Engine.open(tiny_llama, max_structured_output_bytes=200) as engine:
        with pytest.raises(StructuredOutputError, match="max_structured_output_bytes=200"):
            engine.stream("x", SamplingParams(structured_output={"choice": ["y" * 50] * 5}))


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priorities are a Linux feature here")
def test_a_compiling_thread_yields_the_cpu_to_the_device() -> None:
    # Where cores are scarce, a compile takes what the forward leaves rather than a core from it.
    seen: list[int] = []

    def compile_in_thread() -> None:
        thread = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, thread)
        with _low_priority():
            seen.append(os.getpriority(os.PRIO_PROCESS, thread) - before)

    worker = threading.Thread(target=compile_in_thread)
    worker.start()
    worker.join()
    assert seen == [min(COMPILE_NICENESS, 19 - os.getpriority(os.PRIO_PROCESS, 0))]
