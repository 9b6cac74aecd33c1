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

import msgspec
import numpy as np

from asyncllm.http._app import Exchange, HTTPError
from asyncllm.outputs import Embedding

if TYPE_CHECKING:
    from asyncllm.http._app import OpenAIApp

ENCODING_FORMATS = ("float", "base64")


class EmbeddingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /v1/embeddings``. ``input`` is a str, a list of str, a list of token ids or a list of lists
    of token ids (checked by ``Engine.embed``). ``user`` is accepted and unused."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


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
            results.extend(await self.app.engine.embed(body.input, dimensions=body.dimensions))

        await exchange.until_disconnect(work)
        encode = _base64 if body.encoding_format == "base64" else list
        tokens = sum(len(result.prompt_token_ids) for result in results)
        response = EmbeddingResponse(
            data=[EmbeddingData(index=i, embedding=encode(r.embedding)) for i, r in enumerate(results)],
            model=self.app.model_name,
            usage=EmbeddingUsage(tokens, tokens),
        )
        await exchange.respond_json(200, response)


def _base64(vector: tuple[float, ...]) -> str:
    # What OpenAI's clients decode: the vector as little-endian float32 bytes, base64 encoded.
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
