"""Review of tools on the chat endpoint: input that used to be a 500."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from asyncllm import Engine
from asyncllm.http import create_app

pytestmark = pytest.mark.anyio

MESSAGES: list[Any] = [{"role": "user", "content": "What time is it?"}]
# Deep enough to exhaust Python's recursion when walked, shallow enough for the body's decoder.
DEEP_SCHEMA = json.loads('{"type": "object", "properties": {"a": ' * 300 + "{}" + "}}" * 300)
DEEP_ARGUMENTS = json.loads('{"a": ' * 600 + "{}" + "}" * 600)


def _history(arguments: Any) -> list[Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP_SCHEMA}}]}, "tools",
         "schema_too_deep"),
        ({"messages": _history(DEEP_ARGUMENTS)}, "messages", "invalid_request"),
    ],
)
async def test_deeply_nested_tool_json_is_a_400(
    asyncllm_engine: Engine, extra: dict[str, Any], param: str, code: str
) -> None:
    transport = httpx.ASGITransport(app=create_app(asyncllm_engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        response = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error
        # Arguments given as JSON text that nests too deeply are rendered as the text they are.
        text = "[" * 70 + "]" * 70
        ok = await http.post("/v1/chat/completions", json={"messages": _history(text), "max_tokens": 2})
        assert ok.status_code == 200, ok.text
