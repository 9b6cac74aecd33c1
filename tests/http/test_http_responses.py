"""``POST /v1/responses`` over real HTTP (hypercorn on loopback, in the test's event loop, asyncio and
trio), driven by the official ``openai`` client, sync and async, on the tiny random model; the exact
prompt, disconnects and failures on a scripted engine whose tokenizer has a trivial chat template."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from asyncllm import Engine, SamplingParams, cli
from asyncllm import errors as asyncllm_errors
from asyncllm.http import OpenAIApp, create_app
from asyncllm.testing import EOS_ID, ByteTokenizer, ScriptedRunner

pytestmark = pytest.mark.anyio

BOUND_S = 60.0  # generous bound on any wait for the server; never a timing assertion
MODEL = "m"
EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@asynccontextmanager
async def serving(app: OpenAIApp, backend: str) -> AsyncIterator[str]:
    """Serve ``app`` as ``asyncllm serve`` does, on a loopback port; yield its base URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(100)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    config = cli._hypercorn_config(
        [f"fd://{listener.detach()}"],
        backend=backend,
        access_log=False,
        graceful_timeout=0.0,
        send_timeout=cli.DEFAULT_SEND_TIMEOUT,
    )
    stop = anyio.Event()
    serve = partial(cli._serve_app, app, config, backend=backend, graceful_timeout=0.0, stop=stop.wait)
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(serve)
        try:
            yield url
        finally:
            stop.set()


def async_client(url: str, api_key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=BOUND_S)


def sync_client(url: str, api_key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=BOUND_S)


