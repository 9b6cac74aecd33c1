"""The OpenAI-compatible ASGI app, through httpx's ASGITransport (and raw ASGI where httpx cannot go).

Most tests use the plugin's ``scripted_engine`` (a real Engine over a scripted runner: exact,
fast); the chat template tests use the tiny model's real HF tokenizer.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from asyncllm import Engine, SamplingParams
from asyncllm import errors as asyncllm_errors
from asyncllm.http import create_app
from asyncllm.http._app import OpenAIApp, error_for
from asyncllm.testing import EOS_ID, ByteTokenizer, ScriptedRunner

pytestmark = pytest.mark.anyio

SCRIPT_TEXT = "Hello from the scripted engine!"  # the plugin's default script, then EOS


@asynccontextmanager
async def client(app: OpenAIApp, **headers: str) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers) as http:
        yield http


def sse(response: httpx.Response) -> list[Any]:
    """The data of each server-sent event (``"[DONE]"`` as is, the rest parsed)."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


class ChatByteTokenizer(ByteTokenizer):
    """A ByteTokenizer with a (trivial) chat template, so chat runs on the scripted engine."""

    chat_template = "<role>content\\n per message"

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> dict[str, list[int]]:
        assert kwargs == {"add_generation_prompt": True, "tokenize": True, "return_dict": True}
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return {"input_ids": self.encode(text)}


@pytest.fixture
async def chat_engine() -> AsyncIterator[Engine]:
    runner = ScriptedRunner([*b"Bonjour!", EOS_ID], max_model_len=256)
    async with Engine.open(runner=runner, tokenizer=ChatByteTokenizer()) as engine:
        yield engine


# -- models, health ------------------------------------------------------------------------------


