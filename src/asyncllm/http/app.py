"""The ASGI plumbing: routing, bearer auth, body limit, errors as OpenAI error objects, SSE, lifespan.

Plain ASGI, no web framework: the app is one callable, so it runs under any ASGI server (hypercorn
on asyncio or trio, uvicorn) and mounts into FastAPI or Starlette. JSON goes through msgspec.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec

from asyncllm import errors
from asyncllm.engine import Engine
from asyncllm.errors import EngineClosedError, EngineDeadError, InvalidRequestError
from asyncllm.http.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from asyncllm.http.prometheus import render_metrics
from asyncllm.http.protocol import ErrorBody, ErrorResponse, ModelCard, ModelList
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger("asyncllm.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""Default limit on a request body (4 MiB: a full context window of token ids fits many times)."""

DEFAULT_MAX_CHOICES = 256
"""Default limit on prompts times ``n`` in one request: the engine's default ``max_num_seqs``, so one
request can fill a batch but not queue work for many."""

DEFAULT_MAX_COMPLETION_LOGPROBS = 5
"""Default limit on ``/v1/completions``' ``logprobs``: OpenAI's."""

DEFAULT_MAX_TOP_LOGPROBS = 20
"""Default limit on ``/v1/chat/completions``' ``top_logprobs``: OpenAI's."""

_JSON = b"application/json"
_T = TypeVar("_T")


