"""``POST /v1/embeddings``: OpenAI's embeddings request in, ``Engine.embed`` out.

Every input is checked (count, type, length, ``dimensions``) by ``Engine.embed`` before anything is
queued, so a bad request is a clean 400 naming the ``param``. The engine's own limits bound the work:
``max_embedding_inputs`` inputs (OpenAI's 2048 by default), each at most ``max_model_len`` tokens (and
``max_prompt_bytes`` of text), admitted only if the waiting queue has room for all of them. The call
runs under ``Exchange.until_disconnect``, so a client that leaves cancels it, which aborts every input's
request and frees its blocks.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import numpy as np

from asyncllm.http._app import Exchange, HTTPError
from asyncllm.outputs import Embedding

if TYPE_CHECKING:
    from asyncllm.http._app import OpenAIApp

ENCODING_FORMATS = ("float", "base64")

SLICE_FLOATS = 65_536
"""A response's vectors are encoded in slices of about this many floats (about 10 ms of encoding and
copying), the event loop running other tasks between them."""
SLICE_VECTORS = 64
"""And of at most this many vectors, so that many small vectors are sliced too."""

_ENCODER = msgspec.json.Encoder()


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /v1/embeddings``. ``input`` is a str, a list of str, a list of token ids or a list of lists
    of token ids (checked by ``Engine.embed``). ``user`` is accepted and unused."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    priority: int = 0
    """vLLM's extension, as on completions."""


class EmbeddingData(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, frozen=True, kw_only=True):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


class EmbeddingHandlers:
    """The embeddings endpoint of ``app``."""

    def __init__(self, app: OpenAIApp) -> None:
        self.app = app

    async def embeddings(self, exchange: Exchange) -> None:
        """``POST /v1/embeddings``."""
        body = await exchange.json(EmbeddingRequest)
        self.app.check_model(body.model)
        if body.encoding_format not in ENCODING_FORMATS:
            raise HTTPError(
                400,
                f"encoding_format must be 'float' or 'base64', got {body.encoding_format!r}",
                param="encoding_format",
                code="invalid_parameter",
            )
        results: list[Embedding] = []

        async def work() -> None:
            results.extend(
                await self.app.engine.embed(body.input, dimensions=body.dimensions, priority=body.priority)
            )

        await exchange.until_disconnect(work)
        tokens = sum(len(result.prompt_token_ids) for result in results)
        head = EmbeddingResponse(data=[], model=self.app.model_name, usage=EmbeddingUsage(tokens, tokens))
        await exchange.respond_parts(200, await _response_body(head, results, body.encoding_format))


async def _response_body(head: EmbeddingResponse, results: list[Embedding], encoding_format: str) -> list[bytes]:
    """``head`` as JSON with ``results`` as its ``data``, in parts, encoded a slice at a time.

    A full request's vectors (2,048 of thousands of floats) take a second or more to encode, and as
    much again to copy into one piece: either would hold the event loop, and every other request's
    stream with it. Each part holds a slice of about ``SLICE_FLOATS`` floats (at most
    ``SLICE_VECTORS`` vectors), and the loop runs other tasks between slices.
    """
    encode = _base64 if encoding_format == "base64" else list
    # The data list goes inside the encoded head's empty one: the same JSON as encoding it whole.
    encoded = _ENCODER.encode(head)
    marker = b'"data":['
    at = encoded.index(marker) + len(marker)
    parts = [encoded[:at]]
    items: list[bytes] = []
    in_slice = 0
    for index, result in enumerate(results):
        if in_slice >= SLICE_FLOATS or len(items) >= SLICE_VECTORS:
            parts.append(b",".join(items) + b",")
            items, in_slice = [], 0
            await anyio.lowlevel.checkpoint()
        items.append(_ENCODER.encode(EmbeddingData(index=index, embedding=encode(result.embedding))))
        in_slice += len(result.embedding)
    parts.append(b",".join(items))
    parts.append(encoded[at:])
    return parts


def _base64(vector: tuple[float, ...]) -> str:
    # What OpenAI's clients decode: the vector as little-endian float32 bytes, base64 encoded.
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