async def test_models_lists_the_served_model(scripted_engine: Engine) -> None:
    app = create_app(scripted_engine, model_name="scripted")
    async with client(app) as http:
        listing = (await http.get("/v1/models")).json()
        one = await http.get("/v1/models/scripted")
        missing = await http.get("/v1/models/other")
        unprefixed = await http.get("/models")  # the app can be mounted at /v1
    assert listing["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in listing["data"]] == [("scripted", "model", 2048)]
    assert one.status_code == 200 and one.json()["id"] == "scripted"
    assert error_of(missing, 404)["code"] == "model_not_found"
    assert unprefixed.json() == listing


async def test_model_name_defaults_to_the_folder_name(asyncllm_engine: Engine, asyncllm_model_path: Path) -> None:
    app = create_app(asyncllm_engine)
    assert app.model_name == asyncllm_model_path.name
    async with client(app) as http:
        by_path = await http.post("/v1/completions", json={"model": str(asyncllm_model_path), "prompt": "hi"})
    assert by_path.status_code == 200 and by_path.json()["model"] == asyncllm_model_path.name


async def test_health_is_ok_while_running_and_503_after(scripted_engine: Engine) -> None:
    engine = Engine.open(runner=ScriptedRunner([1]), tokenizer=ByteTokenizer())
    app = create_app(engine)
    async with client(app) as http:
        before = await http.get("/health")
        async with engine:
            running = await http.get("/health")
        after = await http.get("/health")
    assert error_of(before, 503)["code"] == "engine_closed"
    assert running.status_code == 200 and running.json() == {"status": "ok"}
    assert error_of(after, 503)["code"] == "engine_closed"


# -- completions ---------------------------------------------------------------------------------


async def test_completion_text_usage_and_finish_reasons(scripted_engine: Engine) -> None:
    app = create_app(scripted_engine)
    async with client(app) as http:
        short = (await http.post("/v1/completions", json={"prompt": "hey", "max_tokens": 5})).json()
        whole = (await http.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 100})).json()
    assert short["object"] == "text_completion" and short["id"].startswith("cmpl-")
    assert short["choices"] == [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}]
    assert short["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 5,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert whole["choices"][0]["text"] == SCRIPT_TEXT
    assert whole["choices"][0]["finish_reason"] == "stop"  # the script's EOS
    assert whole["usage"]["completion_tokens"] == len(SCRIPT_TEXT) + 1  # the EOS counts


async def test_completion_default_max_tokens_is_16(scripted_engine: Engine) -> None:
    async with client(create_app(scripted_engine)) as http:
        body = (await http.post("/v1/completions", json={"prompt": "hey"})).json()
    assert body["choices"][0]["text"] == SCRIPT_TEXT[:16]


async def test_streamed_completion_matches_and_ends_with_done(scripted_engine: Engine) -> None:
    request = {"prompt": "hey", "max_tokens": 100, "stream": True, "stream_options": {"include_usage": True}}
    async with client(create_app(scripted_engine)) as http:
        response = await http.post("/v1/completions", json=request)
    events = sse(response)
    assert events[-1] == "[DONE]"
    *chunks, usage = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == SCRIPT_TEXT
    assert {c["id"] for c in events[:-1]} == {usage["id"]}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 32,
        "total_tokens": 35,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_batched_prompts_give_one_choice_each(scripted_engine: Engine) -> None:
    async with client(create_app(scripted_engine)) as http:
        texts = (await http.post("/v1/completions", json={"prompt": ["a", "bb", "ccc"], "max_tokens": 2})).json()
        ids = (await http.post("/v1/completions", json={"prompt": [[97], [98, 98]], "max_tokens": 3})).json()
        streamed = sse(await http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 4, "stream": True}))
    assert [(c["index"], c["text"]) for c in texts["choices"]] == [(0, "He"), (1, "He"), (2, "He")]
    assert texts["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 6,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert [c["text"] for c in ids["choices"]] == ["Hel", "Hel"]
    by_index: dict[int, str] = {0: "", 1: ""}
    for event in streamed[:-1]:
        (choice,) = event["choices"]
        by_index[choice["index"]] += choice["text"]
    assert by_index == {0: "Hell", 1: "Hell"} and streamed[-1] == "[DONE]"


async def test_seed_and_engine_extensions_are_passed_on(scripted_engine: Engine) -> None:
    request = {"prompt": "x", "max_tokens": 40, "seed": 3, "temperature": 0.5, "top_p": 0.9, "ignore_eos": True}
    async with client(create_app(scripted_engine)) as http:
        body = (await http.post("/v1/completions", json=request)).json()
    # ignore_eos: past the script's EOS it starts over, to max_tokens.
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 40


async def test_cache_salt_separates_prefix_cache_entries(scripted_engine: Engine) -> None:
    prompt = "p" * 64  # four full blocks of 16 tokens

    async def hits_after(salt: str) -> int:
        before = scripted_engine.statistics().prefix_cache_hits
        body = {"prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        return scripted_engine.statistics().prefix_cache_hits - before

    async with client(create_app(scripted_engine)) as http:
        assert await hits_after("tenant-a") == 0
        assert await hits_after("tenant-b") == 0  # same prompt, another tenant: nothing shared
        assert await hits_after("tenant-a") > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("suffix", "tail"), ("best_of", 3)],
)
async def test_what_the_engine_cannot_do_yet_is_a_clean_400(scripted_engine: Engine, field: str, value: Any) -> None:
    if field in SamplingParams.__struct_fields__:
        pytest.skip(f"the engine supports {field} now")
    async with client(create_app(scripted_engine)) as http:
        response = await http.post("/v1/completions", json={"prompt": "x", field: value})
    error = error_of(response, 400)
    assert "not supported yet" in error["message"] and error["code"] == "unsupported_parameter"
    assert error["param"] == field


@pytest.mark.parametrize("chat", [False, True])
async def test_sampling_fields_reach_the_engine(scripted_runner: ScriptedRunner, chat: bool) -> None:
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "min_tokens": 2,
        "top_k": 5,
        "logit_bias": {"104": 3.0},
        "bad_words": ["zz"],
        "allowed_token_ids": [104, 105, 256],
        "stop_token_ids": [7],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
    }
    missing = set(fields) - set(SamplingParams.__struct_fields__)
    if missing:
        pytest.skip(f"the engine lacks {sorted(missing)} yet")
    prompt: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    async with Engine.open(runner=scripted_runner, tokenizer=ChatByteTokenizer()) as engine:
        async with client(create_app(engine)) as http:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            response = await http.post(path, json={**prompt, "max_tokens": 3, "seed": 9, **fields})
    assert response.status_code == 200, response.text
    params = scripted_runner.steps[0].sequences[0].params
    expected = {**fields, "logit_bias": {104: 3.0}, "seed": 9, "max_tokens": 3}
    for name, value in expected.items():
        got = getattr(params, name)
        assert (list(got) if isinstance(got, tuple) else got) == value, name


async def test_neutral_values_of_unsupported_fields_are_fine(scripted_engine: Engine) -> None:
    neutral = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}, "stop": [], "user": "u"}
    async with client(create_app(scripted_engine)) as http:
        response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **neutral})
    assert response.status_code == 200, response.text