def events_of(raw: str) -> list[dict[str, Any]]:
    """Each server-sent event's data, checked against the official client's own (strict) models,
    with its ``event:`` line naming its type; no ``[DONE]``."""
    events = []
    for block in raw.split("\n\n"):
        if block:
            name, data = block.split("\n")
            event = json.loads(data.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            EVENT.validate_python(event)
            events.append(event)
    return events


class RecordingChatTokenizer(ByteTokenizer):
    """A ByteTokenizer with a trivial chat template that records the conversations it renders."""

    chat_template = "<role>content\\n per message"

    def __init__(self) -> None:
        super().__init__()
        self.rendered: list[list[dict[str, Any]]] = []

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> dict[str, list[int]]:
        self.rendered.append([dict(m) for m in messages])
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return {"input_ids": self.encode(text)}


@asynccontextmanager
async def scripted(script: Sequence[int], **options: Any) -> AsyncIterator[tuple[Engine, ScriptedRunner]]:
    runner = ScriptedRunner(script, **options)
    async with Engine.open(runner=runner, tokenizer=RecordingChatTokenizer()) as engine:
        yield engine, runner


# -- whole responses -----------------------------------------------------------------------------


async def test_text_input_sync_and_async_match_engine_chat(asyncllm_engine: Engine, anyio_backend: str) -> None:
    messages = [{"role": "user", "content": "hello"}]
    expected = await asyncllm_engine.chat(messages, SamplingParams(max_tokens=6, temperature=0.0))
    request: dict[str, Any] = {"model": MODEL, "input": "hello", "max_output_tokens": 6, "temperature": 0}
    async with serving(create_app(asyncllm_engine, model_name=MODEL), anyio_backend) as url:
        async with async_client(url) as client:
            reply = await client.responses.create(**request)

        def create_sync() -> Any:
            with sync_client(url) as client:
                return client.responses.create(**request)

        sync_reply = await anyio.to_thread.run_sync(create_sync)
        async with httpx.AsyncClient() as http:
            raw = (await http.post(f"{url}/v1/responses", json=request)).json()
    Response.model_validate(raw)  # every field the client's model requires, strictly typed
    assert reply.output_text == sync_reply.output_text == expected.text
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
    assert reply.status == "incomplete" and reply.incomplete_details is not None  # 6 tokens, no EOS
    assert reply.incomplete_details.reason == "max_output_tokens"
    (item,) = reply.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert item.status == "incomplete"
    assert [(c.type, c.annotations) for c in item.content] == [("output_text", [])]
    assert reply.usage is not None
    assert reply.usage.input_tokens == len(expected.prompt_token_ids)
    assert (reply.usage.output_tokens, reply.usage.total_tokens) == (6, len(expected.prompt_token_ids) + 6)
    # engine.chat() computed the same prompt first: its whole blocks are prefix-cache hits.
    block_size = asyncllm_engine.options.block_size
    assert reply.usage.input_tokens_details.cached_tokens == (reply.usage.input_tokens - 1) // block_size * block_size
    assert reply.usage.output_tokens_details.reasoning_tokens == 0


async def test_instructions_come_first_on_a_real_template(asyncllm_engine: Engine, anyio_backend: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    expected = await asyncllm_engine.chat(messages, SamplingParams(max_tokens=5, temperature=0.0))
    assert list(expected.prompt_token_ids) == asyncllm_engine.apply_chat_template(messages)
    async with serving(create_app(asyncllm_engine, model_name=MODEL), anyio_backend) as url:
        async with async_client(url) as client:
            reply = await client.responses.create(
                model=MODEL, instructions="Be brief.", input="hello", max_output_tokens=5, temperature=0
            )
    assert reply.output_text == expected.text and reply.instructions == "Be brief."
    assert reply.usage is not None and reply.usage.input_tokens == len(expected.prompt_token_ids)


async def test_message_list_with_instructions_is_the_prompt_the_model_sees(anyio_backend: str) -> None:
    async with scripted([*b"Bonjour!", EOS_ID]) as (engine, runner):
        tokenizer = engine.tokenizer
        assert isinstance(tokenizer, RecordingChatTokenizer)
        async with serving(create_app(engine, model_name=MODEL), anyio_backend) as url:
            async with async_client(url) as client:
                reply = await client.responses.create(
                    model=MODEL,
                    instructions="Be brief.",
                    input=[
                        {"role": "user", "content": [{"type": "input_text", "text": t} for t in ("Hi ", "there")]},
                        {
                            "type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                            "content": [{"type": "output_text", "text": "Hello.", "annotations": []}],
                        },
                        {"role": "developer", "content": "Answer in French."},
                        {"role": "user", "content": "Bonjour?"},
                    ],
                    store=True, metadata={"k": "v"}, user="u",  # accepted, ignored: nothing is stored
                )  # fmt: skip
    assert tokenizer.rendered == [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Answer in French."},  # developer is rendered as system
            {"role": "user", "content": "Bonjour?"},
        ]
    ]
    prompt = (
        "<system>Be brief.\n<user>Hi there\n<assistant>Hello.\n<system>Answer in French.\n<user>Bonjour?\n<assistant>"
    )
    assert list(runner.steps[0].sequences[0].prompt_token_ids) == ByteTokenizer().encode(prompt)
    assert reply.status == "completed" and reply.incomplete_details is None and reply.completed_at is not None
    (item,) = reply.output
    assert reply.output_text == "Bonjour!" and item.type == "message" and item.status == "completed"
    assert reply.to_dict()["store"] is False  # nothing was kept, whatever `store` asked
    assert reply.usage is not None and reply.usage.input_tokens == len(prompt)


async def test_text_format_json_schema_constrains_the_output(asyncllm_engine: Engine, anyio_backend: str) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["x", "y"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    async with serving(create_app(asyncllm_engine, model_name=MODEL), anyio_backend) as url:
        async with async_client(url) as client:
            reply = await client.responses.create(
                model=MODEL,
                input="Pick one.",
                max_output_tokens=40,
                temperature=1.0,
                text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
            )
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), schema)


# -- streaming -----------------------------------------------------------------------------------


