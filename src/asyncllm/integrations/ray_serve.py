"""Ray Serve: the OpenAI app as a deployment whose replicas Serve starts, routes to, scales and heals.

    from ray import serve
    from asyncllm.integrations.ray_serve import openai_app

    serve.run(openai_app("path/to/model", autoscaling_config={"min_replicas": 1, "max_replicas": 4}))

Each replica is one Ray actor process holding one engine and ``asyncllm.http.create_app`` over it.
The engine stays what it is everywhere else: plain objects in the replica's process and event loop.
Serve runs the app's ASGI lifespan in the replica's own event loop when the replica starts, which
opens the engine (loads the model), and again when Serve stops the replica, which closes it. Serve's
HTTP proxy sends each request to a replica (by default the less busy of two picked at random),
never more than ``max_ongoing_requests`` to one; Serve's health check asks the app's ``GET /health``
and replaces a replica whose engine died. Every response names its replica in the
``x-asyncllm-replica`` header. See docs/scale-out.md.

Ray is an optional dependency (``pip install 'asyncllm[ray]'``): importing this module does not
import it; building a deployment does, and says how to install it when it is missing.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from asyncllm.engine._engine import Engine
from asyncllm.http import create_app

if TYPE_CHECKING:
    from ray.serve import Application

__all__ = ["DEFAULT_NAME", "REPLICA_HEADER", "openai_app"]

DEFAULT_NAME = "asyncllm"
"""The deployment's default name (Serve's replica actors are named after it)."""

REPLICA_HEADER = b"x-asyncllm-replica"
"""The response header naming the replica that answered (Serve's id for it), for logs and tests."""

_Scope = MutableMapping[str, Any]
_Message = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[_Message]]
_Send = Callable[[_Message], Awaitable[None]]
_ASGIApp = Callable[[_Scope, _Receive, _Send], Awaitable[None]]


def _import_serve() -> ModuleType:
    try:
        from ray import serve
    except ImportError as exc:
        raise ImportError(
            "asyncllm.integrations.ray_serve needs Ray Serve, which is not installed: "
            "pip install 'asyncllm[ray]' (or pip install 'ray[serve]')"
        ) from exc
    return serve


