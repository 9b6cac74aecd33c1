"""``priority`` on the OpenAI app (vLLM's extension field): over real HTTP (hypercorn on loopback, in the
test's event loop, asyncio and trio) with the official ``openai`` client, on a scripted engine whose
device thread the test can hold, so that requests queue up in a known order."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.executor._runner import StepBatch, StepOutput
from asyncllm.http import create_app
from asyncllm.testing import ByteTokenizer, ScriptedRunner, import_path

pytestmark = pytest.mark.anyio

serving = import_path(Path(__file__).with_name("test_http_transport.py"), "asyncllm_test_http_transport").serving

BOUND_S = 60.0  # generous bound on any wait; never a timing assertion
MODEL = "m"


class ChatByteTokenizer(ByteTokenizer):
    """A ByteTokenizer with a trivial chat template, so the chat endpoint runs on the scripted engine."""

    chat_template = "<role>content\\n per message"

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> dict[str, list[int]]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return {"input_ids": self.encode(text)}


class HeldRunner(ScriptedRunner):
    """A scripted runner whose steps wait while ``hold`` is set (the device thread stays busy)."""

    def __init__(self) -> None:
        super().__init__(b"xyz")
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()

    def execute(self, batch: StepBatch) -> StepOutput:
        self.entered.set()
        self.open.wait(BOUND_S)
        return super().execute(batch)


async def until(condition: Callable[[], bool]) -> None:
    """Wait (bounded) for ``condition``, polling: the engine has no event for a request queued by a handler."""
    with anyio.fail_after(BOUND_S):
        while not condition():
            await anyio.sleep(0.005)


@asynccontextmanager
async def served(engine: Engine, backend: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with serving(create_app(engine, model_name=MODEL), backend) as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=BOUND_S) as client:
            yield client


def first_sampled(runner: ScriptedRunner) -> list[bytes]:
    """Each request's prompt, in the order its request first sampled."""
    order: list[bytes] = []
    for step in runner.steps:
        for seq in step.sequences:
            prompt = bytes(seq.prompt_token_ids)
            if seq.sample and prompt not in order:
                order.append(prompt)
    return order


async def test_priority_orders_completions_and_chats_over_http(anyio_backend: str) -> None:
    runner = HeldRunner()
    async with Engine.open(
        runner=runner, tokenizer=ChatByteTokenizer(), scheduling_policy="priority", max_num_seqs=1
    ) as engine, served(engine, anyio_backend) as client:  # fmt: skip
        runner.open.clear()
        blocker = engine.stream("blocker", SamplingParams(max_tokens=4), priority=-1)
        await until(runner.entered.is_set)  # its first step holds the device thread
        answers: dict[str, str] = {}

        async def complete(name: str, priority: int) -> None:
            reply = await client.completions.create(
                model=MODEL, prompt=name, max_tokens=3, extra_body={"priority": priority}
            )
            answers[name] = reply.choices[0].text

        async def chat(name: str, priority: int) -> None:
            messages: Any = [{"role": "user", "content": name}]
            reply = await client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=3, extra_body={"priority": priority}
            )
            answers[name] = reply.choices[0].message.content or ""

        async with anyio.create_task_group() as group:
            # One at a time, each queued before the next is sent: their arrival order is known.
            for waiting, (send, name, priority) in enumerate(
                [(complete, "low-a", 5), (complete, "low-b", 5), (chat, "high", -3)], start=1
            ):
                group.start_soon(send, name, priority)
                await until(lambda waiting=waiting: engine.statistics().num_waiting == waiting)  # type: ignore[misc]
            runner.open.set()
            async with blocker:
                async for _ in blocker:
                    pass
        stats = engine.statistics()
    order = first_sampled(runner)
    high = ChatByteTokenizer().apply_chat_template([{"role": "user", "content": "high"}])["input_ids"]
    assert order == [b"blocker", bytes(high), b"low-a", b"low-b"]
    assert answers == {"low-a": "xyz", "low-b": "xyz", "high": "xyz"}
    assert stats.num_preemptions == 1  # high (-3) outranks the blocker (-1): it took its seat


async def test_a_priority_that_is_not_an_int_is_a_400_naming_it(anyio_backend: str) -> None:
    runner = ScriptedRunner(b"ok")
    async with Engine.open(
        runner=runner, tokenizer=ChatByteTokenizer(), scheduling_policy="priority"
    ) as engine, served(engine, anyio_backend) as client:  # fmt: skip
        messages: Any = [{"role": "user", "content": "x"}]
        calls: list[Callable[[dict[str, Any]], Awaitable[Any]]] = [
            lambda body: client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=body),
            lambda body: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=body),
            lambda body: client.embeddings.create(model=MODEL, input="x", extra_body=body),
            lambda body: client.responses.create(model=MODEL, input="x", extra_body=body),
        ]
        for bad in ("high", 1.5, True, [1]):
            for call in calls:
                with pytest.raises(openai.BadRequestError) as info:
                    await call({"priority": bad})
                assert isinstance(info.value.body, dict) and info.value.body["param"] == "priority", bad
        # null is the default, as for every field; a negative int is a fine priority.
        ok = await client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"priority": None})
        better = await client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"priority": -7})
    assert ok.choices[0].text == better.choices[0].text == "ok"


async def test_an_fcfs_server_refuses_a_priority_it_would_ignore() -> None:
    async with Engine.open(runner=ScriptedRunner(b"ok"), tokenizer=ChatByteTokenizer()) as engine:
        app = create_app(engine, model_name=MODEL)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            refused = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": 3})
            zero = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": 0})
            chat = {"messages": [{"role": "user", "content": "x"}], "priority": 2}
            others = [
                await http.post("/v1/chat/completions", json=chat),
                await http.post("/v1/embeddings", json={"input": "x", "priority": 1}),
                await http.post("/v1/responses", json={"input": "x", "priority": -1}),
            ]
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "priority" and "scheduling-policy priority" in error["message"]
    assert zero.status_code == 200
    for other in others:
        assert other.status_code == 400 and other.json()["error"]["param"] == "priority", other.text
