"""Bad input fails at the call with an error of the tree, and the engine goes on serving everyone.

Each reproducer here once killed the engine for every user (``EngineDeadError``), escaped the error
tree (``TypeError``), or silently produced garbage; the tests run them on the tiny real model
where the failure was in the model path (the sampler, the HF tokenizer, block hashing), and on the
scripted runner where the layers above the model are enough.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncllm import (
    ChatTemplateError,
    Engine,
    EngineOverloadedError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    SamplingParams,
)
from asyncllm.engine._input_processor import THREAD_MIN_BAD_WORDS, THREAD_MIN_CHARS, InputProcessor, RequestLimits
from asyncllm.engine._options import DEFAULT_MAX_WAITING_REQUESTS
from asyncllm.testing import ByteTokenizer, ScriptedRunner

pytestmark = pytest.mark.anyio

LONG = SamplingParams(max_tokens=1000, ignore_eos=True)
# 20 tokens or more with the tiny model's tokenizer: more than one full KV block of 16, so it is hashed.
SIXTEEN_PLUS = "hello world " * 20


def _open(model: Path, **options: Any) -> Engine:
    return Engine.open(model, device="cpu", kv_cache_blocks=64, **options)


async def _still_serving(engine: Engine) -> None:
    engine.check_health()
    completion = await engine.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(completion.token_ids) == 2


# -- seeds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "n"), [(2**64, 1), (2**64 - 1, 2), (2**70, 1)])
async def test_a_seed_beyond_64_bits_fails_at_the_call(tiny_llama: Path, seed: int, n: int) -> None:
    async with _open(tiny_llama) as engine:
        with pytest.raises(InvalidSamplingParamsError, match="seed must be <= 2\\*\\*64 - n") as raised:
            await engine.generate("hi", {"seed": seed, "n": n, "max_tokens": 4, "temperature": 1.0})
        assert raised.value.param == "seed"
        await _still_serving(engine)


async def test_the_largest_seeds_sample(tiny_llama: Path) -> None:
    async with _open(tiny_llama) as engine:
        one = await engine.generate("hi", SamplingParams(seed=2**64 - 1, max_tokens=4, ignore_eos=True))
        two = await engine.generate("hi", SamplingParams(seed=2**64 - 2, n=2, max_tokens=4, ignore_eos=True))
        await _still_serving(engine)
    assert two.samples[1].token_ids == one.token_ids  # sample 1 of n uses seed + 1


async def test_an_empty_cache_salt_fails_at_the_call(tiny_llama: Path) -> None:
    async with _open(tiny_llama) as engine:
        with pytest.raises(InvalidRequestError, match="non-empty") as raised:
            await engine.generate("hi", SamplingParams(max_tokens=2), cache_salt="")
        assert raised.value.param == "cache_salt"
        await _still_serving(engine)


# -- text that is not UTF-8 ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "error"),
    [
        ("prompt", InvalidPromptError),
        ("bad_words", InvalidSamplingParamsError),
        ("stop", InvalidSamplingParamsError),
        ("cache_salt", InvalidRequestError),
        ("messages", ChatTemplateError),
    ],
)
async def test_a_lone_surrogate_fails_at_the_call(tiny_llama: Path, field: str, error: type[Exception]) -> None:
    lone = "text \ud800 more"
    async with _open(tiny_llama) as engine:
        with pytest.raises(error, match="not valid UTF-8 text: it holds the lone surrogate") as raised:
            params = SamplingParams(max_tokens=2)
            if field == "prompt":
                await engine.generate(lone, params)
            elif field == "bad_words":
                await engine.generate("hi", {"max_tokens": 2, "bad_words": ["fine", lone]})
            elif field == "stop":
                await engine.generate("hi", {"max_tokens": 2, "stop": [lone]})
            elif field == "cache_salt":
                await engine.generate(SIXTEEN_PLUS, params, cache_salt=lone)
            else:
                await engine.chat([{"role": "user", "content": lone}], params)
        assert isinstance(raised.value, InvalidRequestError)
        assert raised.value.param == field
        with pytest.raises(error):  # the synchronous twins refuse it too
            if field == "cache_salt":
                engine.stream(SIXTEEN_PLUS, params, cache_salt=lone)
            elif field == "messages":
                engine.chat_stream([{"role": "user", "content": lone}], params)
            elif field == "prompt":
                engine.stream(lone, params)
            else:
                SamplingParams(**{field: (lone,)})
        await _still_serving(engine)


class FailingTokenizer(ByteTokenizer):
    """A tokenizer that raises on text holding "boom", as a buggy or strict tokenizer might."""

    def encode(self, text: str) -> list[int]:
        if "boom" in text:
            raise RuntimeError("the tokenizer gave up")
        return super().encode(text)


@pytest.mark.parametrize("where", ["prompt", "bad_words"])
async def test_a_tokenizer_failure_is_an_error_of_the_tree(where: str) -> None:
    runner = ScriptedRunner(b"ok")
    async with Engine.open(runner=runner, tokenizer=FailingTokenizer()) as engine:
        for call in ("stream", "generate"):
            expected = InvalidPromptError if where == "prompt" else InvalidSamplingParamsError
            with pytest.raises(
                expected, match=r"the tokenizer failed on .*RuntimeError: the tokenizer gave up"
            ) as raised:
                prompt, params = ("a boom", {}) if where == "prompt" else ("fine", {"bad_words": ["boom"]})
                if call == "stream":
                    engine.stream(prompt, params)
                else:
                    await engine.generate(prompt, params)
            assert raised.value.param == where
            assert isinstance(raised.value.__cause__, RuntimeError)
        await _still_serving(engine)


async def test_a_chat_template_or_tokenizer_failure_is_a_chat_template_error() -> None:
    class Failing(CountingTokenizer):
        def apply_chat_template(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> dict[str, list[int]]:
            raise RuntimeError("the template engine gave up")

    async with Engine.open(runner=ScriptedRunner(b"ok"), tokenizer=Failing()) as engine:
        with pytest.raises(ChatTemplateError, match="RuntimeError: the template engine gave up") as raised:
            await engine.chat([{"role": "user", "content": "hi"}])
        assert raised.value.param == "messages" and isinstance(raised.value.__cause__, RuntimeError)
        await _still_serving(engine)


# -- temperatures too small to divide by ---------------------------------------------------------


async def test_tiny_temperatures_sample_greedily(tiny_llama: Path) -> None:
    async with _open(tiny_llama) as engine:
        greedy = await engine.generate("hello world", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        tiny = [
            await engine.generate("hello world", SamplingParams(temperature=t, seed=1, max_tokens=8, ignore_eos=True))
            for t in (1e-300, 1e-40, 1e-6)
        ]
    assert set(greedy.token_ids) != {0}
    assert [c.token_ids for c in tiny] == [greedy.token_ids] * 3
    assert SamplingParams(temperature=9.99e-6).greedy and not SamplingParams(temperature=1e-5).greedy


def test_a_repetition_penalty_too_small_to_divide_by_is_refused() -> None:
    with pytest.raises(InvalidSamplingParamsError, match="repetition_penalty must be in") as raised:
        SamplingParams(repetition_penalty=1e-300)
    assert raised.value.param == "repetition_penalty"
    assert SamplingParams(repetition_penalty=1e-6).has_penalties


# -- the engine's caps on one request ------------------------------------------------------------


class CountingTokenizer(ByteTokenizer):
    """Counts the characters it was asked to encode."""

    chat_template = "<role>content per message"

    def __init__(self) -> None:
        self.encoded_chars = 0

    def encode(self, text: str) -> list[int]:
        self.encoded_chars += len(text)
        return super().encode(text)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> dict[str, list[int]]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return {"input_ids": self.encode(text)}


def _scripted(**options: Any) -> tuple[Engine, CountingTokenizer]:
    tokenizer = CountingTokenizer()
    runner = ScriptedRunner(b"ok", max_model_len=1024)
    return Engine.open(runner=runner, tokenizer=tokenizer, **options), tokenizer


@pytest.mark.parametrize(
    ("params", "limit", "param"),
    [
        ({"logprobs": 21}, "max_logprobs=20", "logprobs"),
        ({"prompt_logprobs": 21}, "max_logprobs=20", "prompt_logprobs"),
        ({"stop": [f"s{i}" for i in range(65)]}, "max_stop=64", "stop"),
        ({"stop": ["x" * 2049, "y" * 2048]}, "max_stop_bytes=4096", "stop"),
        ({"stop": ["é" * 2049]}, "max_stop_bytes=4096", "stop"),  # 4,098 bytes in 2,049 characters
        ({"bad_words": [f"w{i}" for i in range(20_000)]}, "max_bad_words=256", "bad_words"),
        ({"bad_words": ["x" * 100] * 82}, "max_bad_words_bytes=8192", "bad_words"),
    ],
)
async def test_a_request_beyond_a_limit_is_refused_naming_it(params: dict[str, Any], limit: str, param: str) -> None:
    engine, tokenizer = _scripted()
    async with engine:
        for call in ("stream", "open_stream"):
            with pytest.raises(
                InvalidSamplingParamsError, match=f"more than this engine allows \\({limit}\\)"
            ) as raised:
                if call == "stream":
                    engine.stream("hi", params)
                else:
                    await engine.open_stream("hi", params)
            assert raised.value.param == param
            assert f"Engine.open({limit.split('=')[0]}=...)" in str(raised.value)
        assert tokenizer.encoded_chars == 0  # refused before any tokenizing
        await _still_serving(engine)


async def test_requests_at_the_limits_are_served() -> None:
    engine, _ = _scripted()
    async with engine:
        at_limits = {
            "logprobs": 20,
            "prompt_logprobs": 20,
            "stop": ["x" * 64] * 64,
            "bad_words": ["w" * 31] * 256,
            "max_tokens": 2,
        }
        assert len((await engine.generate("hi", at_limits)).token_ids) == 2


async def test_the_limits_are_options_of_the_engine() -> None:
    engine, _ = _scripted(max_logprobs=50, max_stop=100, max_bad_words=1000, max_prompt_bytes=10)
    async with engine:
        await engine.generate("hi", {"logprobs": 50, "stop": [f"s{i}" for i in range(100)], "max_tokens": 2})
        await engine.generate("hi", {"bad_words": [f"w{i}" for i in range(1000)], "max_tokens": 2})
        with pytest.raises(PromptTooLongError, match="max_prompt_bytes=10"):
            engine.stream("x" * 11, SamplingParams(max_tokens=2))
    assert (
        RequestLimits() == Engine.open(runner=ScriptedRunner([1]), tokenizer=ByteTokenizer()).options.request_limits()
    )
    for name, value in [("max_stop", 0), ("max_prompt_bytes", 0), ("max_logprobs", -1), ("seed", 2**64)]:
        with pytest.raises(ValueError, match=name):
            Engine.open(runner=ScriptedRunner([1]), tokenizer=ByteTokenizer(), **{name: value})


@pytest.mark.parametrize("call", ["stream", "open_stream", "chat_stream", "chat"])
async def test_a_prompt_beyond_max_prompt_bytes_is_refused_before_tokenizing(call: str) -> None:
    # max_model_len 1024: by default 16 bytes per token, 16,384 bytes.
    engine, tokenizer = _scripted()
    async with engine:
        for text in ("x" * 16_385, "é" * 8_193, "x" * (4 << 20)):
            with pytest.raises(PromptTooLongError, match="max_prompt_bytes=16384") as raised:
                if call == "stream":
                    engine.stream(text, SamplingParams(max_tokens=2))
                elif call == "open_stream":
                    await engine.open_stream(text, SamplingParams(max_tokens=2))
                elif call == "chat_stream":
                    engine.chat_stream([{"role": "user", "content": text}], SamplingParams(max_tokens=2))
                else:
                    await engine.chat([{"role": "user", "content": text}], SamplingParams(max_tokens=2))
            assert raised.value.param == ("prompt" if "stream" in call and "chat" not in call else "messages")
            assert "Engine.open(max_prompt_bytes=...)" in str(raised.value)
        assert tokenizer.encoded_chars == 0
        await _still_serving(engine)


async def test_an_overlong_list_of_ids_is_refused_by_its_length() -> None:
    engine, _ = _scripted()
    async with engine:
        with pytest.raises(PromptTooLongError, match="max_model_len=1024"):
            engine.stream([1] * 1024 + ["not an id"], SamplingParams(max_tokens=1))  # type: ignore[list-item]
        await _still_serving(engine)


async def test_the_waiting_queue_is_bounded_by_default() -> None:
    runner = ScriptedRunner(b"z")
    async with Engine.open(runner=runner, tokenizer=ByteTokenizer(), max_num_seqs=1) as engine:
        assert engine.options.max_waiting_requests == DEFAULT_MAX_WAITING_REQUESTS == 4096
        # Nothing yields in between, so the step loop admits none of them: all of them wait.
        streams = [engine.stream("w", SamplingParams(max_tokens=1)) for _ in range(DEFAULT_MAX_WAITING_REQUESTS)]
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
            engine.stream("one too many", SamplingParams(max_tokens=1))
        with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
            await engine.open_stream("one too many", SamplingParams(max_tokens=1))
        for stream in streams:
            await stream.aclose()
        with anyio.fail_after(60):  # a bound, not a timing: the next steps drop the aborted requests
            while engine.statistics().num_waiting:
                await anyio.lowlevel.checkpoint()
        await _still_serving(engine)


# -- long prompts are tokenized off the event loop -----------------------------------------------


class GatedTokenizer(CountingTokenizer):
    """Encoding a text that holds GATE waits until ``gate`` is set, in whatever thread runs it.

    The test sets the gate from the event loop once another stream has received chunks after the
    heavy request was submitted: tokenizing that holds the event loop can never see it set.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gated_threads: list[int] = []

    def encode(self, text: str) -> list[int]:
        if "GATE" in text:
            self.gated_threads.append(threading.get_ident())
            if not self.gate.wait(timeout=30):
                raise TimeoutError("the gate never opened: tokenizing held the event loop")
        return super().encode(text)


