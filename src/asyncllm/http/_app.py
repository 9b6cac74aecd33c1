"""The ASGI plumbing: routing, bearer auth, transport limits, CORS, errors as OpenAI error objects,
SSE, lifespan, shutdown.

Plain ASGI, no web framework: the app is one callable, so it runs under any ASGI server (hypercorn
on asyncio or trio, uvicorn) and mounts into FastAPI or Starlette. JSON goes through msgspec.

The limits that protect the server from one client live here, where every ASGI server honours
them: the body size and the time to receive it, the number of requests in flight, framing that
could smuggle a request, JSON nested deeper than the decoder recurses, and bodies that are not
JSON (which a web page could send cross-origin without asking; see ``cors_origins``).
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec

from asyncllm import errors
from asyncllm.engine._engine import Engine
from asyncllm.errors import EngineClosedError, EngineDeadError, InvalidRequestError, RequestFailedError
from asyncllm.http._prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from asyncllm.http._prometheus import render_metrics
from asyncllm.http._protocol import ErrorBody, ErrorResponse, ModelCard, ModelList, lenient_body
from asyncllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncllm.http._tokenize import TokenizerHandlers

logger = logging.getLogger("asyncllm.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""Default limit on a request body (4 MiB: a full context window of token ids fits many times)."""

DEFAULT_BODY_TIMEOUT = 30.0
"""Default time, in seconds, in which a request body must have arrived whole (4 MiB at 140 KB/s)."""

DEFAULT_MAX_CONCURRENT_REQUESTS = 512
"""Default limit on requests in flight (body being read, or being answered): below the common
1024 file descriptors per process, with room for connections that are idle or sending headers."""

DEFAULT_MAX_CHOICES = 256
"""Default limit on prompts times ``n`` in one request: the engine's default ``max_num_seqs``, so one
request can fill a batch but not queue work for many."""

DEFAULT_MAX_COMPLETION_LOGPROBS = 5
"""Default limit on ``/v1/completions``' ``logprobs``: OpenAI's."""

DEFAULT_MAX_TOP_LOGPROBS = 20
"""Default limit on ``/v1/chat/completions``' ``top_logprobs``: OpenAI's."""

_JSON = b"application/json"
_CLOSE = (b"connection", b"close")
_PREFLIGHT_MAX_AGE = b"600"  # seconds a browser may cache a preflight answer
_UNCOUNTED = frozenset({"/health", "/metrics"})  # answered from memory at once; they must work when full
_T = TypeVar("_T", bound=msgspec.Struct)


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
    if isinstance(exc, RequestFailedError):  # this request alone failed inside the engine; the log has why
        return HTTPError(500, str(exc), type="server_error", code="request_failed")
    if isinstance(exc, EngineClosedError):
        return HTTPError(503, f"the engine is not running: {exc}", type="server_error", code="engine_closed")
    if isinstance(exc, msgspec.ValidationError):
        # "Expected `int`, got `str` - at `$.max_tokens`", "Object missing required field `prompt`"
        message = str(exc)
        found = re.search(r"`\$\.(\w+)", message) or re.search(r"field `(\w+)`", message)
        return HTTPError(400, message, param=found.group(1) if found else None, code="invalid_parameter")
    if isinstance(exc, msgspec.DecodeError):
        return HTTPError(400, f"the body is not valid JSON: {exc}", code="invalid_json")
    if isinstance(exc, ValueError):  # every InvalidRequestError, and SamplingParams' checks
        param = exc.param if isinstance(exc, InvalidRequestError) and exc.param else _param_named_in(str(exc))
        if param == "structured_output":  # the HTTP request's field is response_format
            param = "response_format"
        code = getattr(exc, "code", None)
        return HTTPError(400, str(exc), param=param, code=code if isinstance(code, str) else "invalid_request")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return HTTPError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")


def _param_named_in(message: str) -> str | None:
    # SamplingParams' messages start with the field's name ("max_tokens must be >= 1, got 0").
    first = message.split(" ", 1)[0]
    return first if first in SamplingParams.__struct_fields__ or first in ("prompt", "messages") else None


