"""Review of ``POST /v1/embeddings`` over loopback under a real hypercorn: reproducers, each failing before
its fix."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest

from asyncllm import Embedding, Engine
from asyncllm.http import create_app
from asyncllm.http._app import Exchange
from asyncllm.testing import import_path
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

serving = import_path(Path(__file__).with_name("test_http_transport.py"), "asyncllm_test_http_transport").serving

NUM_INPUTS = 2048  # OpenAI's (and the default max_embedding_inputs) most inputs per request


@pytest.fixture
async def engine(tiny_cache: Path) -> AsyncIterator[Engine]:
    async with Engine.open(tiny_model_path(tiny_cache, "qwen3"), device="cpu", max_model_len=64) as opened:
        yield opened


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
async def test_a_large_response_is_encoded_without_holding_the_event_loop(
    engine: Engine, anyio_backend: str, monkeypatch: pytest.MonkeyPatch, encoding_format: str
) -> None:
    # The response of a full request (2,048 inputs) is built after every vector is in: as one block of
    # work, it held the event loop (measured 1.2 s for 2,048 vectors of 4,096 floats, 0.55 s as base64),
    # and with it every other stream's tokens. Counted here: how often another task on the loop runs
    # between the engine's answer and the response's first byte.
    ticks = 0
    returned = anyio.Event()
    responded = False
    embed = engine.embed

    async def embed_then_mark(*args: Any, **kwargs: Any) -> list[Embedding]:
        results = await embed(*args, **kwargs)
        returned.set()
        return results

    send = Exchange._send_whole

    async def mark_then_send(self: Exchange, message: Any) -> None:
        nonlocal responded
        if message["type"] == "http.response.start" and returned.is_set():  # not the readiness probes'
            responded = True
        await send(self, message)

    async def ticker() -> None:
        nonlocal ticks
        await returned.wait()
        while not responded:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    monkeypatch.setattr(engine, "embed", embed_then_mark)
    monkeypatch.setattr(Exchange, "_send_whole", mark_then_send)
    inputs = [[3 + i % 200] for i in range(NUM_INPUTS)]
    async with serving(create_app(engine, model_name="tiny"), anyio_backend) as url:
        async with anyio.create_task_group() as group, httpx.AsyncClient(base_url=url, timeout=120) as http:
            group.start_soon(ticker)
            response = await http.post("/v1/embeddings", json={"input": inputs, "encoding_format": encoding_format})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"] == {"prompt_tokens": NUM_INPUTS, "total_tokens": NUM_INPUTS}
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [item["index"] for item in body["data"]] == list(range(NUM_INPUTS))
    want = await embed(inputs[:3])
    for item, expected in zip(body["data"], want):
        assert item["object"] == "embedding"
        got = item["embedding"]
        if encoding_format == "base64":
            got = np.frombuffer(base64.b64decode(got), dtype="<f4")
        assert np.allclose(got, expected.embedding, atol=1e-6)
    assert ticks >= 16, ticks  # one slice of at most 64 vectors at a time: 32 slices here