async def test_stop_strings_end_the_completion_or_are_refused(scripted_engine: Engine) -> None:
    async with client(create_app(scripted_engine)) as http:
        response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "stop": ["from"]})
    if "stop" not in SamplingParams.__struct_fields__:
        assert error_of(response, 400)["param"] == "stop"
    else:
        choice = response.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("Hello ", "stop")


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [300]}, "prompt"),  # outside the byte vocabulary
        ({"prompt": "x", "max_tokens": 5000}, "prompt"),  # beyond max_model_len
        ({}, "prompt"),
    ],
)
async def test_bad_parameters_are_400_naming_the_field(scripted_engine: Engine, body: Any, param: str) -> None:
    async with client(create_app(scripted_engine)) as http:
        response = await http.post("/v1/completions", json=body)
    error = error_of(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert scripted_engine.statistics().num_waiting == 0  # nothing was queued


async def test_unknown_fields_are_ignored_and_nulls_are_defaults(
    scripted_engine: Engine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncllm.http import _protocol

    monkeypatch.setattr(_protocol, "_logged_unknown", set())  # names are logged once per process
    # What newer SDKs and frameworks send: fields this server does not use, and explicit nulls.
    extra = {"store": False, "metadata": {"a": "b"}, "service_tier": "auto", "reasoning_effort": "low",
             "modalities": ["text"], "prediction": None, "user": "u-1"}  # fmt: skip
    nulls = {"n": None, "stream": None, "logprobs": None, "stop": None, "seed": None, "temperature": None,
             "top_p": None, "stream_options": None, "max_tokens": None, "presence_penalty": None}  # fmt: skip
    async with client(create_app(scripted_engine)) as http:
        with caplog.at_level("INFO", logger="asyncllm"):
            for _ in range(2):
                response = await http.post("/v1/completions", json={"prompt": "x", **extra, **nulls})
                assert response.status_code == 200, response.text
                assert len(response.json()["choices"]) == 1
            streamed = await http.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 3, **extra, "stream": True,
                      "stream_options": {"include_usage": None, "continuous_usage_stats": None, "other": 1}},
            )  # fmt: skip
            assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
    logged = [r.getMessage() for r in caplog.records if "ignoring the request field" in r.getMessage()]
    assert sorted(logged) == sorted(set(logged))  # each name once
    assert any("'store'" in line for line in logged) and any("'service_tier'" in line for line in logged)


async def test_malformed_json_unknown_model_route_and_method(scripted_engine: Engine) -> None:
    async with client(create_app(scripted_engine, model_name="m"), **{"content-type": "application/json"}) as http:
        not_json = await http.post("/v1/completions", content=b"{nope")
        empty = await http.post("/v1/completions", content=b"")
        model = await http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
        route = await http.get("/v1/no-such-route")
        method = await http.get("/v1/completions")
    assert error_of(not_json, 400)["code"] == "invalid_json"
    assert error_of(empty, 400)["code"] == "invalid_json"
    assert error_of(model, 404)["param"] == "model"
    assert error_of(route, 404)["code"] == "not_found"
    assert error_of(method, 405) and method.headers["allow"] == "POST"


async def test_body_size_limit_is_413(scripted_engine: Engine) -> None:
    app = create_app(scripted_engine, max_body_bytes=100)
    big = {"prompt": "x" * 200}

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies as it arrives
        for _ in range(10):
            yield b'{"prompt": "' + b"y" * 20

    async with client(app) as http:
        declared = await http.post("/v1/completions", json=big)
        streamed = await http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        small = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert error_of(declared, 413)["code"] == "request_too_large"
    assert error_of(streamed, 413)["code"] == "request_too_large"
    assert small.status_code == 200


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b'{"a":' * 100_000,
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": "x", "logit_bias": ' + b'{"1":' * 100_000 + b"1" + b"}" * 100_001,
        b'{"prompt": [' + b'{"a":' * 100_000,
    ],
    ids=["arrays", "objects", "prompt", "logit_bias", "unclosed"],
)
async def test_json_nested_too_deep_is_400_not_500(scripted_engine: Engine, raw: bytes) -> None:
    async with client(create_app(scripted_engine), **{"content-type": "application/json"}) as http:
        completion = await http.post("/v1/completions", content=raw)
        chat = await http.post("/v1/chat/completions", content=raw.replace(b'"prompt"', b'"messages"'))
        after = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert error_of(completion, 400)["code"] in ("invalid_json", "invalid_parameter")
    assert error_of(chat, 400)["code"] in ("invalid_json", "invalid_parameter")
    assert after.status_code == 200


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ],
)
async def test_bodies_not_declared_json_are_415(scripted_engine: Engine, content_type: str | None) -> None:
    # What a web page may send to any origin without a CORS preflight (a Blob body has no type).
    headers = {} if content_type is None else {"content-type": content_type}
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    async with client(create_app(scripted_engine)) as http:
        response = await http.post("/v1/completions", content=body, headers=headers)
    error = error_of(response, 415)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert scripted_engine.statistics().num_waiting == scripted_engine.statistics().num_running == 0


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
async def test_json_content_types_are_accepted(scripted_engine: Engine, content_type: str) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    async with client(create_app(scripted_engine)) as http:
        response = await http.post("/v1/completions", content=body, headers={"content-type": content_type})
    assert response.status_code == 200, response.text


