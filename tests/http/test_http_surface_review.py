"""A hostile review of the OpenAI surface (issue 24's additions): each test reproduced a bug a client hit.

- ``text_offset`` of an echoed prompt summed each token's own text, so it ran ahead of the echoed text
  by a BOS the tokenizer added to a text prompt, and by one per extra byte token of a character split
  across tokens (each decodes alone to U+FFFD); the generated tokens' offsets then started past the end.
- ``/tokenize`` with ``messages`` ignored ``tools``, so the count was not the chat request's prompt.
- ``text_offset`` of generated tokens summed their texts too, so a split character or a stop string
  pushed the offsets past the returned text.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncllm import Engine
from asyncllm.http import create_app
from asyncllm.http._app import OpenAIApp

pytestmark = pytest.mark.anyio

SPLIT = "Hi é€ there"  # é and € are several byte tokens each in the tiny model's vocabulary


@asynccontextmanager
async def client(app: OpenAIApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        yield http


def _start(tokenizer: Any, token_ids: list[int], text: str) -> list[int]:
    """The oracle: where each token starts in ``text`` (the text decoded before it, a split character's
    pieces all at the character)."""
    decoded = tokenizer.decode(token_ids, skip_special_tokens=False)
    lead = len(decoded) - len(text)
    assert decoded[lead:] == text
    return [
        max(0, len(tokenizer.decode(token_ids[:i], skip_special_tokens=False).rstrip("\ufffd")) - lead)
        for i in range(len(token_ids))
    ]


def _check(body: dict[str, Any], tokenizer: Any, prompt_ids: list[int], echoed: str) -> None:
    (choice,) = body["choices"]
    offsets = choice["logprobs"]["text_offset"]
    assert choice["text"].startswith(echoed)
    assert offsets[: len(prompt_ids)] == _start(tokenizer, prompt_ids, echoed)
    assert offsets == sorted(offsets) and all(0 <= o <= len(choice["text"]) for o in offsets)
    if len(offsets) > len(prompt_ids):  # the first generated token starts right after the echo
        assert offsets[len(prompt_ids)] == len(echoed)


async def test_echo_text_offset_stays_inside_the_text_across_split_characters(asyncllm_engine: Engine) -> None:
    tokenizer = asyncllm_engine.tokenizer
    ids = await asyncllm_engine.tokenize(SPLIT)
    assert any(tokenizer.decode([i]) == "\ufffd" for i in ids)  # the premise: some character is split
    async with client(create_app(asyncllm_engine)) as http:
        for prompt, max_tokens in ((SPLIT, 0), (SPLIT, 2), (ids, 2)):
            request = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0}
            body = (await http.post("/v1/completions", json=request)).json()
            _check(body, tokenizer, ids, SPLIT)


@pytest.fixture
def bos_model(asyncllm_model_path: Path, tmp_path: Path) -> Path:
    """The tiny model with a tokenizer that starts every text with a BOS (<|im_start|>, id 1), as llama's does."""
    folder = tmp_path / "bos-model"
    shutil.copytree(asyncllm_model_path, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


async def test_echo_text_offset_leaves_out_an_added_bos(bos_model: Path) -> None:
    async with Engine.open(bos_model, device="cpu") as engine:
        tokenizer = engine.tokenizer
        ids = await engine.tokenize("Once upon a time")
        assert ids[0] == 1  # the premise: the tokenizer added a BOS the echoed prompt does not show
        async with client(create_app(engine)) as http:
            for max_tokens in (0, 3):
                request = {"prompt": "Once upon a time", "echo": True, "logprobs": 0, "max_tokens": max_tokens}
                body = (await http.post("/v1/completions", json=request)).json()
                _check(body, tokenizer, ids, "Once upon a time")
                assert body["choices"][0]["logprobs"]["text_offset"][:2] == [0, 0]  # BOS, then the text
            # Token ids echo as they decode, the BOS written out: its text is in the echo, offsets follow it.
            body = (await http.post("/v1/completions", json={**request, "prompt": ids})).json()
            _check(body, tokenizer, ids, tokenizer.decode(ids, skip_special_tokens=False))


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


async def test_tokenize_counts_the_tools_the_chat_request_renders(asyncllm_engine: Engine) -> None:
    messages = [{"role": "user", "content": "weather?"}]
    async with client(create_app(asyncllm_engine)) as http:
        bare = (await http.post("/tokenize", json={"messages": messages})).json()
        counted = (await http.post("/tokenize", json={"messages": messages, "tools": TOOLS})).json()
        chat = (await http.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 1}))
        bad = await http.post("/tokenize", json={"messages": messages, "tools": "x"})
        stray = await http.post("/tokenize", json={"prompt": "x", "tools": TOOLS})
    assert counted["count"] == chat.json()["usage"]["prompt_tokens"] > bare["count"]
    for response, param in ((bad, "tools"), (stray, "tools")):
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert response.json()["error"]["code"]


async def test_generated_text_offset_stays_inside_the_text_across_split_characters(asyncllm_engine: Engine) -> None:
    """A grammar forces characters the tiny vocabulary splits into byte tokens: their offsets, streamed
    and whole, stay inside the returned text and start each chunk where the text before it ends."""
    forced = "é€é€é€"
    schema = {"type": "string", "enum": [forced]}
    request = {
        "prompt": "Say it",
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    async with client(create_app(asyncllm_engine)) as http:
        whole = (await http.post("/v1/completions", json=request)).json()["choices"][0]
        assert whole["text"] == json.dumps(forced, ensure_ascii=False)  # the premise: the grammar forced it
        offsets = whole["logprobs"]["text_offset"]
        assert len(offsets) > len(whole["text"])  # the premise: more tokens than characters
        assert offsets == sorted(offsets) and all(0 <= o <= len(whole["text"]) for o in offsets)
        response = await http.post("/v1/completions", json={**request, "stream": True})
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        text = ""
        for event in events:
            for choice in event["choices"]:
                if choice["logprobs"] and choice["logprobs"]["text_offset"]:
                    chunk_offsets = choice["logprobs"]["text_offset"]
                    assert chunk_offsets[0] == len(text)
                    assert all(len(text) <= o <= len(text) + len(choice["text"]) for o in chunk_offsets)
                text += choice["text"]
        assert text == whole["text"]
