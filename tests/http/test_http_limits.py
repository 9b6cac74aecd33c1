"""One request cannot make the server do unbounded work, nor kill it for everyone: each reproducer
of the reliability issue is a 400 naming the field (and, for a limit, the limit and how to raise
it), after which the server goes on serving (a normal request succeeds, ``/health`` is ok).

Through the real ASGI app, over httpx's ASGITransport and the official ``openai`` client.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.engine._input_processor import THREAD_MIN_CHARS
from asyncllm.http import create_app
from asyncllm.http._app import (
    DEFAULT_MAX_CHOICES,
    DEFAULT_MAX_COMPLETION_LOGPROBS,
    DEFAULT_MAX_TOP_LOGPROBS,
    OpenAIApp,
)
from asyncllm.testing import ByteTokenizer, ScriptedRunner

pytestmark = pytest.mark.anyio

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


class ChatTokenizer(ByteTokenizer):
    """A ByteTokenizer with a trivial chat template; it counts what it encodes and, for a text
    holding GATE, waits (in whatever thread encodes it) until ``gate`` is set."""

    chat_template = "<role>content per message"

    def __init__(self) -> None:
        self.encoded_chars = 0
        self.gate = threading.Event()
        self.gated_threads: list[int] = []

    def encode(self, text: str) -> list[int]:
        if "GATE" in text:
            self.gated_threads.append(threading.get_ident())
            if not self.gate.wait(timeout=30):
                raise TimeoutError("the gate never opened: tokenizing held the event loop")
        self.encoded_chars += len(text)
        return super().encode(text)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> dict[str, list[int]]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return {"input_ids": self.encode(text)}


@asynccontextmanager
async def serving(**app_options: Any) -> AsyncIterator[tuple[OpenAIApp, httpx.AsyncClient, ChatTokenizer]]:
    tokenizer = ChatTokenizer()
    # Room for a prompt of THREAD_MIN_CHARS bytes (one token per byte).
    runner = ScriptedRunner(b"Hi there", num_kv_blocks=1024, max_model_len=16384)
    async with Engine.open(runner=runner, tokenizer=tokenizer) as engine:
        app = create_app(engine, model_name="tiny", **app_options)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            yield app, http, tokenizer


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


async def still_serving(http: httpx.AsyncClient) -> None:
    completion = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2
    assert (await http.get("/health")).json() == {"status": "ok"}


# -- the reproducers, one by one ---------------------------------------------------------


@pytest.mark.parametrize("body", [{"seed": 18446744073709551616}, {"seed": 2**64 - 1, "n": 2}])
async def test_a_seed_beyond_64_bits_is_a_400_not_a_dead_engine(asyncllm_engine: Engine, body: dict[str, Any]) -> None:
    # The real tiny model: its sampler seeds a torch generator, which refused the seed in the step loop.
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(asyncllm_engine)), base_url="http://test"
    ) as http:
        response = await http.post("/v1/completions", json={"prompt": "hi", "temperature": 1.0, **body})
        error = error_of(response)
        assert error["param"] == "seed" and "2**64 - n" in error["message"]
        await still_serving(http)


async def test_many_prompts_times_n_is_refused_by_max_choices() -> None:
    async with serving() as (_, http, tokenizer):
        many = await http.post("/v1/completions", json={"prompt": ["x"] * 5000, "n": 64, "max_tokens": 1})
        error = error_of(many)
        assert error["param"] == "prompt"
        assert "320000 choices (5000 prompts times n=64)" in error["message"]
        assert "max_choices=256" in error["message"] and "create_app(max_choices=...)" in error["message"]
        assert "--max-choices" in error["message"]
        assert tokenizer.encoded_chars == 0
        big_n = error_of(await http.post("/v1/chat/completions", json={"messages": [_user("hi")], "n": 257}))
        assert big_n["param"] == "n" and "max_choices=256" in big_n["message"]
        at_limit = await http.post("/v1/completions", json={"prompt": ["x"] * 4, "n": 64, "max_tokens": 1})
        assert at_limit.status_code == 200 and len(at_limit.json()["choices"]) == 256
        await still_serving(http)


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


async def test_logprobs_are_capped_as_openai_caps_them() -> None:
    async with serving() as (_, http, _tokenizer):
        chat = {"messages": [_user("hi")], "max_tokens": 2, "logprobs": True}
        huge = error_of(await http.post("/v1/chat/completions", json={**chat, "top_logprobs": 49152}))
        assert huge["param"] == "top_logprobs" and "max_top_logprobs=20" in huge["message"]
        assert "create_app(max_top_logprobs=...)" in huge["message"]
        legacy = error_of(await http.post("/v1/completions", json={"prompt": "hi", "logprobs": 6}))
        assert legacy["param"] == "logprobs" and "max_completion_logprobs=5" in legacy["message"]
        ok_chat = await http.post("/v1/chat/completions", json={**chat, "top_logprobs": 20})
        ok_legacy = await http.post("/v1/completions", json={"prompt": "hi", "logprobs": 5, "max_tokens": 2})
        assert ok_chat.status_code == ok_legacy.status_code == 200
        await still_serving(http)


async def test_the_http_limits_are_options_of_create_app_and_the_engine_limits_still_hold() -> None:
    async with serving(max_choices=1000, max_completion_logprobs=20, max_top_logprobs=30) as (_, http, _tokenizer):
        wide = await http.post("/v1/completions", json={"prompt": ["x"] * 10, "n": 64, "max_tokens": 1})
        assert wide.status_code == 200 and len(wide.json()["choices"]) == 640
        twenty = await http.post("/v1/completions", json={"prompt": "hi", "logprobs": 20, "max_tokens": 1})
        assert twenty.status_code == 200
        # Past the app's limit, the engine's own (max_logprobs, 20 by default) still refuses.
        chat = {"messages": [_user("hi")], "logprobs": True, "top_logprobs": 30}
        engine_limit = error_of(await http.post("/v1/chat/completions", json=chat))
        assert engine_limit["param"] == "logprobs" and "max_logprobs=20" in engine_limit["message"]
        assert "Engine.open(max_logprobs=...)" in engine_limit["message"]
        await still_serving(http)
    for option in ("max_choices", "max_completion_logprobs", "max_top_logprobs"):
        with pytest.raises(ValueError, match=option):
            create_app(Engine.open(runner=ScriptedRunner([1]), tokenizer=ByteTokenizer()), **{option: -1})


async def test_a_huge_prompt_is_refused_before_it_is_tokenized() -> None:
    async with serving() as (_, http, tokenizer):
        prompt = "x" * (4 * 1024 * 1024 - 100)  # within the 4 MiB body limit
        error = error_of(await http.post("/v1/completions", json={"prompt": prompt}))
        assert error["param"] == "prompt" and "max_prompt_bytes=262144" in error["message"]  # 16 x 16,384
        chat = error_of(await http.post("/v1/chat/completions", json={"messages": [_user(prompt)]}))
        assert chat["param"] == "messages" and "max_prompt_bytes=262144" in chat["message"]
        assert tokenizer.encoded_chars == 0
        await still_serving(http)


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("bad_words", [f"w{i}" for i in range(20_000)], "max_bad_words=256"),
        ("bad_words", ["x" * 1000] * 9, "max_bad_words_bytes=8192"),
        ("stop", [f"s{i}" for i in range(65)], "max_stop=64"),
        ("stop", ["x" * 4097], "max_stop_bytes=4096"),
    ],
)
async def test_long_stop_and_bad_words_lists_are_refused(field: str, value: list[str], limit: str) -> None:
    async with serving() as (_, http, tokenizer):
        for path, body in [
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [_user("hi")]}),
        ]:
            error = error_of(await http.post(path, json={**body, field: value}))
            assert error["param"] == field and limit in error["message"]
            assert f"--{limit.split('=')[0].replace('_', '-')}" in error["message"]
            if path == "/v1/completions":
                assert tokenizer.encoded_chars == 0  # refused before tokenizing (chat renders the messages first)
        await still_serving(http)


async def test_the_openai_client_sees_a_bad_request_naming_the_param() -> None:
    async with serving() as (app, _, _tokenizer):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http_client:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http_client)
            with pytest.raises(openai.BadRequestError, match="max_top_logprobs") as raised:
                await client.chat.completions.create(
                    model="tiny", messages=[_user("hi")], logprobs=True, top_logprobs=49152
                )
            assert raised.value.param == "top_logprobs"
            with pytest.raises(openai.BadRequestError, match="max_choices") as many:
                await client.completions.create(model="tiny", prompt=["x"] * 5000, n=64)
            assert many.value.param == "prompt"
            ok = await client.completions.create(model="tiny", prompt="hi", max_tokens=2)
            assert ok.choices[0].text == "Hi"


# -- a heavy request does not stall the others ---------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_other_streams_run_while_a_long_prompt_is_admitted(path: str) -> None:
    """The long prompt's tokenizing waits for a gate that opens only once another stream has got
    three chunks after the request was sent: held on the event loop, it would never open."""
    loop_thread = threading.get_ident()
    async with serving() as (app, http, tokenizer):
        other = app.engine.stream("other", SamplingParams(max_tokens=1000, ignore_eos=True))
        chunks = 0
        sent_at: int | None = None

        async def read_other() -> None:
            nonlocal chunks
            async with other:
                async for _ in other:
                    chunks += 1
                    if sent_at is not None and chunks >= sent_at + 3:
                        tokenizer.gate.set()

        prompt = "GATE" + "x" * THREAD_MIN_CHARS
        body: dict[str, Any] = {"max_tokens": 2}
        body.update({"prompt": prompt} if path == "/v1/completions" else {"messages": [_user(prompt)]})
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(read_other)
            sent_at = chunks
            response = await http.post(path, json=body)
            task_group.cancel_scope.cancel()
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
        assert tokenizer.gated_threads and loop_thread not in tokenizer.gated_threads
        await still_serving(http)


def test_heavy_requests_benchmark_quick(tiny_llama: Path, tmp_path: Path) -> None:
    """benchmarks/heavy_requests.py runs end to end; its reproducers are refused and the rest served."""
    spec = importlib.util.spec_from_file_location("asyncllm_bench_heavy_requests", BENCHMARKS / "heavy_requests.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    out = tmp_path / "rows.json"
    assert module.main(["--quick", "--model", str(tiny_llama), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [row["status"] for row in rows] == [400, 400, 400, 400, 200, 200, 400, 200]
    assert [row["param"] for row in rows[:4]] == ["prompt", "top_logprobs", "prompt", "bad_words"]


def test_asyncllm_serve_takes_the_limits_as_flags() -> None:
    from asyncllm.cli import _ENGINE_PREFIX, build_parser
    flags = ["--max-choices", "8", "--max-completion-logprobs", "2", "--max-top-logprobs", "3"]
    engine_flags = ["--max-logprobs", "4", "--max-prompt-bytes", "1000", "--max-stop", "5", "--max-bad-words", "6"]
    args = build_parser().parse_args(["serve", *flags, *engine_flags, "--max-waiting-requests", "7"])
    assert (args.max_choices, args.max_completion_logprobs, args.max_top_logprobs) == (8, 2, 3)
    engine = {k.removeprefix(_ENGINE_PREFIX): v for k, v in vars(args).items() if k.startswith(_ENGINE_PREFIX)}
    assert engine["max_logprobs"] == 4 and engine["max_prompt_bytes"] == 1000
    assert (engine["max_stop"], engine["max_bad_words"], engine["max_waiting_requests"]) == (5, 6, 7)
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.max_choices, defaults.max_completion_logprobs, defaults.max_top_logprobs) == (
        DEFAULT_MAX_CHOICES,
        DEFAULT_MAX_COMPLETION_LOGPROBS,
        DEFAULT_MAX_TOP_LOGPROBS,
    )