async def test_cors_is_off_by_default_but_options_is_answered(scripted_engine: Engine) -> None:
    preflight = {
        "origin": "https://evil.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    async with client(create_app(scripted_engine, api_key="k")) as http:
        options = await http.options("/v1/chat/completions", headers=preflight)
        missing = await http.options("/v1/nothing", headers=preflight)
        simple = await http.get("/health", headers={"origin": "https://evil.example"})
    assert options.status_code == 204 and options.headers["allow"] == "OPTIONS, POST"
    assert not [name for name in options.headers if name.startswith("access-control-")]
    assert missing.status_code == 404
    assert "access-control-allow-origin" not in simple.headers


async def test_cors_origins_are_granted_and_others_not(scripted_engine: Engine) -> None:
    app = create_app(scripted_engine, api_key="k", cors_origins=["https://app.example", "http://localhost:3000/"])
    asks = {"access-control-request-method": "POST", "access-control-request-headers": "authorization, x-stainless-os"}
    async with client(app) as http:
        granted = await http.options("/v1/completions", headers={"origin": "https://app.example", **asks})
        local = await http.options("/completions", headers={"origin": "http://localhost:3000", **asks})
        other = await http.options("/v1/completions", headers={"origin": "https://evil.example", **asks})
        answer = await http.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"origin": "https://app.example", "authorization": "Bearer k"},
        )
        refused = await http.get("/v1/models", headers={"origin": "https://evil.example", "authorization": "Bearer k"})
        unauthorized = await http.get("/v1/models", headers={"origin": "https://app.example"})
    assert granted.status_code == 204
    assert granted.headers["access-control-allow-origin"] == "https://app.example"
    assert granted.headers["access-control-allow-methods"] == "OPTIONS, POST"
    assert granted.headers["access-control-allow-headers"] == "authorization, x-stainless-os"
    assert granted.headers["vary"] == "origin" and int(granted.headers["access-control-max-age"]) > 0
    assert local.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert other.status_code == 204 and "access-control-allow-origin" not in other.headers
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example"
    assert refused.status_code == 200 and "access-control-allow-origin" not in refused.headers
    # Errors carry the header too, so the page can read why.
    assert error_of(unauthorized, 401) and unauthorized.headers["access-control-allow-origin"] == "https://app.example"


async def test_cors_any_origin(scripted_engine: Engine) -> None:
    app = create_app(scripted_engine, cors_origins=["*"])
    async with client(app) as http:
        response = await http.get("/v1/models", headers={"origin": "https://anyone.example"})
    assert response.headers["access-control-allow-origin"] == "https://anyone.example"


async def test_api_key_guards_v1_but_not_health_and_metrics(scripted_engine: Engine) -> None:
    app = create_app(scripted_engine, api_key="sesame")
    request = {"prompt": "x", "max_tokens": 1}
    async with client(app) as anonymous, client(app, authorization="Bearer wrong") as wrong:
        missing = await anonymous.post("/v1/completions", json=request)
        bad = await wrong.get("/v1/models")
        health = await anonymous.get("/health")
        metrics = await anonymous.get("/metrics")
    async with client(app, authorization="Bearer sesame") as right:
        ok = await right.post("/v1/completions", json=request)
    assert error_of(missing, 401)["code"] == "invalid_api_key" and missing.headers["www-authenticate"] == "Bearer"
    assert error_of(bad, 401)["code"] == "invalid_api_key"
    assert health.status_code == metrics.status_code == ok.status_code == 200


async def test_a_dead_engine_answers_503() -> None:
    runner = ScriptedRunner([104], fail_at_step=0)
    with pytest.raises(asyncllm_errors.EngineDeadError):
        async with Engine.open(runner=runner, tokenizer=ByteTokenizer()) as engine:
            async with client(create_app(engine)) as http:
                first = await http.post("/v1/completions", json={"prompt": "x"})
                streamed = await http.post("/v1/completions", json={"prompt": "x", "stream": True})
                health = await http.get("/health")
    assert error_of(first, 503)["type"] == "server_error"
    assert error_of(streamed, 503)["code"] == "engine_dead"  # refused before the stream started
    assert error_of(health, 503)["code"] == "engine_dead"