def openai_app(
    model: str | os.PathLike[str] | None = None,
    *,
    engine_options: Mapping[str, Any] | None = None,
    app_options: Mapping[str, Any] | None = None,
    name: str = DEFAULT_NAME,
    num_replicas: int | None = None,
    autoscaling_config: Mapping[str, Any] | None = None,
    max_ongoing_requests: int | None = None,
    max_queued_requests: int | None = None,
    ray_actor_options: Mapping[str, Any] | None = None,
    session_affinity: bool = False,
    deployment_options: Mapping[str, Any] | None = None,
) -> Application:
    """The OpenAI-compatible app over ``model`` as a Ray Serve application, for ``serve.run``.

    The options are checked here, in the calling process, by building an engine and an app that are
    never started: a typo fails at this call rather than in every replica. Serve's admission limits
    default to the engine's own: a replica takes as many requests as its batch runs at once, and
    the rest wait in Serve's queue, bounded as the engine's waiting queue is, where whichever
    replica frees first takes them and where autoscaling sees them.

    Args:
        model: As ``Engine.open`` takes it: a local folder (present on every node), a hub id, or
            None for the default model.
        engine_options: Keywords of ``Engine.open`` (``device``, ``max_num_seqs``, ...), used by
            every replica; ``kv_cache_prefault_wait`` is on unless they turn it off, as in ``asyncllm serve``
            (a replica is ready, and routed requests, once its KV cache is resident).
        app_options: Keywords of ``asyncllm.http.create_app`` (``api_key``, ``model_name``, ...).
        name: The deployment's name.
        num_replicas: A fixed number of replicas (default 1 without ``autoscaling_config``).
        autoscaling_config: Serve's autoscaling on ongoing requests (``min_replicas``,
            ``max_replicas``, ``target_ongoing_requests``, ...; Serve's ``AutoscalingConfig``).
            ``target_ongoing_requests`` defaults to half of ``max_ongoing_requests`` rather than
            Serve's 2: an engine batches, and a new replica needs a model load's time, so scaling
            starts before the batches are full.
        max_ongoing_requests: Requests one replica takes at once; Serve queues the rest. Default:
            the engine's ``max_num_seqs``, at most the app's ``max_concurrent_requests`` (beyond
            which the app would refuse what Serve sent it).
        max_queued_requests: Requests each Serve proxy (or handle) holds waiting for a replica;
            beyond it Serve answers 503. Default: the engine's ``max_waiting_requests``
            (unbounded, -1, when that is None).
        ray_actor_options: Each replica's Ray resources (``{"num_gpus": 1}``, ``{"num_cpus": 4}``);
            Ray sets ``OMP_NUM_THREADS`` to ``num_cpus``, which the engine's CPU thread count follows
            unless ``engine_options`` sets ``num_threads``.
        session_affinity: Route requests that carry the same ``x-session-id`` header to the same
            replica (Serve's consistent-hash router; experimental in Ray), so a conversation's
            growing prefix stays in one replica's prefix cache. Requests without the header are
            spread by a hash of their request id. See docs/scale-out.md, "Prefix locality".
        deployment_options: Any other keyword of ``serve.deployment`` (``health_check_period_s``,
            ``graceful_shutdown_timeout_s``, ...).

    Returns:
        A Serve application: ``serve.run(app)``, or ``serve.run(app, route_prefix="/")``.

    Raises:
        ImportError: Ray Serve is not installed.
        TypeError: An engine or app option does not exist.
        ValueError: An option is out of range; both ``num_replicas`` and ``autoscaling_config``;
            ``max_ongoing_requests`` above the app's ``max_concurrent_requests``; a key of
            ``deployment_options`` that an argument of this function sets.
    """
    serve = _import_serve()
    engine_keywords = {"kv_cache_prefault_wait": True, **(engine_options or {})}
    app_keywords = dict(app_options or {})
    checked = create_app(Engine.open(model, **engine_keywords), **app_keywords)  # never entered: validation only
    ongoing = _max_ongoing_requests(
        max_ongoing_requests, checked.engine.options.max_num_seqs, checked.max_concurrent_requests
    )
    waiting = checked.engine.options.max_waiting_requests
    queued = max_queued_requests if max_queued_requests is not None else (-1 if waiting is None else waiting)
    if queued < -1 or queued == 0:
        raise ValueError(f"max_queued_requests must be >= 1, or -1 for no limit, got {queued}")

    options: dict[str, Any] = {"max_ongoing_requests": ongoing, "max_queued_requests": queued}
    if num_replicas is not None and autoscaling_config is not None:
        raise ValueError("give num_replicas or autoscaling_config, not both")
    if autoscaling_config is not None:
        options["autoscaling_config"] = {"target_ongoing_requests": max(1, ongoing // 2), **autoscaling_config}
    else:
        replicas = 1 if num_replicas is None else num_replicas
        if replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {replicas}")
        options["num_replicas"] = replicas
    if ray_actor_options is not None:
        options["ray_actor_options"] = dict(ray_actor_options)
    if session_affinity:
        # Imported here, so that a Ray without it fails at this call rather than in Serve's controller.
        from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

        options["request_router_config"] = {"request_router_class": ConsistentHashRouter}
    extra = dict(deployment_options or {})
    clash = sorted(set(extra) & (set(options) | {"name", "num_replicas", "autoscaling_config"}))
    if clash:
        raise ValueError(f"deployment_options sets {', '.join(clash)}, which an argument of openai_app sets")

    replica_class = serve.ingress()(_OpenAIReplica)
    deployment = serve.deployment(replica_class, name=name, **options, **extra)
    application: Application = deployment.bind(model, engine_keywords, app_keywords)
    return application


def _max_ongoing_requests(requested: int | None, max_num_seqs: int, max_concurrent_requests: int) -> int:
    if requested is None:
        return min(max_num_seqs, max_concurrent_requests)
    if not 1 <= requested <= max_concurrent_requests:
        raise ValueError(
            f"max_ongoing_requests must be between 1 and the app's max_concurrent_requests "
            f"({max_concurrent_requests}), got {requested}"
        )
    return requested


class _OpenAIReplica:
    """One replica: an engine and the OpenAI app over it.

    Serve wraps the class (``serve.ingress``) and builds it in the replica's actor. The engine is
    entered by the app's lifespan, which Serve runs in the replica's event loop: the engine's task
    group lives in that loop, and is left in the same task when Serve stops the replica.
    """

    def __init__(
        self, model: str | os.PathLike[str] | None, engine_options: dict[str, Any], app_options: dict[str, Any]
    ) -> None:
        self._app = create_app(Engine.open(model, **engine_options), **app_options)

    def __serve_build_asgi_app__(self) -> _ASGIApp:
        """The ASGI app Serve serves (Serve's hook, called in the replica after the constructor)."""
        from ray import serve

        replica = serve.get_replica_context().replica_id.unique_id
        return _NamedReplica(self._app, str(replica).encode())

    async def check_health(self) -> None:
        """Serve's periodic health check: what the app's ``GET /health`` says, asked in-process.

        Raises:
            RuntimeError: ``/health`` did not answer 200 (the engine died, or is not running);
                Serve then replaces the replica.
        """
        status, body = await _get(self._app, "/health")
        if status != 200:
            raise RuntimeError(f"GET /health answered {status}: {body.decode('utf-8', 'replace')}")


class _NamedReplica:
    """The app, with each response naming the replica that gave it (``REPLICA_HEADER``)."""

    def __init__(self, app: _ASGIApp, replica: bytes) -> None:
        self._app = app
        self._replica = replica

    async def __call__(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def named(message: _Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, self._replica)]}
            await send(message)

        await self._app(scope, receive, named)


async def _get(app: _ASGIApp, path: str) -> tuple[int, bytes]:
    """``GET path`` on ``app`` in-process (no socket): its status and body."""
    scope: _Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
    }
    status = 0
    parts: list[bytes] = []

    async def receive() -> _Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: _Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            parts.append(bytes(message.get("body", b"")))

    await app(scope, receive, send)
    return status, b"".join(parts)
