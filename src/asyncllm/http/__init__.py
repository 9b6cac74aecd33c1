"""``asyncllm.http``: an OpenAI-compatible ASGI application over one running ``Engine``.

    from asyncllm.http import create_app
    async with Engine.open(model) as engine:
        app = create_app(engine, api_key="secret")   # serve with hypercorn, or mount it

Plain ASGI with msgspec for JSON: no web framework is needed, and the app mounts into FastAPI or
Starlette (``app.mount("/v1", create_app(engine))``). See docs/http.md.
"""

from __future__ import annotations

from asyncllm.http._app import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    HTTPError,
    OpenAIApp,
    create_app,
)
from asyncllm.http._prometheus import render_metrics

__all__ = [
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONCURRENT_REQUESTS",
    "HTTPError",
    "OpenAIApp",
    "create_app",
    "render_metrics",
]