class Exchange:
    """One HTTP request and its response, with the helpers the handlers need."""

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        max_body_bytes: int,
        body_timeout: float = math.inf,
        response_headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        self.scope = scope
        self.receive = receive
        self._send = send
        self._max_body_bytes = max_body_bytes
        self._body_timeout = body_timeout
        self._response_headers = list(response_headers)  # added to every response (CORS)
        self.started = False  # response headers sent: errors from now on go into the body
        self.finished = False  # the response is complete: nothing more can be said
        # How a started event stream ends on an error (None: the chat endpoints' last
        # `data: {"error": ...}` and `data: [DONE]`); the Responses API ends its own way.
        self.end_events_with_error: Callable[[HTTPError], Awaitable[None]] | None = None
        self.headers: dict[bytes, bytes] = {bytes(k).lower(): bytes(v) for k, v in scope.get("headers", [])}

    def close_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """``Connection: close`` on HTTP/1 (HTTP/2 forbids the header; its streams end on their own)."""
        return (_CLOSE,) if str(self.scope.get("http_version", "1.1")).startswith("1") else ()

    async def body(self) -> bytes:
        """The whole request body, received within the body timeout.

        Raises:
            HTTPError: 413 when it is larger than the limit (by Content-Length or as it arrives);
                408 (closing the connection) when it has not arrived whole within the timeout.
            ClientDisconnected: The client went away first.
        """
        limit = self._max_body_bytes
        declared = self.headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        # One deadline for the whole body, not one per read: a client trickling a byte at a time
        # would otherwise hold its connection (a file descriptor) for as long as it likes.
        with anyio.move_on_after(self._body_timeout):
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
        raise HTTPError(
            408,
            f"the request body did not arrive within {self._body_timeout:g} s",
            code="request_timeout",
            headers=self.close_headers(),  # the rest of the body may still come: the connection cannot be reused
        )

    async def json(self, kind: type[_T]) -> _T:
        """The body decoded as ``kind`` (a msgspec struct), leniently: unknown fields and nulls dropped
        (``lenient_body``).

        Raises:
            HTTPError: 415 unless the body is declared ``application/json``; 400 when it is empty or
                nested deeper than the decoder goes; the errors of ``body()``.
            msgspec.DecodeError: Not JSON (a 400 via ``error_for``).
            msgspec.ValidationError: JSON that does not fit ``kind`` (a 400 via ``error_for``).
        """
        # A web page may POST text/plain (or a body with no type) to any origin without a CORS
        # preflight; asking for application/json makes the browser ask first (see cors_origins).
        media_type = self.headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if media_type != _JSON:
            shown = media_type.decode("latin-1") or "none"
            raise HTTPError(
                415,
                f"the body must be JSON sent as 'Content-Type: application/json' (got {shown})",
                code="unsupported_media_type",
            )
        raw = await self.body()
        if not raw.strip():
            raise HTTPError(400, "the request body is empty; send a JSON object", code="invalid_json")
        try:
            # Decoded, then converted: unknown fields and nulls are dropped in between (lenient_body).
            return msgspec.convert(lenient_body(msgspec.json.decode(raw), kind), type=kind)
        except RecursionError:  # msgspec recurses per level of nesting: [[[[... runs out of stack
            raise HTTPError(400, "the body is not valid JSON: nested too deeply", code="invalid_json") from None

    async def respond(
        self, status: int, body: bytes, content_type: bytes = _JSON, headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        """Send a complete response."""
        await self.respond_parts(status, [body], content_type, headers)

    async def respond_parts(
        self,
        status: int,
        parts: Sequence[bytes],
        content_type: bytes = _JSON,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        """Send a complete response whose body is ``parts`` joined, one ASGI message per part.

        A large body (a full embeddings response is over 100 MB) is never copied into one piece, which
        alone would hold the event loop for a second; its ``Content-Length`` is still exact.
        """
        self.started = True
        size = sum(len(part) for part in parts)
        start = [(b"content-type", content_type), (b"content-length", str(size).encode()), *headers]
        await self._send_whole({"type": "http.response.start", "status": status, "headers": start})
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            if part or last:
                await self._send_whole({"type": "http.response.body", "body": part, "more_body": not last})

    async def respond_empty(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None:
        """Send a response without a body (204 to a preflight)."""
        self.started = True
        await self._send_whole({"type": "http.response.start", "status": status, "headers": list(headers)})
        await self._send_whole({"type": "http.response.body", "body": b"", "more_body": False})

    async def respond_json(self, status: int, value: Any) -> None:
        """Send ``value`` (a msgspec struct, or plain data) as JSON."""
        await self.respond(status, msgspec.json.encode(value))

    async def respond_error(self, error: HTTPError) -> None:
        """Send ``error`` as a response, or, when the response has started, as the last SSE events
        (``end_events_with_error``'s, when the handler set it)."""
        if self.finished:
            return  # e.g. shutdown cancelled a request just after its last byte went out
        if self.started and self.end_events_with_error is not None:
            await self.end_events_with_error(error)
        elif self.started:
            await self.event(error.body)
            await self.end_events()
        else:
            await self.respond(error.status, msgspec.json.encode(error.body), headers=error.headers)

    async def start_events(self) -> None:
        """Start a ``text/event-stream`` response."""
        self.started = True
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # proxies: pass events on as they come
        ]
        await self._send_whole({"type": "http.response.start", "status": 200, "headers": headers})

    async def event(self, value: Any, *, name: str | None = None) -> None:
        """Send one server-sent event whose data is ``value`` as JSON (named ``name``: an ``event:`` line)."""
        head = b"event: " + name.encode() + b"\n" if name is not None else b""
        await self._send_body(head + b"data: " + msgspec.json.encode(value) + b"\n\n", more=True)

    async def end_events(self, *, done: bool = True) -> None:
        """End the response, after ``data: [DONE]`` unless ``done`` is False (the Responses API has none)."""
        await self._send_body(b"data: [DONE]\n\n" if done else b"", more=False)

    async def _send_body(self, data: bytes, *, more: bool) -> None:
        try:
            await self._send_whole({"type": "http.response.body", "body": data, "more_body": more})
        except OSError as exc:  # some servers raise on a send after the client left (uvicorn does)
            raise ClientDisconnected from exc

    async def _send_whole(self, message: Message) -> None:
        # Shielded: a cancellation (the client left, the server shuts down) lands between two
        # messages, never inside one, so what follows (a last error event) is framed correctly.
        if message["type"] == "http.response.start" and self._response_headers:
            message["headers"] = [*message["headers"], *self._response_headers]
        with anyio.CancelScope(shield=True):
            await self._send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True

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


def _shutting_down(exchange: Exchange) -> HTTPError:
    return HTTPError(
        503, "the server is shutting down", type="server_error", code="shutting_down", headers=exchange.close_headers()
    )


def _origins(cors_origins: Sequence[str] | str | None) -> frozenset[str]:
    """The allowed origins, normalised as browsers send them (``scheme://host[:port]``, lower case)."""
    if cors_origins is None:
        return frozenset()
    if isinstance(cors_origins, str):
        raise ValueError("cors_origins must be a sequence of origins, not one string")
    origins = set()
    for origin in cors_origins:
        normalised = origin.strip().rstrip("/").lower()
        if normalised != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", normalised):
            raise ValueError(f"cors_origins: {origin!r} is not an origin such as 'https://example.com' (or '*')")
        origins.add(normalised)
    return frozenset(origins)


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
        body_timeout: float = DEFAULT_BODY_TIMEOUT,
        max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
        cors_origins: Sequence[str] | None = None,
        max_choices: int = DEFAULT_MAX_CHOICES,
        max_completion_logprobs: int = DEFAULT_MAX_COMPLETION_LOGPROBS,
        max_top_logprobs: int = DEFAULT_MAX_TOP_LOGPROBS,
    ) -> None:
        from asyncllm.http._completions import CompletionHandlers
        from asyncllm.http._embeddings import EmbeddingHandlers
        from asyncllm.http._responses import ResponsesHandler
        from asyncllm.http._tokenize import TokenizerHandlers
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
        if not body_timeout > 0:  # also refuses NaN
            raise ValueError(f"body_timeout must be > 0 seconds, got {body_timeout}")
        if max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {max_concurrent_requests}")
        self.engine = engine
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.max_concurrent_requests = max_concurrent_requests
        self.cors_origins = _origins(cors_origins)
        self.model_name = model_name if model_name is not None else _default_model_name(engine)
        # Clients may name the model by its served name or by the path it was opened from.
        aliases = {os.fspath(engine.options.model)} if engine.options.model is not None else set()
        self.model_names = frozenset({self.model_name} | aliases)
        self.created = int(time.time())
        # The cancel scope of each counted request in flight: their number is what the limit
        # counts, and shutdown() cancels them. One event loop serves the app, so a set suffices.
        self._in_flight: set[anyio.CancelScope] = set()
        self._shutting_down = False
        self._drained: anyio.Event | None = None  # set when the last request in flight ends, during shutdown
        handlers = CompletionHandlers(self)
        # path -> (method -> (handler, needs api key)); paths are relative to the mount point, "/v1" optional.
        self._routes: dict[str, dict[str, tuple[Handler, bool]]] = {
            "/models": {"GET": (self._models, True)},
            "/completions": {"POST": (handlers.completions, True)},
            "/chat/completions": {"POST": (handlers.chat_completions, True)},
            "/responses": {"POST": (ResponsesHandler(self).create, True)},
            "/embeddings": {"POST": (EmbeddingHandlers(self).embeddings, True)},
            "/health": {"GET": (self._health, False)},
            "/metrics": {"GET": (self._metrics, False)},
        }
        self._routes.update(_tokenizer_routes(TokenizerHandlers(self)))

    @property
    def requests_in_flight(self) -> int:
        """Requests being received or answered now (those ``max_concurrent_requests`` counts)."""
        return len(self._in_flight)

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

    async def shutdown(self, grace: float = 0.0) -> None:
        """Stop taking requests and end those in flight, for a server that is about to stop.

        From the call on, new requests (``/health`` included, so load balancers look elsewhere)
        are answered 503 ``shutting_down`` with ``Connection: close``. Requests in flight may
        finish within ``grace`` seconds; those still running then are ended: a stream with a last
        error event (``shutting_down``) and ``data: [DONE]``, a whole response with that 503.
        Their engine requests are aborted as their streams close. Calling it again is harmless.

        Args:
            grace: Seconds the requests in flight may take to finish on their own (0: end them now).
        """
        self._shutting_down = True
        if self._in_flight and grace > 0:
            self._drained = anyio.Event()
            with anyio.move_on_after(grace):
                await self._drained.wait()
        for scope in list(self._in_flight):
            scope.cancel()  # each request answers on its way out (see _run_counted)

    # -- plumbing --------------------------------------------------------------------------------

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        cors = self._cors_headers(scope)
        exchange = Exchange(scope, receive, send, self.max_body_bytes, self.body_timeout, cors)
        try:
            if b"content-length" in exchange.headers and b"transfer-encoding" in exchange.headers:
                # RFC 9112 6.3: a message with both may be an attempt at request smuggling; the
                # server must close the connection after answering it.
                raise HTTPError(
                    400,
                    "a request may not have both Content-Length and Transfer-Encoding",
                    code="invalid_framing",
                    headers=exchange.close_headers(),
                )
            if scope["method"] == "OPTIONS":
                await self._options(exchange, cors)
                return
            handler = self._route(exchange)
            if _route_path(scope) in _UNCOUNTED:
                await handler(exchange)
            else:
                await self._run_counted(exchange, handler)
        except ClientDisconnected:
            return  # nobody to answer; the request's streams were closed on the way out (aborted)
        except Exception as exc:
            try:
                await exchange.respond_error(error_for(exc))
            except ClientDisconnected:
                return

    async def _run_counted(self, exchange: Exchange, handler: Handler) -> None:
        """Run ``handler`` as one of the ``max_concurrent_requests``, or refuse it at once.

        Raises:
            HTTPError: 503 when the server is full or shutting down (closing the connection, so
                that a refused client holds no file descriptor), or when shutdown ended it.
        """
        if self._shutting_down:
            raise _shutting_down(exchange)
        if len(self._in_flight) >= self.max_concurrent_requests:
            raise HTTPError(
                503,
                f"the server is answering {self.max_concurrent_requests} requests already; retry later",
                type="server_error",
                code="too_many_requests",
                headers=((b"retry-after", b"1"), *exchange.close_headers()),
            )
        with anyio.CancelScope() as scope:
            self._in_flight.add(scope)
            try:
                await handler(exchange)
            finally:
                self._in_flight.discard(scope)
                if not self._in_flight and self._drained is not None:
                    self._drained.set()
        if scope.cancelled_caught:  # only shutdown() cancels it
            raise _shutting_down(exchange)

    def _cors_headers(self, scope: Scope) -> tuple[tuple[bytes, bytes], ...]:
        """The headers that let a page from an allowed origin read the response (none otherwise)."""
        if not self.cors_origins:
            return ()
        origin = next((bytes(v) for k, v in scope.get("headers", []) if bytes(k).lower() == b"origin"), None)
        if origin is None:
            return ((b"vary", b"origin"),)
        if "*" not in self.cors_origins and origin.decode("latin-1").lower() not in self.cors_origins:
            return ((b"vary", b"origin"),)
        return ((b"access-control-allow-origin", origin), (b"vary", b"origin"))

    async def _options(self, exchange: Exchange, cors: tuple[tuple[bytes, bytes], ...]) -> None:
        """Answer ``OPTIONS``: 204 with ``Allow``; to a CORS preflight from an allowed origin, with
        the ``Access-Control-Allow-*`` headers too (the browser then sends the request)."""
        methods = self._methods(exchange)
        if methods is None:
            raise HTTPError(404, f"no such endpoint: {exchange.scope['path']}", code="not_found")
        allowed = ", ".join(["OPTIONS", *sorted(methods)]).encode()
        headers: list[tuple[bytes, bytes]] = [(b"allow", allowed)]
        asked = exchange.headers.get(b"access-control-request-method")
        if asked is not None and any(name == b"access-control-allow-origin" for name, _ in cors):
            headers += [(b"access-control-allow-methods", allowed), (b"access-control-max-age", _PREFLIGHT_MAX_AGE)]
            # The origin is trusted: let its page send the headers it asks for (the openai client
            # sends x-stainless-* headers besides authorization and content-type).
            asked_headers = exchange.headers.get(b"access-control-request-headers")
            if asked_headers:
                headers.append((b"access-control-allow-headers", asked_headers))
        await exchange.respond_empty(204, headers)

    def _methods(self, exchange: Exchange) -> dict[str, tuple[Handler, bool]] | None:
        path = _route_path(exchange.scope)
        methods = self._routes.get(path)
        model_id = path.removeprefix("/models/") if path.startswith("/models/") else None
        if methods is None and model_id:
            methods = {"GET": (lambda ex: self._model(ex, model_id), True)}
        return methods

    def _route(self, exchange: Exchange) -> Handler:
        method = exchange.scope["method"]
        methods = self._methods(exchange)
        if methods is None:
            raise HTTPError(404, f"no such endpoint: {exchange.scope['path']}", code="not_found")
        if method not in methods:
            allowed = ", ".join(sorted(methods)).encode()
            raise HTTPError(
                405,
                f"{method} is not allowed here; use {allowed.decode()}",
                code="method_not_allowed",
                headers=((b"allow", allowed),),
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
        if self._shutting_down:
            raise _shutting_down(exchange)
        self.engine.check_health()  # EngineClosedError / EngineDeadError -> 503
        await exchange.respond_json(200, {"status": "ok"})

    async def _metrics(self, exchange: Exchange) -> None:
        page = render_metrics(self.engine.metrics, self.engine.statistics())
        await exchange.respond(200, page.encode(), METRICS_CONTENT_TYPE.encode())


def _tokenizer_routes(handlers: TokenizerHandlers) -> dict[str, dict[str, tuple[Handler, bool]]]:
    # vLLM serves these without /v1; _route_path strips it, so /v1/tokenize works as well.
    return {
        "/tokenize": {"POST": (handlers.tokenize, True)},
        "/detokenize": {"POST": (handlers.detokenize, True)},
    }


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
    """The default model's name, a hub id as given (``org/name``), else the local folder's name."""
    from asyncllm._model_source import hub_id

    if engine.options.model is None:
        from asyncllm.default_model import DEFAULT_MODEL_NAME
        return DEFAULT_MODEL_NAME
    repo_id = hub_id(engine.options.model)
    if repo_id is not None:
        return repo_id
    return Path(engine.options.model).name or os.fspath(engine.options.model)


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_name: str | None = None,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    cors_origins: Sequence[str] | None = None,
    max_choices: int = DEFAULT_MAX_CHOICES,
    max_completion_logprobs: int = DEFAULT_MAX_COMPLETION_LOGPROBS,
    max_top_logprobs: int = DEFAULT_MAX_TOP_LOGPROBS,
) -> OpenAIApp:
    """An OpenAI-compatible ASGI application over ``engine``.

    Endpoints (each also without the ``/v1`` prefix, so the app can be mounted at ``/v1``):
    ``GET /v1/models``, ``GET /v1/models/{model}``, ``POST /v1/completions``,
    ``POST /v1/chat/completions`` (``stream: true`` answers with server-sent events ending in
    ``data: [DONE]``), ``POST /v1/responses`` (a minimal, stateless Responses API; see
    docs/http.md), ``POST /v1/embeddings``, vLLM's ``POST /tokenize`` and ``POST /detokenize``,
    ``GET /health`` and ``GET /metrics`` (Prometheus text format). ``OPTIONS`` is answered on each
    (CORS preflights).

    The app does not own a running engine: open it around the server (``async with engine:``
    then serve), or in the lifespan of the framework the app is mounted into. Served alone by an
    ASGI server with lifespan support, an engine that was never entered is entered at startup and
    left at shutdown. A server that stops should call ``await app.shutdown(grace)`` first, so
    open streams end with an error event rather than a cut connection.

    Request bodies must be ``Content-Type: application/json`` (415 otherwise): a web page can
    send any other type to any origin without a CORS preflight, so without this (and without an
    ``api_key``) every page a user of the server opens could start generations on it.

    Args:
        engine: The engine to serve (entered, or about to be; see above).
        api_key: When set, the ``/v1`` endpoints require ``Authorization: Bearer <api_key>``
            (``/health`` and ``/metrics`` stay open, for load balancers and scrapers).
        max_body_bytes: Larger request bodies are refused with 413.
        model_name: The model's name in ``/v1/models`` and in responses; requests naming another
            model get 404. Default: the model folder's name (the default model's name for None).
        body_timeout: Seconds within which a request body must arrive whole; otherwise 408 and the
            connection is closed, so slow clients cannot hold connections.
        max_concurrent_requests: Requests in flight (their body being received or their answer
            being produced) beyond which a request is refused at once with 503
            ``too_many_requests`` and its connection closed. ``/health`` and ``/metrics`` are not
            counted, so monitoring works when the server is full.
        cors_origins: Origins (``"https://app.example.com"``, or ``"*"`` for any) whose web pages
            may call the API: their preflights are granted and responses to them carry
            ``Access-Control-Allow-Origin``. None (the default): no cross-origin access.
        max_choices: The most choices one request may ask for: its prompts times ``n`` (a 400
            beyond). The engine's own limits (``Engine.open``'s ``max_logprobs``,
            ``max_prompt_bytes``, ``max_stop``, ...) apply as well.
        max_completion_logprobs: The largest ``logprobs`` of ``/v1/completions`` (OpenAI's 5).
        max_top_logprobs: The largest ``top_logprobs`` of ``/v1/chat/completions`` (OpenAI's 20).

    Returns:
        The ASGI application (a plain callable; no framework needed).

    Raises:
        ValueError: ``max_body_bytes`` or ``max_choices`` < 1, a negative logprobs limit, an empty
            ``api_key``, ``body_timeout`` <= 0, ``max_concurrent_requests`` < 1, or a ``cors_origins``
            entry that is not an origin.
    """
    return OpenAIApp(
        engine,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        model_name=model_name,
        body_timeout=body_timeout,
        max_concurrent_requests=max_concurrent_requests,
        cors_origins=cors_origins,
        max_choices=max_choices,
        max_completion_logprobs=max_completion_logprobs,
        max_top_logprobs=max_top_logprobs,
    )
