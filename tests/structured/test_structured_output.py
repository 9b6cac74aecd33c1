"""Structured output end to end: a real tiny model under llguidance grammars, every output validated."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import pytest
from transformers import AutoTokenizer

import asyncllm
from asyncllm import Engine, SamplingParams, StructuredOutput
from asyncllm.structured._llguidance import LLGuidanceBackend
from asyncllm.worker._model_runner import TorchModelRunner

pytestmark = pytest.mark.anyio

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_optional": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 5},
                    "zip": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
            "nickname": {"type": "string", "maxLength": 4},
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum_pattern": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "code": {"type": "string", "pattern": "^[A-F0-9]{4}$"},
        },
        "required": ["color", "code"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
            "count": {"type": "integer", "exclusiveMinimum": 10, "maximum": 99},
            "flag": {"type": "boolean"},
        },
        "required": ["ratio", "count", "flag"],
        "additionalProperties": False,
    },
    "refs_defs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "start": {"$ref": "#/$defs/point"},
            "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
        },
        "required": ["start", "path"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 50},
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": False,
            },
            {"type": "null"},
        ]
    },
}

REGEXES = [r"[a-z]{2,4}-[0-9]{3}", r"(yes|no|maybe)!", r"\(\d\d\d\) [0-9]{3}-[0-9]{4}"]
CHOICES = ["Paris", "London", "New York", "東京"]


def _params(spec: StructuredOutput, seed: int, **extra: Any) -> SamplingParams:
    fields: dict[str, Any] = {"max_tokens": 200, "temperature": 1.0, "seed": seed, "structured_output": spec}
    return SamplingParams(**(fields | extra))


def _check_json(name: str, text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMAS[name])


async def _run_all(
    engine: Engine, jobs: list[tuple[str, StructuredOutput, SamplingParams]]
) -> list[tuple[str, str, str]]:
    results: list[tuple[str, str, str]] = [("", "", "")] * len(jobs)

    async def one(index: int, kind: str, params: SamplingParams) -> None:
        completion = await engine.generate("Answer:", params)
        sample = completion.samples[0]
        results[index] = (kind, sample.text, str(sample.finish_reason))

    async with anyio.create_task_group() as group:
        for index, (kind, _, params) in enumerate(jobs):
            group.start_soon(one, index, kind, params)
    return results


def _jobs(per_kind: int) -> list[tuple[str, StructuredOutput, SamplingParams]]:
    jobs: list[tuple[str, StructuredOutput, SamplingParams]] = []
    seed = 0
    for name, schema in SCHEMAS.items():
        for _ in range(per_kind):
            spec = StructuredOutput(json_schema=schema)
            jobs.append((f"json:{name}", spec, _params(spec, seed)))
            seed += 1
    for regex in REGEXES:
        for _ in range(per_kind):
            spec = StructuredOutput(regex=regex)
            jobs.append((f"regex:{regex}", spec, _params(spec, seed)))
            seed += 1
    for _ in range(per_kind):
        spec = StructuredOutput(choice=tuple(CHOICES))
        jobs.append(("choice", spec, _params(spec, seed)))
        seed += 1
    return jobs


def _validate(results: list[tuple[str, str, str]]) -> None:
    for kind, text, finish in results:
        assert finish == "stop", (kind, text, finish)
        if kind.startswith("json:"):
            _check_json(kind.removeprefix("json:"), text)
        elif kind.startswith("regex:"):
            assert re.fullmatch(kind.removeprefix("regex:"), text), (kind, text)
        else:
            assert text in CHOICES, text


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["lookahead", "no-lookahead"])
async def test_sampled_outputs_parse_and_validate(tiny_llama: Path, async_scheduling: bool) -> None:
    jobs = _jobs(per_kind=11)  # 6 schemas, 3 regexes and a choice: 110 seeded generations
    async with Engine.open(tiny_llama, async_scheduling=async_scheduling, max_num_seqs=128) as engine:
        results = await _run_all(engine, jobs)
    assert len(results) >= 100
    _validate(results)


async def test_lookahead_gives_the_same_outputs(tiny_llama: Path) -> None:
    jobs = _jobs(per_kind=2)
    outputs = []
    for async_scheduling in (True, False):
        async with Engine.open(tiny_llama, async_scheduling=async_scheduling, max_num_seqs=64) as engine:
            outputs.append(await _run_all(engine, jobs))
    assert outputs[0] == outputs[1]
    _validate(outputs[0])


async def test_chunked_prefill_and_preemption_keep_outputs_valid(tiny_llama: Path) -> None:
    # A small cache and token budget: long prompts are prefilled in chunks and requests are preempted
    # and recomputed mid-output; each matcher must follow its request's history through it.
    prompt = "describe the weather in one json object please " * 6
    jobs = _jobs(per_kind=2)
    async with Engine.open(tiny_llama, kv_cache_blocks=24, block_size=16, max_num_batched_tokens=32) as engine:
        results: list[tuple[str, str, str]] = [("", "", "")] * len(jobs)

        async def one(index: int, kind: str, params: SamplingParams) -> None:
            sample = (await engine.generate(prompt, params)).samples[0]
            results[index] = (kind, sample.text, str(sample.finish_reason))

        async with anyio.create_task_group() as group:
            for index, (kind, _, params) in enumerate(jobs):
                group.start_soon(one, index, kind, params)
        assert engine.statistics().num_preemptions > 0
    _validate(results)


async def test_n_samples_each_follow_their_own_grammar_state(tiny_llama: Path) -> None:
    spec = StructuredOutput(json_schema=SCHEMAS["enum_pattern"])
    async with Engine.open(tiny_llama) as engine:
        completion = await engine.generate("Answer:", _params(spec, 7, n=6))
    texts = [sample.text for sample in completion.samples]
    assert len(texts) == 6 and len(set(texts)) > 1  # independent samples, not copies
    for sample in completion.samples:
        assert sample.finish_reason == "stop"
        _check_json("enum_pattern", sample.text)


async def test_unconstrained_requests_are_untouched(tiny_llama: Path) -> None:
    # A constrained neighbour in the batch changes nothing for a plain request (seeded and greedy).
    plain = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, seed=3)]
    spec = StructuredOutput(json_schema=SCHEMAS["refs_defs"])
    async with Engine.open(tiny_llama) as engine:
        alone = [(await engine.generate("Once upon", p)).samples[0].text for p in plain]
        together: list[str] = ["", ""]

        async def plain_one(index: int) -> None:
            together[index] = (await engine.generate("Once upon", plain[index])).samples[0].text

        async with anyio.create_task_group() as group:
            for seed in range(4):
                group.start_soon(engine.generate, "Answer:", _params(spec, seed))
            group.start_soon(plain_one, 0)
            group.start_soon(plain_one, 1)
    assert together == alone


async def test_grammar_wins_over_min_tokens_and_logprobs_are_raw(tiny_llama: Path) -> None:
    # "ab" is done after its tokens: min_tokens cannot hold it open, the EOS the grammar forces ends it.
    spec = StructuredOutput(choice=("ab",))
    async with Engine.open(tiny_llama) as engine:
        completion = await engine.generate(
            "x", SamplingParams(max_tokens=30, min_tokens=20, temperature=0.0, logprobs=2, structured_output=spec)
        )
        raw = await engine.generate("x", SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))
    sample = completion.samples[0]
    assert sample.text == "ab" and sample.finish_reason == "stop"
    assert sample.logprobs is not None and raw.samples[0].logprobs is not None
    # The first position's alternatives are the unconstrained model's, not the grammar's.
    assert sample.logprobs[0].top == raw.samples[0].logprobs[0].top


async def test_max_tokens_cuts_a_document_with_length(tiny_llama: Path) -> None:
    spec = StructuredOutput(json_schema=SCHEMAS["refs_defs"])
    async with Engine.open(tiny_llama) as engine:
        sample = (await engine.generate("x", _params(spec, 1, max_tokens=3))).samples[0]
    assert sample.finish_reason == "length"
    assert sample.text.startswith("{")


async def test_stop_strings_apply_to_constrained_output(tiny_llama: Path) -> None:
    spec = StructuredOutput(regex=r"aaa,bbb,ccc")
    async with Engine.open(tiny_llama) as engine:
        sample = (await engine.generate("x", _params(spec, 1, stop=[",c"]))).samples[0]
    assert sample.text == "aaa,bbb" and sample.finish_reason == "stop"


async def test_grammars_from_lark_and_ebnf(tiny_llama: Path) -> None:
    lark = 'start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[A-Z][a-z]{1,5}/'
    ebnf = 'root ::= "(" digit ("," digit)? ("," digit)? ")"\ndigit ::= [0-9]'
    async with Engine.open(tiny_llama) as engine:
        for seed in range(5):
            text = (await engine.generate("x", _params(StructuredOutput(lark=lark), seed))).samples[0].text
            assert re.fullmatch(r"(hi|hello) [A-Z][a-z]{1,5}", text), text
            text = (await engine.generate("x", _params(StructuredOutput(ebnf=ebnf), seed))).samples[0].text
            assert re.fullmatch(r"\([0-9](,[0-9]){0,2}\)", text), text
        # Any object: its keys and strings are unbounded, so a random model rarely finishes one; what
        # it writes is an object's beginning all the same.
        text = (
            (await engine.generate("x", _params(StructuredOutput(json_object=True), 0, max_tokens=12))).samples[0].text
        )
    assert text.startswith('{"')


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(json_schema={"type": "foo"}), "Invalid type"),
        (StructuredOutput(json_schema={"type": "object", "unevaluatedProperties": False}), "unevaluatedProperties"),
        (StructuredOutput(regex="[0-9"), "regex"),
        (StructuredOutput(lark="start: missing_rule"), "missing_rule"),
        (StructuredOutput(ebnf='root ::= "a'), "ebnf"),
    ],
    ids=["invalid-schema", "unsupported-keyword", "bad-regex", "bad-lark", "bad-ebnf"],
)
async def test_bad_specs_raise_at_the_call_and_the_engine_keeps_serving(
    tiny_llama: Path, spec: StructuredOutput, message: str
) -> None:
    async with Engine.open(tiny_llama) as engine:
        with pytest.raises(asyncllm.StructuredOutputError, match=message) as caught:
            await engine.generate("x", SamplingParams(structured_output=spec))
        assert caught.value.param == "structured_output"
        # Sent again, the cached failure is raised at once, also by the synchronous stream().
        with pytest.raises(asyncllm.StructuredOutputError, match=message):
            engine.stream("x", SamplingParams(structured_output=spec))
        assert (await engine.generate("x", SamplingParams(max_tokens=3))).samples[0].finish_reason == "length"


async def test_sync_stream_of_an_uncompiled_bad_spec_ends_with_the_error(tiny_llama: Path) -> None:
    async with Engine.open(tiny_llama) as engine:
        stream = engine.stream("x", SamplingParams(structured_output={"regex": "(unclosed"}))
        with pytest.raises(asyncllm.StructuredOutputError, match="regex"):
            async with stream:
                async for _ in stream:
                    pass
        assert (await engine.generate("x", SamplingParams(max_tokens=3))).samples[0].text


async def test_compiling_runs_in_a_worker_thread_while_other_requests_run(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The compile is held until an unconstrained request has finished: the constrained one waits in
    # the core, the other is served meanwhile, and nothing runs the compile on the event loop.
    release = threading.Event()
    compiled_in: list[int] = []
    real_compile = LLGuidanceBackend.compile

    def held_compile(self: LLGuidanceBackend, spec: StructuredOutput) -> Any:
        compiled_in.append(threading.get_ident())
        assert release.wait(timeout=60)
        return real_compile(self, spec)

    monkeypatch.setattr(LLGuidanceBackend, "compile", held_compile)
    spec = StructuredOutput(regex="[0-9]{3}")
    async with Engine.open(tiny_llama) as engine:
        constrained = engine.stream("x", _params(spec, 0))  # synchronous: it compiles in the core
        plain = await engine.generate("x", SamplingParams(max_tokens=8, temperature=0.0))
        assert plain.samples[0].finish_reason == "length"
        assert engine.statistics().num_running == 0  # the constrained request is not scheduled yet
        release.set()
        text = ""
        async with constrained:
            async for chunk in constrained:
                text += chunk.text
    assert re.fullmatch("[0-9]{3}", text)
    assert compiled_in and threading.get_ident() not in compiled_in


async def test_same_spec_compiles_once(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[StructuredOutput] = []
    real_compile = LLGuidanceBackend.compile

    def counting_compile(self: LLGuidanceBackend, spec: StructuredOutput) -> Any:
        calls.append(spec)
        return real_compile(self, spec)

    monkeypatch.setattr(LLGuidanceBackend, "compile", counting_compile)
    schema = SCHEMAS["enum_pattern"]
    async with Engine.open(tiny_llama) as engine:
        async with anyio.create_task_group() as group:  # concurrent first sight: one compile, shared
            for seed in range(8):
                group.start_soon(engine.generate, "x", _params(StructuredOutput(json_schema=schema), seed))
        await engine.generate("x", _params(StructuredOutput(json_schema=dict(schema)), 99))
        statistics = engine.statistics()
    assert len(calls) == 1
    assert statistics.grammars_compiled == 1 and statistics.grammar_cache_hits >= 8


async def test_aborted_requests_release_their_matchers(tiny_llama: Path) -> None:
    spec = StructuredOutput(json_schema=SCHEMAS["nested_optional"])
    runner = TorchModelRunner(tiny_llama)
    async with Engine.open(tiny_llama, runner=runner, tokenizer=AutoTokenizer.from_pretrained(tiny_llama)) as engine:
        for seed in range(4):
            stream = await engine.open_stream("x", _params(spec, seed))
            async with stream:
                async for _ in stream:
                    break  # leaving the block aborts the request
        await engine.generate("x", SamplingParams(max_tokens=2))  # a step carries the finished ids
        assert runner.sampler is not None
        assert not [state for state in runner.sampler._states.values() if state.matcher is not None]