async def test_an_error_mid_stream_is_the_last_event() -> None:
    runner = ScriptedRunner([104], fail_at_step=3)
    with pytest.raises(asyncllm_errors.EngineDeadError):
        async with Engine.open(runner=runner, tokenizer=ByteTokenizer()) as engine:
            async with client(create_app(engine)) as http:
                response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 9, "stream": True})
    events = sse(response)
    assert response.status_code == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_dead"
    text = "".join(e["choices"][0]["text"] for e in events[:-2])  # what the steps before the failure made
    assert set(text) == {"h"} and 0 < len(text) < 9


async def test_a_hung_step_turns_health_503_after_step_timeout() -> None:
    release = threading.Event()

    class Hanging(ScriptedRunner):
        def execute(self, batch):  # type: ignore[no-untyped-def]
            if len(self.steps) == 2:
                release.wait()
            return super().execute(batch)

    try:
        with pytest.raises(asyncllm_errors.DeviceStepTimeoutError):
            async with Engine.open(runner=Hanging([104]), tokenizer=ByteTokenizer(), step_timeout=0.5) as engine:
                async with client(create_app(engine)) as http:
                    response = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 9, "stream": True})
                    health = await http.get("/health")
    finally:
        release.set()
    events = sse(response)
    assert events[-2]["error"]["code"] == "engine_dead" and "step_timeout" in events[-2]["error"]["message"]
    assert error_of(health, 503)["code"] == "engine_dead"


async def test_a_request_that_fails_alone_is_a_500_and_the_others_are_served() -> None:
    class Fragile(ByteTokenizer):
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            if 7 in token_ids:
                raise RuntimeError("tokenizer bug")
            return super().decode(token_ids, skip_special_tokens)

    def script(seq: Any) -> int:
        return 7 if seq.prompt_token_ids[0] == ord("!") else 104

    async with Engine.open(runner=ScriptedRunner(script), tokenizer=Fragile()) as engine:
        async with client(create_app(engine)) as http:
            failed = await http.post("/v1/completions", json={"prompt": "!x", "max_tokens": 3})
            served = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            health = await http.get("/health")
    assert error_of(failed, 500)["code"] == "request_failed"
    assert served.json()["choices"][0]["text"] == "hhh"
    assert health.status_code == 200


def test_error_translation() -> None:
    overloaded = getattr(asyncllm_errors, "EngineOverloadedError", None)
    if overloaded is not None:
        error = error_for(overloaded("queue full"))
        assert (error.status, error.body.error.code, error.headers) == (
            503,
            "engine_overloaded",
            ((b"retry-after", b"1"),),
        )
    assert error_for(asyncllm_errors.EngineClosedError("x")).status == 503
    assert error_for(asyncllm_errors.PromptTooLongError("prompt too long")).status == 400
    assert error_for(ValueError("max_tokens must be >= 1")).body.error.param == "max_tokens"
    unexpected = error_for(KeyError("boom"))
    assert unexpected.status == 500 and "boom" not in unexpected.body.error.message  # no internals leak


async def test_an_overloaded_engine_answers_503_with_retry_after() -> None:
    runner = ScriptedRunner([104])
    engine = Engine.open(runner=runner, tokenizer=ByteTokenizer(), max_num_seqs=1, max_waiting_requests=1)
    busy = SamplingParams(max_tokens=2000, ignore_eos=True)
    async with engine, client(create_app(engine)) as http:
        async with engine.stream("running", busy) as running:
            await running.__anext__()  # it holds the one running slot now
            async with engine.stream("waiting", busy):  # and this one fills the queue
                refused = await http.post("/v1/completions", json={"prompt": "x"})
    error = error_of(refused, 503)
    assert error["code"] == "engine_overloaded" and refused.headers["retry-after"] == "1"


# -- chat ----------------------------------------------------------------------------------------


