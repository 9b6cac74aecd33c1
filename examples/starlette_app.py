"""Starlette: mount asyncllm's OpenAI-compatible app under /v1 next to your own routes.

    pip install starlette hypercorn
    cd examples && hypercorn starlette_app:app    # asyncio; add `-k trio` for trio
    python examples/starlette_app.py
    curl localhost:8000/v1/models

ASYNCLLM_MODEL picks the model folder (default: SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from asyncllm import Engine
from asyncllm.http import create_app

# Configured now (nothing loads yet), entered in the lifespan: Starlette does not pass its
# lifespan on to mounted apps, so the engine is opened here, around the whole application.
engine = Engine.open(os.environ.get("ASYNCLLM_MODEL"))


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with engine:
        yield


async def homepage(request: Request) -> PlainTextResponse:
    return PlainTextResponse("The OpenAI-compatible API is under /v1 (try /v1/models).\n")


app = Starlette(
    routes=[Route("/", homepage), Mount("/v1", app=create_app(engine, api_key=os.environ.get("ASYNCLLM_API_KEY")))],
    lifespan=lifespan,
)


if __name__ == "__main__":
    import anyio
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = ["127.0.0.1:8000"]
    anyio.run(serve, app, config)
