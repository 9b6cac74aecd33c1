"""``POST /v1/embeddings`` over loopback under a real hypercorn, driven by the official ``openai`` client,
on a tiny Qwen3 model."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from asyncllm import Engine
from asyncllm.http import create_app
from asyncllm.testing import import_path
from asyncllm.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

serving = import_path(Path(__file__).with_name("test_http_transport.py"), "asyncllm_test_http_transport").serving


@pytest.fixture
async def engine(tiny_cache: Path) -> AsyncIterator[Engine]:
    model = tiny_model_path(tiny_cache, "qwen3")
    async with Engine.open(model, device="cpu", max_model_len=64, max_embedding_inputs=4) as opened:
        yield opened


@pytest.fixture
async def base_url(engine: Engine, anyio_backend: str) -> AsyncIterator[str]:
    async with serving(create_app(engine, model_name="tiny"), anyio_backend) as url:
        yield url


@pytest.fixture
async def client(base_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    # Closed here, in this test's event loop: one left to the garbage collector closes its connections
    # in whichever test's loop is running then (another backend's, or a closed one).
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60) as opened:
        yield opened


async def test_float_and_base64_through_the_openai_client(
    engine: Engine, base_url: str, client: openai.AsyncOpenAI
) -> None:
    texts = ["hello world", "a second, longer input to embed"]
    expected = await engine.embed(texts)
    as_float = await client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    # The client's own default: it asks for base64 (numpy is installed) and decodes it to floats.
    default = await client.embeddings.create(model="tiny", input=texts)
    for response in (as_float, default):
        assert response.object == "list" and response.model == "tiny"
        assert [d.index for d in response.data] == [0, 1]
        for data, want in zip(response.data, expected):
            assert data.object == "embedding"
            assert np.allclose(data.embedding, want.embedding, atol=1e-6)
        tokens = sum(len(e.prompt_token_ids) for e in expected)
        assert response.usage.prompt_tokens == response.usage.total_tokens == tokens
    async with httpx.AsyncClient(base_url=base_url) as http:
        raw = await http.post("/v1/embeddings", json={"input": texts[0], "encoding_format": "base64", "extra": 1})
    assert raw.status_code == 200, raw.text
    encoded = raw.json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert np.allclose(decoded, expected[0].embedding, atol=1e-6)


async def test_token_inputs_and_dimensions(engine: Engine, client: openai.AsyncOpenAI) -> None:
    ids = [[5, 6, 7], [8, 9, 10, 11]]
    one = await client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    many = await client.embeddings.create(model="tiny", input=ids, encoding_format="float", dimensions=8)
    full = await engine.embed(ids)
    assert np.allclose(one.data[0].embedding, full[0].embedding, atol=1e-6)
    for data, whole in zip(many.data, full):
        assert len(data.embedding) == 8
        want = np.asarray(whole.embedding[:8]) / np.linalg.norm(whole.embedding[:8])
        assert np.allclose(data.embedding, want, atol=1e-6)
        assert abs(np.linalg.norm(data.embedding) - 1.0) < 1e-5
    assert many.usage.prompt_tokens == 7


async def test_errors_are_400_with_code_and_param(engine: Engine, base_url: str, client: openai.AsyncOpenAI) -> None:
    hidden = engine.embedding_size
    assert hidden is not None
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["a", "b", "c", "d", "e"]}, "input"),  # max_embedding_inputs=4
        ({"input": [1] * 65}, "input"),  # max_model_len=64
        ({"input": [[1, 2], ["x"]]}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": hidden + 1}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": 5}, "input"),
    ]
    async with httpx.AsyncClient(base_url=base_url) as http:
        for body, param in cases:
            response = await http.post("/v1/embeddings", json=body)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == param, (body, error)
            assert error["code"], (body, error)
            assert error["type"] == "invalid_request_error"
        missing = await http.post("/v1/embeddings", json={"model": "tiny"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "input"
        other_model = await http.post("/v1/embeddings", json={"input": "x", "model": "other"})
        assert other_model.status_code == 404
    with pytest.raises(openai.BadRequestError) as caught:
        await client.embeddings.create(model="tiny", input="x", dimensions=0)
    assert caught.value.code == "invalid_request" and caught.value.param == "dimensions"
    stats = engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_waiting == 0