async def test_chat_renders_messages_with_the_template(chat_engine: Engine) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello.", "refusal": None},  # as clients echo replies back
        {"role": "user", "content": "Bonjour?"},
    ]
    async with client(create_app(chat_engine)) as http:
        body = (await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 50})).json()
    expected_prompt = "<system>Be brief.\n<user>Hi there\n<assistant>Hello.\n<user>Bonjour?\n<assistant>"
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {"index": 0, "message": {"content": "Bonjour!", "role": "assistant"}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"]["prompt_tokens"] == len(expected_prompt.encode())
    assert chat_engine.tokenizer.decode(list(ChatByteTokenizer().encode(expected_prompt))) == expected_prompt


async def test_chat_default_max_tokens_is_the_rest_of_the_context(chat_engine: Engine) -> None:
    request = {"messages": [{"role": "user", "content": "go"}], "ignore_eos": True}
    async with client(create_app(chat_engine)) as http:
        body = (await http.post("/v1/chat/completions", json=request)).json()
        full = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 250}]})
    assert body["usage"]["total_tokens"] == chat_engine.max_model_len == 256
    assert body["choices"][0]["finish_reason"] == "length"
    assert error_of(full, 400)["param"] == "messages"


async def test_streamed_chat_starts_with_the_role_and_ends_with_done(chat_engine: Engine) -> None:
    request = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client(create_app(chat_engine)) as http:
        events = sse(await http.post("/v1/chat/completions", json=request))
    assert events[-1] == "[DONE]"
    first, *chunks, usage = events[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Bonj"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
        ({"messages": []}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ],
)
async def test_chat_refusals(chat_engine: Engine, extra: dict[str, Any], param: str | None) -> None:
    if param in SamplingParams.__struct_fields__:
        pytest.skip(f"the engine supports {param} now")
    request = {"messages": [{"role": "user", "content": "hi"}], **extra}
    async with client(create_app(chat_engine)) as http:
        error = error_of(await http.post("/v1/chat/completions", json=request), 400)
    if param is not None:
        assert error["param"] == param
    else:
        assert error["param"] == "messages[0].content" and "image_url" in error["message"]


async def test_chat_without_a_template_is_400(scripted_engine: Engine) -> None:
    async with client(create_app(scripted_engine)) as http:
        response = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert "no chat template" in error_of(response, 400)["message"]


async def test_chat_on_a_real_template(asyncllm_engine: Engine) -> None:
    messages = [{"role": "user", "content": "hello"}]
    request = {"messages": messages, "max_tokens": 6, "temperature": 0}
    async with client(create_app(asyncllm_engine)) as http:
        body = (await http.post("/v1/chat/completions", json=request)).json()
        events = sse(await http.post("/v1/chat/completions", json={**request, "stream": True}))
    expected = await asyncllm_engine.chat(messages, SamplingParams(max_tokens=6, temperature=0.0))
    assert body["choices"][0]["message"]["content"] == expected.text
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == expected.text


# -- disconnects ---------------------------------------------------------------------------------


def _scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }


async def _run_until_disconnect(app: OpenAIApp, path: str, body: dict[str, Any], after_events: int) -> list[Any]:
    """Drive the app as a server would; the client 'disconnects' after ``after_events`` body messages."""
    disconnect = anyio.Event()
    received_body = False
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        nonlocal received_body
        if not received_body:
            received_body = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= after_events:
            disconnect.set()

    if after_events == 0:
        disconnect.set()
    with anyio.fail_after(30):
        await app(_scope(path), receive, send)
    return sent


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_disconnect_mid_stream_aborts_and_frees_the_blocks(chat_engine: Engine, path: str) -> None:
    app = create_app(chat_engine)
    body: dict[str, Any] = {"max_tokens": 200, "ignore_eos": True, "stream": True}
    body |= {"prompt": "x" * 40} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    sent = await _run_until_disconnect(app, path, body, after_events=3)
    assert sent[0]["status"] == 200 and sent[-1].get("more_body") is True  # never finished
    # One more request: the engine applies queued aborts before it schedules anything.
    await chat_engine.generate("y", SamplingParams(max_tokens=1))
    stats = chat_engine.statistics()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert chat_engine.metrics.finished_requests["abort"] == 1


async def test_disconnect_aborts_every_prompt_of_a_batch(scripted_engine: Engine) -> None:
    body = {"prompt": ["a", "b", "c"], "max_tokens": 500, "ignore_eos": True, "stream": True}
    await _run_until_disconnect(create_app(scripted_engine), "/v1/completions", body, after_events=4)
    await scripted_engine.generate("y", SamplingParams(max_tokens=1))
    assert scripted_engine.metrics.finished_requests["abort"] == 3
    stats = scripted_engine.statistics()
    assert stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total


async def test_an_error_in_one_prompt_of_a_batch_is_answered_unwrapped() -> None:
    runner = ScriptedRunner([104], fail_at_step=2)
    with pytest.raises(asyncllm_errors.EngineDeadError):
        async with Engine.open(runner=runner, tokenizer=ByteTokenizer()) as engine:
            async with client(create_app(engine)) as http:
                whole = await http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 9})
    assert error_of(whole, 503)["code"] == "engine_dead"


