"""FastAPI: the engine opened in the app's lifespan, and a streaming endpoint of your own.

    pip install fastapi hypercorn
    cd examples && hypercorn fastapi_app:app      # or: python examples/fastapi_app.py
    curl -N localhost:8000/generate -H 'content-type: application/json' -d '{"prompt": "Once upon a time"}'

ASYNCLLM_MODEL picks the model folder (default: SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from asyncllm import Engine, InvalidRequestError, SamplingParams


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # The engine lives exactly as long as the app: loaded at startup, closed at shutdown.
    async with Engine.open(os.environ.get("ASYNCLLM_MODEL")) as engine:
        app.state.engine = engine
        yield


app = FastAPI(lifespan=lifespan)


class GenerateBody(BaseModel):
    prompt: str
    max_tokens: int = 64
    temperature: float = 0.0


@app.exception_handler(InvalidRequestError)
async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, status_code=400)


@app.post("/generate")
async def generate(body: GenerateBody, request: Request) -> StreamingResponse:
    engine: Engine = request.app.state.engine
    # Validation happens here, before the response starts: a bad request is a clean 400.
    stream = engine.stream(body.prompt, SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature))

    async def text() -> AsyncIterator[str]:
        # If the client goes away, Starlette cancels this; `async with` then aborts the request.
        async with stream:
            async for chunk in stream:
                yield chunk.text

    return StreamingResponse(text(), media_type="text/plain; charset=utf-8")


@app.get("/stats")
async def stats(request: Request) -> dict[str, int]:
    s = request.app.state.engine.statistics()
    return {"running": s.num_running, "waiting": s.num_waiting, "kv_blocks_free": s.kv_blocks_free}


if __name__ == "__main__":
    import asyncio

    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = ["127.0.0.1:8000"]
    asyncio.run(serve(app, config))
