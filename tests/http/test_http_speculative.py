"""``num_speculative_tokens`` per request over HTTP (``extra_body``): real HTTP (hypercorn on loopback,
asyncio and trio) with the official ``openai`` client, on a scripted engine with n-gram speculation
whose runner records what each step carried."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from asyncllm import Engine
from asyncllm.http import create_app
from asyncllm.testing import ByteTokenizer, ScriptedRunner, import_path

pytestmark = pytest.mark.anyio

serving = import_path(Path(__file__).with_name("test_http_transport.py"), "asyncllm_test_http_transport").serving

BOUND_S = 60.0  # generous bound on any wait; never a timing assertion
MODEL = "m"
SCRIPT = b"the cat sat on the mat. the cat sat on the hat. a dog sat on the cat. "
PROMPT = "the cat sat on the mat. the cat sat on the hat. a dog"


class ChatByteTokenizer(ByteTokenizer):
    """A ByteTokenizer with a trivial chat template, so chat and responses run on the scripted engine."""

    chat_template = "<role>content\\n per message"

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> dict[str, list[int]]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return {"input_ids": self.encode(text)}


@asynccontextmanager
async def served(backend: str, **options: Any) -> AsyncIterator[tuple[openai.AsyncOpenAI, ScriptedRunner]]:
    runner = ScriptedRunner(SCRIPT)
    async with Engine.open(runner=runner, tokenizer=ChatByteTokenizer(), **options) as engine:
        async with serving(create_app(engine, model_name=MODEL), backend) as url:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=BOUND_S) as client:
                yield client, runner


def drafts_since(runner: ScriptedRunner, first_step: int) -> list[int]:
    """The draft lengths the steps from ``first_step`` on carried (one request at a time runs)."""
    return [seq.num_draft for step in runner.steps[first_step:] for seq in step.sequences if seq.num_draft]


async def test_num_speculative_tokens_per_request_on_each_endpoint(anyio_backend: str) -> None:
    async with served(anyio_backend, speculative_method="ngram", num_speculative_tokens=4) as (client, runner):
        lengths: dict[str, list[int]] = {}
        texts: dict[str, str] = {}
        for name, extra in [
            ("default", {}),
            ("two", {"num_speculative_tokens": 2}),
            ("none", {"num_speculative_tokens": 0}),
        ]:
            start = len(runner.steps)
            reply = await client.completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True, **extra}
            )
            texts[name] = reply.choices[0].text
            lengths[name] = drafts_since(runner, start)
        assert texts["default"] == texts["two"] == texts["none"] == SCRIPT.decode()[:40]
        assert max(lengths["default"]) == 4 and max(lengths["two"]) == 2 and lengths["none"] == []

        start = len(runner.steps)
        messages: Any = [{"role": "user", "content": PROMPT}]
        chat = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=40, extra_body={"ignore_eos": True, "num_speculative_tokens": 1}
        )
        assert chat.choices[0].message.content == SCRIPT.decode()[:40]
        assert set(drafts_since(runner, start)) == {1}

        start = len(runner.steps)
        response = await client.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=40, extra_body={"num_speculative_tokens": 3}
        )
        assert response.output_text.startswith(SCRIPT.decode()[:20])
        assert max(drafts_since(runner, start)) == 3

        for value, code in [(5, "invalid_request"), (-1, "invalid_request"), ("two", "invalid_parameter")]:
            body = {"num_speculative_tokens": value}
            with pytest.raises(openai.BadRequestError) as completion_error:
                await client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=body)
            with pytest.raises(openai.BadRequestError) as chat_error:
                await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=body)
            with pytest.raises(openai.BadRequestError) as responses_error:
                await client.responses.create(model=MODEL, input="x", max_output_tokens=2, extra_body=body)
            for error in (completion_error.value, chat_error.value, responses_error.value):
                assert (error.param, error.code) == ("num_speculative_tokens", code), (value, error.body)


async def test_num_speculative_tokens_without_speculation(anyio_backend: str) -> None:
    async with served(anyio_backend) as (client, _):
        reply = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"num_speculative_tokens": 0}
        )
        assert reply.choices[0].text == SCRIPT.decode()[:4]
        with pytest.raises(openai.BadRequestError) as error:
            await client.completions.create(
                model=MODEL, prompt="x", max_tokens=2, extra_body={"num_speculative_tokens": 1}
            )
        assert (error.value.param, error.value.code) == ("num_speculative_tokens", "invalid_request")
        assert "speculative_method" in str(error.value)
