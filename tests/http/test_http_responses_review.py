"""Review of ``POST /v1/responses``: what a production client hit, over real HTTP (hypercorn on
loopback, asyncio and trio), each event checked against the official client's models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from asyncllm import SamplingParams
from asyncllm.http import create_app
from asyncllm.testing import EOS_ID, import_path

pytestmark = pytest.mark.anyio

# The helpers of the feature's own tests: one real server, one scripted engine, one event checker.
_base = import_path(Path(__file__).with_name("test_http_responses.py"), "asyncllm_tests_http_responses")
serving, scripted, async_client, EVENT = _base.serving, _base.scripted, _base.async_client, _base.EVENT
BOUND_S = _base.BOUND_S
MODEL = "m"


def parse_events(raw: str) -> list[dict[str, Any]]:
    """Each server-sent event's data; every one must be a named Responses event the official client's
    models accept (a chat-style ``data: {"error": ...}`` or ``data: [DONE]`` fails here)."""
    events = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
        (data,) = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert data != "[DONE]", "the Responses API sends no [DONE]"
        event = json.loads(data)
        assert names == [event.get("type")], f"an event without its `event:` line: {block!r}"
        EVENT.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def wait_in_flight(app: Any, count: int) -> None:
    with anyio.fail_after(BOUND_S):  # a bounded poll of the app's state, not a timing assumption
        while app.requests_in_flight != count:
            await anyio.sleep(0.01)


# -- shutdown ------------------------------------------------------------------------------------


async def test_shutdown_ends_a_stream_with_error_then_response_failed(anyio_backend: str) -> None:
    # Was: the chat endpoints' `data: {"error": ...}` (no `event:` line, not a Responses event) then
    # `data: [DONE]`; a client that follows the events by name never saw the response end.
    async with scripted([*b"abc"]) as (engine, _):  # never ends on its own
        app = create_app(engine, model_name=MODEL)
        async with serving(app, anyio_backend) as url:
            async with httpx.AsyncClient(timeout=BOUND_S) as http:
                body = {"input": "go", "max_output_tokens": 1500, "stream": True}
                async with http.stream("POST", f"{url}/v1/responses", json=body) as response:
                    chunks = response.aiter_text()
                    raw = ""
                    while raw.count("response.output_text.delta") < 6:  # the event line and the data's type
                        raw += await chunks.__anext__()
                    await wait_in_flight(app, 1)
                    with anyio.fail_after(BOUND_S):
                        await app.shutdown(0)  # what the server does at SIGTERM
                        raw += "".join([text async for text in chunks])
        await engine.generate("y", SamplingParams(max_tokens=1))  # the engine applies queued aborts first
        stats = engine.statistics()
    events = parse_events(raw)
    *_, error, failed = events
    assert (error["type"], error["code"]) == ("error", "shutting_down")
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas and failed["response"]["output"][0]["content"][0]["text"] == deltas
    assert engine.metrics.finished_requests["abort"] == 1
    assert stats.kv_blocks_free == stats.kv_blocks_total


# -- input ---------------------------------------------------------------------------------------


async def test_max_output_tokens_beyond_the_context_names_max_output_tokens(anyio_backend: str) -> None:
    # Was: param "input" and a message about `max_tokens`, a field this API does not have.
    async with scripted([*b"ok", EOS_ID], max_model_len=256) as (engine, _):
        async with serving(create_app(engine, model_name=MODEL), anyio_backend) as url:
            async with async_client(url) as client:
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.responses.create(model=MODEL, input="hi", max_output_tokens=100_000)
                fits = await client.responses.create(model=MODEL, input="hi", max_output_tokens=200)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "max_output_tokens", error
    assert "max_output_tokens=100000" in error["message"] and "max_tokens=" not in error["message"]
    assert fits.output_text == "ok"


async def test_replayed_output_items_are_accepted(anyio_backend: str) -> None:
    # Was: a 400 for an item with `"type": null` (clients that serialise unset fields send it) and
    # for an assistant message carrying a `refusal` part (OpenAI's output messages may).
    async with scripted([*b"ok", EOS_ID]) as (engine, _):
        tokenizer = engine.tokenizer
        async with serving(create_app(engine, model_name=MODEL), anyio_backend) as url:
            async with async_client(url) as client:
                reply = await client.responses.create(
                    model=MODEL,
                    input=[
                        {"type": None, "role": "user", "content": "Do a bad thing."},
                        {
                            "type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                            "content": [{"type": "refusal", "refusal": "I can't help with that."}],
                        },
                        {"role": "user", "content": "Then say ok."},
                    ],
                )  # fmt: skip
                with pytest.raises(openai.BadRequestError) as caught:  # a refusal is the assistant's alone
                    await client.responses.create(
                        model=MODEL, input=[{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]
                    )
    assert reply.output_text == "ok"
    assert tokenizer.rendered[0] == [
        {"role": "user", "content": "Do a bad thing."},
        {"role": "assistant", "content": "I can't help with that."},
        {"role": "user", "content": "Then say ok."},
    ]
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "input[0].content[0]", error


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"role": ["user"], "content": "x"}, "input[0].role"),
        ({"role": {"name": "user"}, "content": "x"}, "input[0].role"),
        ({"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}, "input[0].content[0]"),
        ({"role": "user", "content": [{"type": {"t": "input_text"}, "text": "x"}]}, "input[0].content[0]"),
    ],
)
async def test_a_role_or_part_type_that_is_not_a_string_is_a_400(
    anyio_backend: str, item: dict[str, Any], param: str
) -> None:
    # Was: a 500 (TypeError: unhashable type), from looking the value up in a dict.
    async with scripted([*b"ok", EOS_ID]) as (engine, _):
        async with serving(create_app(engine, model_name=MODEL), anyio_backend) as url:
            async with httpx.AsyncClient(timeout=BOUND_S) as http:
                response = await http.post(f"{url}/v1/responses", json={"input": [item]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_request"), error


# -- streams -------------------------------------------------------------------------------------


async def test_multibyte_text_streams_whole_characters_next_to_a_stream_that_goes_away(anyio_backend: str) -> None:
    # A guard: one token per byte, so every character is split across tokens; deltas carry whole
    # characters only, and one client leaving mid-stream does not touch the other's stream.
    async with scripted([*"é😀".encode()]) as (engine, _):  # cycles, never ends on its own
        async with serving(create_app(engine, model_name=MODEL), anyio_backend) as url:
            async with async_client(url) as client, httpx.AsyncClient(timeout=BOUND_S) as http:
                leaving = await client.responses.create(model=MODEL, input="go", max_output_tokens=1500, stream=True)
                async for event in leaving:
                    if event.type == "response.output_text.delta":
                        break  # the other stream is running now
                body = {"input": "go", "max_output_tokens": 12, "stream": True}
                async with http.stream("POST", f"{url}/v1/responses", json=body) as response:
                    await leaving.close()
                    raw = "".join([text async for text in response.aiter_text()])
            with anyio.fail_after(BOUND_S):  # a bounded poll of the engine's state, not a timing assumption
                while engine.metrics.finished_requests["abort"] != 1:
                    await anyio.sleep(0.01)
    events = parse_events(raw)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all(d and "\ufffd" not in d for d in deltas)
    *_, text_done, part_done, item_done, final = events
    assert "".join(deltas) == text_done["text"] == "é😀é😀"  # 12 bytes
    assert part_done["part"]["text"] == item_done["item"]["content"][0]["text"] == "é😀é😀"
    assert final["type"] == "response.incomplete" and final["response"]["usage"]["output_tokens"] == 12