@pytest.mark.parametrize("call", ["open_stream", "generate", "chat", "bad_words"])
async def test_another_stream_runs_while_a_long_prompt_is_tokenized(call: str) -> None:
    tokenizer = GatedTokenizer()
    runner = ScriptedRunner(b"abc", num_kv_blocks=1024, max_model_len=16384)  # room for a prompt of 8,196 bytes
    loop_thread = threading.get_ident()
    async with Engine.open(runner=runner, tokenizer=tokenizer) as engine:
        other = engine.stream("other", LONG)
        chunks = 0
        submitted_at: int | None = None

        async def read_other() -> None:
            nonlocal chunks
            async with other:
                async for _ in other:
                    chunks += 1
                    if submitted_at is not None and chunks >= submitted_at + 3:
                        tokenizer.gate.set()  # three chunks streamed while the heavy request was in hand

        heavy_prompt = "GATE" + "x" * THREAD_MIN_CHARS
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(read_other)
            submitted_at = chunks
            params = SamplingParams(max_tokens=2)
            if call == "open_stream":
                async with await engine.open_stream(heavy_prompt, params) as heavy:
                    admitted_at = chunks
                    assert len([c async for c in heavy]) >= 1
            elif call == "generate":
                assert len((await engine.generate(heavy_prompt, params)).token_ids) == 2
                admitted_at = chunks
            elif call == "chat":
                assert len((await engine.chat([{"role": "user", "content": heavy_prompt}], params)).token_ids) == 2
                admitted_at = chunks
            else:
                words = ["GATE"] + [f"w{i}" for i in range(THREAD_MIN_BAD_WORDS)]
                assert len((await engine.generate("short", {"max_tokens": 2, "bad_words": words})).token_ids) == 2
                admitted_at = chunks
            task_group.cancel_scope.cancel()
    assert admitted_at - submitted_at >= 3
    assert tokenizer.gated_threads and loop_thread not in tokenizer.gated_threads


async def test_short_prompts_are_tokenized_in_place() -> None:
    tokenizer = GatedTokenizer()
    tokenizer.gate.set()
    loop_thread = threading.get_ident()
    runner = ScriptedRunner(b"a", num_kv_blocks=1024, max_model_len=16384)
    async with Engine.open(runner=runner, tokenizer=tokenizer) as engine:
        await engine.generate("GATE" + "x" * (THREAD_MIN_CHARS - 5), SamplingParams(max_tokens=1))
    assert tokenizer.gated_threads == [loop_thread]


def test_input_processor_defaults() -> None:
    inputs = InputProcessor(ByteTokenizer(), vocab_size=257, max_model_len=512, eos_token_ids=frozenset({256}))
    assert inputs.limits == RequestLimits() and inputs.max_prompt_bytes == 16 * 512