async def test_disconnect_while_waiting_for_a_whole_completion_aborts(scripted_engine: Engine) -> None:
    app = create_app(scripted_engine)
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True}
    sent = await _run_until_disconnect(app, "/v1/completions", body, after_events=0)
    assert sent == []  # nobody to answer
    await scripted_engine.generate("y", SamplingParams(max_tokens=1))
    assert scripted_engine.metrics.finished_requests["abort"] == 1
    assert scripted_engine.statistics().kv_blocks_free == scripted_engine.statistics().kv_blocks_total


# -- metrics -------------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_]+="[^"]*"(,[a-zA-Z_]+="[^"]*")*\})? (\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Check the exposition format line by line; return {name{labels}: value}."""
    assert text.endswith("\n")
    samples: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif not line.startswith("# HELP "):
            match = _SAMPLE.match(line)
            assert match, line
            base = re.sub("_(bucket|sum|count)$", "", match.group(1))
            assert match.group(1) in types or base in types, line
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(4))
    return samples


async def test_metrics_in_prometheus_text_format(scripted_engine: Engine) -> None:
    app = create_app(scripted_engine)
    async with client(app) as http:
        for max_tokens in (3, 5):
            await http.post("/v1/completions", json={"prompt": "abcd", "max_tokens": max_tokens})
        response = await http.get("/metrics")
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples = parse_metrics(response.text)
    for histogram in ("queue_time", "time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        name = f"asyncllm_{histogram}_seconds" if histogram != "queue_time" else "asyncllm_request_queue_time_seconds"
        buckets = [v for k, v in samples.items() if k.startswith(f"{name}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == samples[f"{name}_count"]
        assert samples[f'{name}_bucket{{le="+Inf"}}'] == samples[f"{name}_count"]
    assert samples["asyncllm_time_to_first_token_seconds_count"] == 2
    assert samples["asyncllm_e2e_request_latency_seconds_count"] == 2
    assert samples["asyncllm_inter_token_latency_seconds_count"] == 2 + 4  # tokens after the first
    assert samples["asyncllm_generation_tokens_total"] == 8
    assert samples["asyncllm_prompt_tokens_total"] == 8
    assert samples['asyncllm_request_finished_total{reason="length"}'] == 2
    assert samples['asyncllm_request_finished_total{reason="abort"}'] == 0
    assert samples["asyncllm_num_requests_running"] == samples["asyncllm_num_requests_waiting"] == 0
    assert samples["asyncllm_kv_cache_blocks_free"] == samples["asyncllm_kv_cache_blocks_total"] == 256
    assert samples["asyncllm_kv_cache_usage_ratio"] == 0.0
    parts = ("schedule", "prepare", "output", "device_prepare", "device_forward", "device_sample", "device_idle")
    for part in parts:  # the scripted runner keeps no timings of its own: its device parts are 0
        assert samples[f'asyncllm_step_seconds_total{{part="{part}"}}'] >= 0
    assert samples['asyncllm_step_seconds_total{part="schedule"}'] > 0
    if hasattr(scripted_engine.statistics(), "prefix_cache_queries"):
        assert samples["asyncllm_prefix_cache_queries_total"] >= samples["asyncllm_prefix_cache_hits_total"] >= 0


# -- lifespan ------------------------------------------------------------------------------------


async def _lifespan(app: OpenAIApp, body: Any) -> list[str]:
    """Run the app's lifespan around ``body(app)``, as a server does; return the lifespan replies."""
    to_app_send, to_app = anyio.create_memory_object_stream[dict[str, Any]](10)
    replies: list[str] = []
    started = anyio.Event()

    async def send(message: Any) -> None:
        replies.append(message["type"])
        started.set()

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(app, {"type": "lifespan", "asgi": {"version": "3.0"}}, to_app.receive, send)
        await to_app_send.send({"type": "lifespan.startup"})
        await started.wait()
        if replies == ["lifespan.startup.complete"]:
            await body(app)
        await to_app_send.send({"type": "lifespan.shutdown"})
    return replies


async def test_served_alone_the_app_enters_a_fresh_engine_in_its_lifespan() -> None:
    engine = Engine.open(runner=ScriptedRunner([*b"ok", EOS_ID]), tokenizer=ByteTokenizer())

    async def use(app: OpenAIApp) -> None:
        async with client(app) as http:
            body = (await http.post("/v1/completions", json={"prompt": "x"})).json()
        assert body["choices"][0]["text"] == "ok"

    replies = await _lifespan(create_app(engine), use)
    assert replies == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    with pytest.raises(asyncllm_errors.EngineClosedError):
        engine.check_health()  # left at shutdown


async def test_the_lifespan_leaves_a_running_engine_alone(scripted_engine: Engine) -> None:
    async def nothing(app: OpenAIApp) -> None:
        pass

    assert await _lifespan(create_app(scripted_engine), nothing) == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    scripted_engine.check_health()  # still running


async def test_a_lifespan_that_cannot_start_the_engine_fails_startup(scripted_engine: Engine) -> None:
    engine = Engine.open(runner=ScriptedRunner([1]), tokenizer=ByteTokenizer())
    async with engine:
        pass  # entered and left: it cannot be entered again

    async def never(app: OpenAIApp) -> None:
        raise AssertionError("startup failed; no requests")

    assert await _lifespan(create_app(engine), never) == ["lifespan.startup.failed"]


def test_create_app_checks_its_arguments() -> None:
    engine = Engine.open(runner=ScriptedRunner([1]), tokenizer=ByteTokenizer())
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(engine, max_body_bytes=0)
    with pytest.raises(ValueError, match="api_key"):
        create_app(engine, api_key="")
    with pytest.raises(ValueError, match="body_timeout"):
        create_app(engine, body_timeout=0)
    with pytest.raises(ValueError, match="body_timeout"):
        create_app(engine, body_timeout=float("nan"))
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        create_app(engine, max_concurrent_requests=0)
    with pytest.raises(ValueError, match="cors_origins"):
        create_app(engine, cors_origins=["app.example"])  # no scheme: not an origin
    with pytest.raises(ValueError, match="cors_origins"):
        create_app(engine, cors_origins="https://app.example")  # one string, not a list of origins


# -- logprobs ------------------------------------------------------------------------------------


async def test_completion_logprobs_match_the_engine(asyncllm_engine: Engine) -> None:
    if "logprobs" not in SamplingParams.__struct_fields__:
        pytest.skip("the engine has no logprobs yet")
    expected = await asyncllm_engine.generate("hello", SamplingParams(max_tokens=4, temperature=0.0, logprobs=2))
    request = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    async with client(create_app(asyncllm_engine)) as http:
        whole = (await http.post("/v1/completions", json=request)).json()["choices"][0]["logprobs"]
        events = sse(await http.post("/v1/completions", json={**request, "stream": True}))
    tokens = [entry.token.text for entry in expected.logprobs]
    assert whole["tokens"] == tokens
    assert whole["token_logprobs"] == pytest.approx([entry.token.logprob for entry in expected.logprobs])
    assert whole["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    for top, entry in zip(whole["top_logprobs"], expected.logprobs):
        assert len(top) >= 2 and top[entry.token.text] == pytest.approx(entry.token.logprob)
    streamed = [e["choices"][0]["logprobs"] for e in events[:-1]]
    assert [t for lp in streamed for t in lp["tokens"]] == tokens
    assert [o for lp in streamed for o in lp["text_offset"]] == whole["text_offset"]


async def test_chat_logprobs_match_the_engine(asyncllm_engine: Engine) -> None:
    if "logprobs" not in SamplingParams.__struct_fields__:
        pytest.skip("the engine has no logprobs yet")
    messages = [{"role": "user", "content": "hi"}]
    expected = await asyncllm_engine.chat(messages, SamplingParams(max_tokens=3, temperature=0.0, logprobs=2))
    request = {"messages": messages, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    async with client(create_app(asyncllm_engine)) as http:
        content = (await http.post("/v1/chat/completions", json=request)).json()["choices"][0]["logprobs"]["content"]
        events = sse(await http.post("/v1/chat/completions", json={**request, "stream": True}))
        unasked = await http.post("/v1/chat/completions", json={**request, "logprobs": False, "top_logprobs": None})
    assert [c["token"] for c in content] == [entry.token.text for entry in expected.logprobs]
    # The HTTP request finds the engine's prompt cached: its logits come from attention over cached KV, a
    # different summation order than the first computation's, so they agree to float32 rounding, not bits.
    expected_logprobs = [entry.token.logprob for entry in expected.logprobs]
    assert [c["logprob"] for c in content] == pytest.approx(expected_logprobs, rel=1e-5, abs=1e-5)
    assert all(c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 2 for c in content)
    streamed = [c for e in events[1:-1] for c in (e["choices"][0]["logprobs"] or {"content": []})["content"]]
    assert streamed == content
    assert unasked.json()["choices"][0]["logprobs"] is None