async def test_streamed_deltas_concatenate_to_the_whole_text(asyncllm_engine: Engine, anyio_backend: str) -> None:
    request: dict[str, Any] = {"model": MODEL, "input": "hello", "max_output_tokens": 8, "temperature": 0}
    async with serving(create_app(asyncllm_engine, model_name=MODEL), anyio_backend) as url:
        async with async_client(url) as client:
            whole = await client.responses.create(**request)
            parsed = [event async for event in await client.responses.create(**request, stream=True)]
        async with httpx.AsyncClient() as http:
            raw = await http.post(f"{url}/v1/responses", json={**request, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = events_of(raw.text)
    kinds = [e["type"] for e in events]
    deltas = kinds[len(STREAM_ORDER) : -len(STREAM_END) - 1]
    assert kinds == [*STREAM_ORDER, *deltas, *STREAM_END, "response.incomplete"]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    # The official client parsed every event (the number of deltas varies: the engine coalesces tokens
    # that a client has not read yet into one chunk).
    parsed_deltas = [e for e in parsed if e.type == "response.output_text.delta"]
    assert [e.type for e in parsed if e not in parsed_deltas] == [*STREAM_ORDER, *STREAM_END, "response.incomplete"]
    assert "".join(e.delta for e in parsed_deltas if e.type == "response.output_text.delta") == whole.output_text
    (item_id,) = {e["item"]["id"] for e in events if "item" in e}
    text_events = [e for e in events if e["type"].startswith("response.output_text")]
    assert {(e["item_id"], e["output_index"], e["content_index"]) for e in text_events} == {(item_id, 0, 0)}
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text == events[-len(STREAM_END) - 1]["text"]
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == text and final["usage"]["output_tokens"] == 8


async def test_the_stream_helper_of_the_sync_client(anyio_backend: str) -> None:
    async with scripted([*b"Bonjour!", EOS_ID]) as (engine, _):
        async with serving(create_app(engine, model_name=MODEL), anyio_backend) as url:

            def run() -> tuple[list[str], Any]:
                with sync_client(url) as client, client.responses.stream(model=MODEL, input="hi") as stream:
                    kinds = [str(event.type) for event in stream]
                    return kinds, stream.get_final_response()

            kinds, final = await anyio.to_thread.run_sync(run)
    assert kinds[: len(STREAM_ORDER)] == STREAM_ORDER and kinds[-1] == "response.completed"
    assert final.status == "completed" and final.output_text == "Bonjour!"


async def test_disconnect_mid_stream_aborts_and_frees_the_blocks(anyio_backend: str) -> None:
    async with scripted([*b"abc"]) as (engine, _):  # never ends on its own
        async with serving(create_app(engine, model_name=MODEL), anyio_backend) as url:
            async with async_client(url) as client:
                stream = await client.responses.create(model=MODEL, input="go", max_output_tokens=1500, stream=True)
                seen = 0
                async for event in stream:
                    seen += event.type == "response.output_text.delta"
                    if seen == 3:
                        break
                await stream.close()
            with anyio.fail_after(BOUND_S):  # a bounded poll of the engine's state, not a timing assumption
                while engine.metrics.finished_requests["abort"] != 1:
                    await anyio.sleep(0.01)
        await engine.generate("y", SamplingParams(max_tokens=1))  # the engine applies queued aborts first
        stats = engine.statistics()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_a_failure_mid_stream_is_an_error_then_response_failed(anyio_backend: str) -> None:
    with pytest.raises(asyncllm_errors.EngineDeadError):
        async with scripted([104], fail_at_step=3) as (engine, _):
            async with serving(create_app(engine, model_name=MODEL), anyio_backend) as url:
                async with httpx.AsyncClient(timeout=BOUND_S) as http:
                    raw = await http.post(
                        f"{url}/v1/responses", json={"input": "x", "max_output_tokens": 9, "stream": True}
                    )
    assert raw.status_code == 200
    events = events_of(raw.text)
    assert [e["type"] for e in events[: len(STREAM_ORDER)]] == STREAM_ORDER
    *_, error, failed = events
    assert error["type"] == "error" and error["code"] == "engine_dead"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert set(deltas) == {"h"} and 0 < len(deltas) < 9  # what the steps before the failure made
    assert failed["response"]["output"][0]["content"][0]["text"] == deltas


# -- refusals and auth ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "unsupported_parameter"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "unsupported_parameter"),
        ({"tool_choice": "required"}, "tool_choice", "unsupported_parameter"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
        ({"text": {"format": {"type": "xml"}}}, "text.format", "unsupported_parameter"),
        ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format", "missing_schema"),
        ({"include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
        ({"top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"max_output_tokens": 0}, "max_output_tokens", "invalid_request"),
        ({"input": []}, "input", "invalid_request"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "invalid_request"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
            "input[0].content[0]",
            "unsupported_parameter",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
            "input[0]",
            "unsupported_parameter",
        ),
        ({"input": "x" * 300}, "input", "invalid_request"),  # no room to reply within max_model_len
    ],
)
async def test_what_is_not_supported_is_a_400_naming_the_field(
    anyio_backend: str, extra: dict[str, Any], param: str, code: str
) -> None:
    async with scripted([*b"ok", EOS_ID], max_model_len=256) as (engine, _):
        async with serving(create_app(engine, model_name=MODEL), anyio_backend) as url:
            async with async_client(url) as client:
                for stream in (False, True):  # refused before a stream starts: a plain 400 either way
                    with pytest.raises(openai.BadRequestError) as caught:
                        await client.responses.create(**{"model": MODEL, "input": "hi", "stream": stream, **extra})
                    error = caught.value.body
                    assert isinstance(error, dict) and (error["param"], error["code"]) == (param, code), error
                # Neutral values and fields that change nothing are accepted; unknown fields are ignored.
                ok = await client.responses.create(
                    model=MODEL, input="hi", tool_choice="auto", tools=[], store=False, reasoning={"effort": None},
                    text={"format": {"type": "text"}}, extra_body={"some_future_field": 1},
                )  # fmt: skip
    assert ok.output_text == "ok"


async def test_the_api_key_guards_responses(anyio_backend: str) -> None:
    async with scripted([*b"ok", EOS_ID]) as (engine, _):
        async with serving(create_app(engine, model_name=MODEL, api_key="sesame"), anyio_backend) as url:
            async with async_client(url, api_key="wrong") as wrong, async_client(url, api_key="sesame") as right:
                with pytest.raises(openai.AuthenticationError) as caught:
                    await wrong.responses.create(model=MODEL, input="hi")
                reply = await right.responses.create(model=MODEL, input="hi")
                with pytest.raises(openai.NotFoundError):
                    await right.responses.create(model="other", input="hi")
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "invalid_api_key"
    assert reply.output_text == "ok"


async def test_cached_tokens_report_prefix_cache_hits(asyncllm_engine: Engine, anyio_backend: str) -> None:
    asyncllm_engine.reset_prefix_cache()
    instructions = "You answer in one word. " * 12  # several KV blocks of the same prompt prefix
    request: dict[str, Any] = {"model": MODEL, "input": "hi", "instructions": instructions, "max_output_tokens": 2}
    async with serving(create_app(asyncllm_engine, model_name=MODEL), anyio_backend) as url:
        async with async_client(url) as client:
            first = await client.responses.create(**request)
            second = await client.responses.create(**request)
            events = [event async for event in await client.responses.create(**request, stream=True)]
            streamed = events[-1].response  # response.incomplete: max_output_tokens ends it
    assert first.usage is not None and second.usage is not None and streamed.usage is not None
    block_size = asyncllm_engine.options.block_size
    assert first.usage.input_tokens_details.cached_tokens == 0
    cached = second.usage.input_tokens_details.cached_tokens
    assert 0 < cached < second.usage.input_tokens and cached % block_size == 0
    assert streamed.usage.input_tokens_details.cached_tokens == cached