class HTTPError(Exception):
    """An error answered as OpenAI's error object with ``status``.

    Args:
        status: The HTTP status code.
        message: What went wrong, for the client.
        type: OpenAI's error ``type`` (``invalid_request_error``, ``server_error``, ...).
        param: The request field at fault, if one is.
        code: A short machine-readable code.
        headers: Extra response headers.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(ErrorBody(message, type, param, code))
        self.headers = headers


class ClientDisconnected(Exception):
    """The client went away before the response was complete."""


def error_for(exc: BaseException) -> HTTPError:
    """Translate an exception into the HTTP error the client sees (the one place this is decided)."""
    if isinstance(exc, HTTPError):
        return exc
    # Added to errors.py by the admission-control work; looked up by name so this works before it exists.
    overloaded = getattr(errors, "EngineOverloadedError", None)
    if overloaded is not None and isinstance(exc, overloaded):
        return HTTPError(
            503, str(exc), type="server_error", code="engine_overloaded", headers=((b"retry-after", b"1"),)
        )
    if isinstance(exc, EngineDeadError):
        return HTTPError(503, f"the engine is dead: {exc}", type="server_error", code="engine_dead")
    if isinstance(exc, EngineClosedError):
        return HTTPError(503, f"the engine is not running: {exc}", type="server_error", code="engine_closed")
    if isinstance(exc, msgspec.ValidationError):
        # "Expected `int`, got `str` - at `$.max_tokens`", "Object contains unknown field `frobnicate`"
        message = str(exc)
        found = re.search(r"`\$\.(\w+)", message) or re.search(r"field `(\w+)`", message)
        return HTTPError(400, message, param=found.group(1) if found else None, code="invalid_parameter")
    if isinstance(exc, msgspec.DecodeError):
        return HTTPError(400, f"the body is not valid JSON: {exc}", code="invalid_json")
    if isinstance(exc, ValueError):  # every InvalidRequestError, and SamplingParams' checks
        param = exc.param if isinstance(exc, InvalidRequestError) and exc.param else _param_named_in(str(exc))
        return HTTPError(400, str(exc), param=param, code="invalid_request")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return HTTPError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")


def _param_named_in(message: str) -> str | None:
    # SamplingParams' messages start with the field's name ("max_tokens must be >= 1, got 0").
    first = message.split(" ", 1)[0]
    return first if first in SamplingParams.__struct_fields__ or first in ("prompt", "messages") else None


class Exchange:
    """One HTTP request and its response, with the helpers the handlers need."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, max_body_bytes: int) -> None:
        self.scope = scope
        self.receive = receive
        self._send = send
        self._max_body_bytes = max_body_bytes
        self.started = False  # response headers sent: errors from now on go into the body
        self.headers: dict[bytes, bytes] = {bytes(k).lower(): bytes(v) for k, v in scope.get("headers", [])}

    async def body(self) -> bytes:
        """The whole request body.

        Raises:
            HTTPError: 413 when it is larger than the limit (by Content-Length or as it arrives).
            ClientDisconnected: The client went away first.
        """
        limit = self._max_body_bytes
        declared = self.headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def json(self, kind: type[_T]) -> _T:
        """The body decoded as ``kind`` (a msgspec struct); a 400 if it does not fit."""
        raw = await self.body()
        if not raw.strip():
            raise HTTPError(400, "the request body is empty; send a JSON object", code="invalid_json")
        return msgspec.json.decode(raw, type=kind)

    async def respond(
        self, status: int, body: bytes, content_type: bytes = _JSON, headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        """Send a complete response."""
        self.started = True
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers],
            }
        )
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def respond_json(self, status: int, value: Any) -> None:
        """Send ``value`` (a msgspec struct, or plain data) as JSON."""
        await self.respond(status, msgspec.json.encode(value))

    async def respond_error(self, error: HTTPError) -> None:
        """Send ``error`` as a response, or, when the response has started, as a last SSE event."""
        if self.started:
            await self.event(error.body)
            await self.end_events()
        else:
            await self.respond(error.status, msgspec.json.encode(error.body), headers=error.headers)

    async def start_events(self) -> None:
        """Start a ``text/event-stream`` response."""
        self.started = True
        await self._send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),  # proxies: pass events on as they come
                ],
            }
        )

    async def event(self, value: Any) -> None:
        """Send one server-sent event whose data is ``value`` as JSON."""
        await self._send_body(b"data: " + msgspec.json.encode(value) + b"\n\n", more=True)

    async def end_events(self) -> None:
        """Send ``data: [DONE]`` and end the response."""
        await self._send_body(b"data: [DONE]\n\n", more=False)

    async def _send_body(self, data: bytes, *, more: bool) -> None:
        try:
            await self._send({"type": "http.response.body", "body": data, "more_body": more})
        except OSError as exc:  # some servers raise on a send after the client left (uvicorn does)
            raise ClientDisconnected from exc

    async def until_disconnect(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work``; if the client disconnects meanwhile, cancel it (so its streams abort).

        Call it once the body has been read: from then on the only message left to receive is
        ``http.disconnect``. Exceptions from ``work`` propagate unwrapped.

        Raises:
            ClientDisconnected: The client went away and ``work`` was cancelled.
        """
        error: BaseException | None = None
        disconnected = False

        async def watch(scope: anyio.CancelScope) -> None:
            nonlocal disconnected
            while (await self.receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            scope.cancel()

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(watch, task_group.cancel_scope)
            try:
                await work()
            except Exception as exc:
                error = exc  # re-raised below: raised in here it would come out as an ExceptionGroup
            finally:
                task_group.cancel_scope.cancel()
        if error is not None:
            raise error
        if disconnected:
            raise ClientDisconnected


def _too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


Handler = Callable[[Exchange], Awaitable[None]]


class OpenAIApp:
    """The ASGI application ``create_app`` returns (see there)."""

    def __init__(
        self,
        engine: Engine,
        *,
        api_key: str | None,
        max_body_bytes: int,
        model_name: str | None,
        max_choices: int = DEFAULT_MAX_CHOICES,
        max_completion_logprobs: int = DEFAULT_MAX_COMPLETION_LOGPROBS,
        max_top_logprobs: int = DEFAULT_MAX_TOP_LOGPROBS,
    ) -> None:
        from asyncllm.http.completions import CompletionHandlers

        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if max_choices < 1:
            raise ValueError(f"max_choices must be >= 1, got {max_choices}")
        for name, value in (
            ("max_completion_logprobs", max_completion_logprobs),
            ("max_top_logprobs", max_top_logprobs),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.max_choices = max_choices
        self.max_completion_logprobs = max_completion_logprobs
        self.max_top_logprobs = max_top_logprobs
        if api_key is not None and not api_key:
            raise ValueError("api_key must be a non-empty string, or None for no authentication")
        self.engine = engine
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.model_name = model_name if model_name is not None else _default_model_name(engine)
        # Clients may name the model by its served name or by the path it was opened from.
        aliases = {os.fspath(engine.options.model)} if engine.options.model is not None else set()
        self.model_names = frozenset({self.model_name} | aliases)
        self.created = int(time.time())
        handlers = CompletionHandlers(self)
        # path -> (method -> (handler, needs api key)); paths are relative to the mount point, "/v1" optional.
        self._routes: dict[str, dict[str, tuple[Handler, bool]]] = {
            "/models": {"GET": (self._models, True)},
            "/completions": {"POST": (handlers.completions, True)},
            "/chat/completions": {"POST": (handlers.chat_completions, True)},
            "/health": {"GET": (self._health, False)},
            "/metrics": {"GET": (self._metrics, False)},
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1003})
        else:
            raise RuntimeError(f"unsupported ASGI scope type {kind!r}")

    # -- plumbing --------------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(scope, receive, send, self.max_body_bytes)
        try:
            handler = self._route(exchange)
            await handler(exchange)
        except ClientDisconnected:
            return  # nobody to answer; the request's streams were closed on the way out (aborted)
        except Exception as exc:
            try:
                await exchange.respond_error(error_for(exc))
            except ClientDisconnected:
                return

    def _route(self, exchange: Exchange) -> Handler:
        path = _route_path(exchange.scope)
        method = exchange.scope["method"]
        methods = self._routes.get(path)
        model_id = path.removeprefix("/models/") if path.startswith("/models/") else None
        if methods is None and model_id:
            methods = {"GET": (lambda ex: self._model(ex, model_id), True)}
        if methods is None:
            raise HTTPError(404, f"no such endpoint: {exchange.scope['path']}", code="not_found")
        if method not in methods:
            allowed = ", ".join(sorted(methods)).encode()
            raise HTTPError(
                405, f"{method} is not allowed here; use {allowed.decode()}", headers=((b"allow", allowed),)
            )
        handler, protected = methods[method]
        if protected:
            self._authenticate(exchange)
        return handler

    def _authenticate(self, exchange: Exchange) -> None:
        if self.api_key is None:
            return
        scheme, _, token = exchange.headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise HTTPError(
                401,
                "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers=((b"www-authenticate", b"Bearer"),),
            )

    def check_model(self, model: str | None) -> None:
        """Raise a 404 unless ``model`` (None: not given) names the served model."""
        if model is not None and model not in self.model_names:
            raise HTTPError(
                404,
                f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        # Served alone, the app may be handed an engine that is not entered yet: it then owns it,
        # entering it at startup and leaving it at shutdown, both in this (the lifespan) task.
        # Mounted into a framework, no lifespan reaches us: the framework's lifespan opens the engine.
        await receive()  # lifespan.startup
        async with AsyncExitStack() as stack:
            try:
                self.engine.check_health()
            except EngineClosedError:
                try:
                    await stack.enter_async_context(self.engine)
                except Exception as exc:
                    logger.exception("could not start the engine")
                    await send({"type": "lifespan.startup.failed", "message": f"could not start the engine: {exc!r}"})
                    return
            except EngineDeadError:
                pass  # it answers 503s; /health says why
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})

    # -- small endpoints -------------------------------------------------------------------------

    def _card(self) -> ModelCard:
        return ModelCard(self.model_name, self.created, self.engine.max_model_len)

    async def _models(self, exchange: Exchange) -> None:
        await exchange.respond_json(200, ModelList([self._card()]))

    async def _model(self, exchange: Exchange, model_id: str) -> None:
        self.check_model(model_id)
        await exchange.respond_json(200, self._card())

    async def _health(self, exchange: Exchange) -> None:
        self.engine.check_health()  # EngineClosedError / EngineDeadError -> 503
        await exchange.respond_json(200, {"status": "ok"})

    async def _metrics(self, exchange: Exchange) -> None:
        page = render_metrics(self.engine.metrics, self.engine.statistics())
        await exchange.respond(200, page.encode(), METRICS_CONTENT_TYPE.encode())


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    # Starlette's Mount (and the ASGI spec since 2023) keep the full path and set root_path.
    if root_path and path.startswith(root_path):
        path = path[len(root_path) :]
    if path.startswith("/v1/"):
        path = path[3:]
    return path.rstrip("/") or "/"


def _default_model_name(engine: Engine) -> str:
    if engine.options.model is None:
        from asyncllm.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return Path(engine.options.model).name or os.fspath(engine.options.model)


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_name: str | None = None,
    max_choices: int = DEFAULT_MAX_CHOICES,
    max_completion_logprobs: int = DEFAULT_MAX_COMPLETION_LOGPROBS,
    max_top_logprobs: int = DEFAULT_MAX_TOP_LOGPROBS,
) -> OpenAIApp:
    """An OpenAI-compatible ASGI application over ``engine``.

    Endpoints (each also without the ``/v1`` prefix, so the app can be mounted at ``/v1``):
    ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``,
    ``POST /v1/chat/completions`` (``stream: true`` answers with server-sent events ending in
    ``data: [DONE]``), ``GET /health`` and ``GET /metrics`` (Prometheus text format).

    The app does not own a running engine: open it around the server (``async with engine:``
    then serve), or in the lifespan of the framework the app is mounted into. Served alone by an
    ASGI server with lifespan support, an engine that was never entered is entered at startup and
    left at shutdown.

    Args:
        engine: The engine to serve (entered, or about to be; see above).
        api_key: When set, the ``/v1`` endpoints require ``Authorization: Bearer <api_key>``
            (``/health`` and ``/metrics`` stay open, for load balancers and scrapers).
        max_body_bytes: Larger request bodies are refused with 413.
        model_name: The model's name in ``/v1/models`` and in responses; requests naming another
            model get 404. Default: the model folder's name (the default model's name for None).
        max_choices: The most choices one request may ask for: its prompts times ``n`` (a 400
            beyond). The engine's own limits (``Engine.open``'s ``max_logprobs``,
            ``max_prompt_bytes``, ``max_stop``, ...) apply as well.
        max_completion_logprobs: The largest ``logprobs`` of ``/v1/completions`` (OpenAI's 5).
        max_top_logprobs: The largest ``top_logprobs`` of ``/v1/chat/completions`` (OpenAI's 20).

    Returns:
        The ASGI application (a plain callable; no framework needed).

    Raises:
        ValueError: ``max_body_bytes`` or ``max_choices`` < 1, a negative logprobs limit, or an empty ``api_key``.
    """
    return OpenAIApp(
        engine,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        model_name=model_name,
        max_choices=max_choices,
        max_completion_logprobs=max_completion_logprobs,
        max_top_logprobs=max_top_logprobs,
    )
