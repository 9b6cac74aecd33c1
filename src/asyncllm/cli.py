"""The ``asyncllm`` command.

    asyncllm generate PROMPT     stream a completion to the terminal
    asyncllm chat                an interactive, streaming conversation (stdin lines in, replies out)
    asyncllm serve               the OpenAI-compatible HTTP server (hypercorn, asyncio or trio)
    asyncllm bench NAME [ARGS]   run benchmarks/NAME.py with ARGS

Every option of ``Engine.open`` is a flag of ``generate``, ``chat`` and ``serve`` (read from its
signature, so a new engine option is a new flag). Progress (model conversion and loading) and
statistics go to stderr; only the generated text goes to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import typing
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from asyncllm.engine._engine import Engine
from asyncllm.engine._options import EngineOptions, option_doc
from asyncllm.errors import AsyncLLMError, ChatTemplateError, InvalidRequestError
from asyncllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hypercorn.config import Config, Sockets

    from asyncllm.http import OpenAIApp
logger = logging.getLogger("asyncllm")

_ENGINE_PREFIX = "engine__"  # argparse dest prefix of the engine options
_NOT_FLAGS = frozenset({"model"})  # added by hand, before the others


def _engine_parameters() -> list[tuple[str, Any, Any]]:
    """(name, type, default) of each ``EngineOptions`` field that makes sense as a flag."""
    hints = typing.get_type_hints(EngineOptions)
    return [(f.name, hints[f.name], f.default) for f in dataclasses.fields(EngineOptions) if f.name not in _NOT_FLAGS]


def _scalar(kind: Any) -> Any:
    """``int`` for ``int`` and ``int | None``, and so on; ``str`` for anything else."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if set(args) == {int, float}:  # bytes or a fraction, e.g. kv_cache_memory
        return _int_or_float
    base = args[0] if len(args) == 1 else kind
    return base if base in (bool, int, float, str) else str


def _int_or_float(text: str) -> int | float:
    """``"1073741824"`` is an int, ``"0.5"`` a float."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine options (those of Engine.open: asyncllm.EngineOptions)")
    group.add_argument("--model", default=None, help=option_doc("model"))
    taken = {action.dest for action in parser._actions}
    for name, kind, default in _engine_parameters():
        flag = name.replace("_", "-")
        if name in taken:  # e.g. the sampling --seed: the engine's one becomes --engine-seed
            flag = f"engine-{flag}"
        help_text = option_doc(name).replace("%", "%%")  # argparse formats help with %
        scalar = _scalar(kind)
        dest = _ENGINE_PREFIX + name
        if scalar is bool:
            group.add_argument(
                f"--{flag}", dest=dest, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            metavar = name.upper()
            group.add_argument(
                f"--{flag}", dest=dest, type=scalar, default=default, metavar=metavar, help=f"{help_text} [{default}]"
            )
    parser.add_argument(
        "--backend", default="asyncio", choices=["asyncio", "trio"], help="the event loop to run on [asyncio]"
    )


def _open_engine(args: argparse.Namespace) -> Engine:
    options = {k.removeprefix(_ENGINE_PREFIX): v for k, v in vars(args).items() if k.startswith(_ENGINE_PREFIX)}
    logger.info("loading %s ...", args.model or "the default model")
    return Engine.open(args.model, **options)


def _add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help=f"the most tokens to generate [{max_tokens}]")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy [0.0]")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, default=None, help="seed of this request's sampling")


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


# -- generate ------------------------------------------------------------------------------------


async def _generate(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    async with _open_engine(args) as engine:
        start = time.perf_counter()
        first_token_at = None
        num_tokens = 0
        messages = [{"role": "user", "content": args.prompt}]
        stream = engine.chat_stream(messages, params) if args.chat else engine.stream(args.prompt, params)
        async with stream:
            async for chunk in stream:
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                num_tokens += len(chunk.token_ids)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    ttft = (first_token_at or start) - start
    decode_time = elapsed - ttft
    rate = (num_tokens - 1) / decode_time if num_tokens > 1 and decode_time > 0 else 0.0
    print(
        f"[{num_tokens} tokens in {elapsed:.2f} s; first token after {ttft:.3f} s; {rate:.1f} tokens/s after it]",
        file=sys.stderr,
    )


# -- chat ----------------------------------------------------------------------------------------

_CHAT_HELP = "Type a message and press Enter. /reset starts over, /exit (or end of input) quits."


async def _chat(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    async with _open_engine(args) as engine:
        messages = list(base)
        if interactive:
            print(_CHAT_HELP, file=sys.stderr)
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            # A blocking read in a worker thread keeps the event loop (and the engine) running.
            line = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
            if not line:
                break  # end of input
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                messages = list(base)
                print("(conversation cleared)", file=sys.stderr)
                continue
            messages.append({"role": "user", "content": text})
            try:
                stream = engine.chat_stream(messages, params)
            except ChatTemplateError:
                raise
            except InvalidRequestError as exc:  # e.g. the conversation outgrew max_model_len
                messages.pop()
                print(f"error: {exc} (/reset starts over)", file=sys.stderr)
                continue
            reply: list[str] = []
            async with stream:
                async for chunk in stream:
                    reply.append(chunk.text)
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()
            messages.append({"role": "assistant", "content": "".join(reply)})


# -- serve ---------------------------------------------------------------------------------------


DEFAULT_GRACEFUL_TIMEOUT = 5.0
"""Seconds the requests in flight at SIGTERM may take to finish before they are ended."""

DEFAULT_SEND_TIMEOUT = 15.0
"""Seconds a client may accept no data before its connection is aborted (TCP_USER_TIMEOUT)."""

_CONNECTION_GRACE = 2.0  # after the app ended its requests: time for their last bytes, then hypercorn cuts

# accept(2) fails with these when the process or the system is out of descriptors or buffers.
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


async def _wait_for_signal() -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("received %s, shutting down", signal.Signals(signum).name)
            return


class _PacedAcceptSocket(socket.socket):
    """A listening socket that reports one accept failure per wake-up of asyncio's accept loop.

    When ``accept()`` fails for lack of file descriptors, asyncio's selector loop
    (``BaseSelectorEventLoop._accept_connection``, CPython 3.11) does not stop: it calls
    ``accept()`` again, up to the listen backlog (100) times in the same wake-up, logging the
    error with its traceback and scheduling a retry each time, and each retry does the same:
    thousands of records a second (147 MB of log in 50 s). After a failure, the next call says
    "nothing waiting" (``BlockingIOError``), which ends that loop: one record, and one retry a
    second later (asyncio's ``ACCEPT_RETRY_DELAY``). Harmless where the loop stops by itself;
    trio's accept loop does not use it (trio wraps the stdlib socket and insists on its type).
    """

    _failed = False

    def accept(self) -> tuple[socket.socket, Any]:
        if self._failed:
            self._failed = False
            raise BlockingIOError(errno.EAGAIN, "accept() paused after running out of resources")
        try:
            return super().accept()
        except OSError as exc:
            if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                self._failed = True
            raise

    @classmethod
    def adopt(cls, sock: socket.socket) -> _PacedAcceptSocket:
        """The same listening socket (its descriptor moves over), as this class."""
        return cls(sock.family, sock.type, sock.proto, fileno=sock.detach())


def _hypercorn_config(
    bind: list[str], *, backend: str, access_log: bool, graceful_timeout: float, send_timeout: float
) -> Config:
    """hypercorn's configuration for ``asyncllm serve`` (and the tests that serve like it).

    hypercorn closes a connection that has sent no complete request head within
    ``keep_alive_timeout`` (5 s, also the limit on idle keep-alive connections) and caps a head at
    ``h11_max_incomplete_size`` (16 KiB); the app bounds the body (``body_timeout``). hypercorn's
    ``read_timeout`` stays off: it would cut streams, during which clients send nothing.

    A client that stops reading is bounded by the kernel: ``TCP_USER_TIMEOUT`` (Linux; accepted
    connections inherit it from the listening socket) aborts a connection whose sent data stays
    unacknowledged, or unsent for a closed receive window, for ``send_timeout`` seconds. Nothing
    above the socket can: hypercorn's trio server shields its sends from cancellation, and its
    asyncio server waits, uncancellably, for a closing connection to flush.
    """
    from hypercorn.config import Config, Sockets

    if not graceful_timeout >= 0:
        raise ValueError(f"--graceful-timeout must be >= 0 seconds, got {graceful_timeout}")
    if not send_timeout > 0:
        raise ValueError(f"--send-timeout must be > 0 seconds, got {send_timeout}")

    class ServeConfig(Config):
        def create_sockets(self) -> Sockets:
            sockets = super().create_sockets()
            streams = [*sockets.secure_sockets, *sockets.insecure_sockets]
            user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
            for sock in streams:
                if user_timeout is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, user_timeout, max(1, round(send_timeout * 1000)))
            if backend != "asyncio":
                return sockets  # trio wraps the stdlib socket itself (and insists on its exact type)
            return Sockets(
                [_PacedAcceptSocket.adopt(s) for s in sockets.secure_sockets],
                [_PacedAcceptSocket.adopt(s) for s in sockets.insecure_sockets],
                sockets.quic_sockets,
            )

    config = ServeConfig()
    config.bind = bind
    # Through the logging module (to stderr, as set up in main) rather than hypercorn's own handlers.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = logging.getLogger("hypercorn.access") if access_log else None
    # How long hypercorn waits for connections after it stops accepting, before it cancels them:
    # the app's own grace (it then ends its requests with an error), plus time to send that.
    config.graceful_timeout = graceful_timeout + _CONNECTION_GRACE
    return config


class _AcceptFailureFilter(logging.Filter):
    """Lets one "accept() failed for lack of resources" record through per second, without its
    traceback (always the same), saying how many were held back since the last.

    Out of file descriptors, trio's accept loop logs one with a traceback every 0.1 s and
    asyncio's one per retry; each failed accept is the same news, and a flood of it fills disks.
    asyncio's traceback for a retry that fires after the server closed its socket is dropped.
    """

    def __init__(self, interval: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._interval = interval
        self._clock = clock
        self._next = -math.inf
        self._held_back = 0

    @staticmethod
    def _is_accept_failure(record: logging.LogRecord) -> bool:
        if record.name == "trio.serve_listeners":
            return True
        return record.name == "asyncio" and str(record.msg).startswith("socket.accept() out of system resource")

    @staticmethod
    def _is_retry_after_close(record: logging.LogRecord) -> bool:
        # asyncio's accept retry, scheduled a second after a failure, still runs when the server
        # closed its socket meanwhile and fails on the closed descriptor: a traceback about nothing.
        error = record.exc_info[1] if record.exc_info else None
        return (
            record.name == "asyncio"
            and str(record.msg).startswith("Exception in callback BaseSelectorEventLoop._start_serving")
            and isinstance(error, ValueError)
        )

    def filter(self, record: logging.LogRecord) -> bool:
        if self._is_retry_after_close(record):
            return False
        if not self._is_accept_failure(record):
            return True
        now = self._clock()
        if now < self._next:
            self._held_back += 1
            return False
        self._next = now + self._interval
        message = record.getMessage().split("\n", 1)[0]
        error = record.exc_info[1] if record.exc_info else None
        if record.name == "asyncio" and error is not None:
            message += f": {error}"
        if self._held_back:
            message += f" ({self._held_back} more like it since the last report)"
        self._held_back = 0
        record.msg, record.args, record.exc_info, record.exc_text = message, (), None, None
        return True


@contextlib.contextmanager
def _accept_failures_rate_limited() -> Iterator[None]:
    accept_failures = _AcceptFailureFilter()
    loggers = [logging.getLogger("asyncio"), logging.getLogger("trio.serve_listeners")]
    for each in loggers:
        each.addFilter(accept_failures)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(accept_failures)


async def _serve_app(
    app: OpenAIApp,
    config: Config,
    *,
    backend: str,
    graceful_timeout: float,
    stop: Callable[[], Awaitable[None]] = _wait_for_signal,
) -> None:
    """Serve ``app`` with hypercorn on the running event loop until ``stop`` returns, then shut down.

    Shutdown is bounded: hypercorn stops accepting and closes idle connections, while
    ``app.shutdown(graceful_timeout)`` lets the requests in flight finish for up to
    ``graceful_timeout`` seconds and then ends the rest (a stream gets a last error event and
    ``[DONE]``); hypercorn cancels any connection still open ``_CONNECTION_GRACE`` seconds later,
    but for one blocked on a client that stopped reading, which the send timeout ends (see
    ``_hypercorn_config``).

    Args:
        app: The application (its engine is already running).
        config: From ``_hypercorn_config``.
        backend: ``"asyncio"`` or ``"trio"``: the running event loop's.
        graceful_timeout: Seconds requests in flight may take to finish once ``stop`` returned.
        stop: Returns when the server should stop (default: at SIGINT or SIGTERM).
    """
    async with anyio.create_task_group() as task_group:

        async def shutdown_trigger() -> None:
            await stop()
            task_group.start_soon(app.shutdown, graceful_timeout)  # runs while hypercorn stops accepting

        with _accept_failures_rate_limited():
            if backend == "trio":
                from hypercorn.trio import serve as trio_serve

                await trio_serve(app, config, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]
            else:
                from hypercorn.asyncio import serve as asyncio_serve

                with _send_timeouts_expected():
                    await asyncio_serve(app, config, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]


@contextlib.contextmanager
def _send_timeouts_expected() -> Iterator[None]:
    """On the running asyncio loop: a connection aborted by the send timeout is one log line.

    hypercorn's asyncio server lets the ``ETIMEDOUT`` of such a connection escape its connection
    task, to the loop's exception handler (a traceback per connection). It is expected: the send
    timeout did it. Everything else goes to the handler that was there.
    """
    import asyncio

    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if isinstance(error, OSError) and error.errno == errno.ETIMEDOUT:
            logger.info("aborted a connection whose client accepted no data within the send timeout")
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)
    try:
        yield
    finally:
        loop.set_exception_handler(previous)


async def _serve(args: argparse.Namespace) -> None:
    from asyncllm.http import create_app
    host = f"[{args.host}]" if ":" in args.host else args.host
    config = _hypercorn_config(
        [f"{host}:{args.port}"],
        backend=args.backend,
        access_log=args.access_log,
        graceful_timeout=args.graceful_timeout,
        send_timeout=args.send_timeout,
    )
    async with _open_engine(args) as engine:
        app = create_app(
            engine,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            model_name=args.served_model_name,
            body_timeout=args.body_timeout,
            max_concurrent_requests=args.max_concurrent_requests,
            cors_origins=args.cors_origins,
            max_choices=args.max_choices,
            max_completion_logprobs=args.max_completion_logprobs,
            max_top_logprobs=args.max_top_logprobs,
        )
        logger.info("serving %s on http://%s:%d/v1 (%s)", app.model_name, host, args.port, args.backend)
        await _serve_app(app, config, backend=args.backend, graceful_timeout=args.graceful_timeout)


# -- bench ---------------------------------------------------------------------------------------


def _benchmark_dirs(explicit: str | None) -> list[Path]:
    if explicit is not None:
        return [Path(explicit)]
    # The working directory first (a checkout), then the checkout this package was installed from.
    candidates = [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[2] / "benchmarks"]
    return list(dict.fromkeys(candidates))


def _bench(args: argparse.Namespace) -> int:
    dirs = [d for d in _benchmark_dirs(args.dir) if d.is_dir()]
    available = sorted({p.stem for d in dirs for p in d.glob("*.py") if not p.name.startswith("_")})
    if args.name is None:
        print("benchmarks: " + (", ".join(available) or "none found"), file=sys.stderr)
        return 0 if available else 2
    for directory in dirs:
        script = directory / f"{args.name}.py"
        if script.is_file():
            return subprocess.call([sys.executable, str(script), *args.args])
    where = ", ".join(str(d) for d in _benchmark_dirs(args.dir))
    print(
        f"asyncllm bench: no benchmark named {args.name!r} (looked for {args.name}.py in {where}); "
        f"available: {', '.join(available) or 'none'}. Benchmarks ship with a source checkout, not with the wheel.",
        file=sys.stderr,
    )
    return 2


# -- parser and entry point ----------------------------------------------------------------------


def _origin_list(text: str) -> list[str]:
    """``--cors-origins``: comma-separated origins."""
    return [origin.strip() for origin in text.split(",") if origin.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(
        prog="asyncllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="stream a completion of PROMPT to the terminal")
    generate.add_argument("prompt")
    generate.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    _add_sampling_options(generate, max_tokens=128)
    _add_engine_options(generate)

    chat = commands.add_parser("chat", help="an interactive streaming conversation; " + _CHAT_HELP)
    chat.add_argument("--system", default=None, help="a system message that opens the conversation")
    _add_sampling_options(chat, max_tokens=256)
    _add_engine_options(chat)

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API (see docs/http.md)")
    serve.add_argument(
        "positional_model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model takes it: a local folder or a hub id org/name [the default model]",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on [8000]")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("ASYNCLLM_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on /v1 [$ASYNCLLM_API_KEY]",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the model's name in the API [the hub id, or the folder's name]"
    )
    serve.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 [4 MiB]")
    serve.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a request body must arrive within this, else 408 and the connection closes [30]",
    )
    serve.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests in flight beyond which new ones get 503 at once (keep it below ulimit -n) [512]",
    )
    serve.add_argument(
        "--cors-origins",
        type=_origin_list,
        default=None,
        metavar="ORIGIN[,ORIGIN]",
        help="web origins whose pages may call the API ('*': any) [none]",
    )
    serve.add_argument(
        "--graceful-timeout",
        type=float,
        default=DEFAULT_GRACEFUL_TIMEOUT,
        metavar="SECONDS",
        help="at SIGTERM, requests in flight may finish within this; the rest end with an error "
        f"[{DEFAULT_GRACEFUL_TIMEOUT:g}]",
    )
    serve.add_argument(
        "--send-timeout",
        type=float,
        default=DEFAULT_SEND_TIMEOUT,
        metavar="SECONDS",
        help="a connection whose client accepts no data for this long is aborted (Linux TCP_USER_TIMEOUT) "
        f"[{DEFAULT_SEND_TIMEOUT:g}]",
    )
    serve.add_argument("--access-log", action="store_true", help="log every request to stderr")
    serve.add_argument(
        "--max-choices", type=int, default=256, help="the most prompts times n in one request (more: 400) [256]"
    )
    serve.add_argument(
        "--max-completion-logprobs", type=int, default=5, help="the largest logprobs of /v1/completions [5]"
    )
    serve.add_argument(
        "--max-top-logprobs", type=int, default=20, help="the largest top_logprobs of /v1/chat/completions [20]"
    )
    _add_engine_options(serve)
    # A server listens once its KV cache is resident: its first requests run at full speed.
    serve.set_defaults(**{_ENGINE_PREFIX + "kv_cache_prefault_wait": True})

    bench = commands.add_parser("bench", help="run benchmarks/NAME.py, passing ARGS on")
    bench.add_argument("--dir", default=None, help="the benchmarks folder [./benchmarks, then the checkout's]")
    bench.add_argument("name", nargs="?", help="benchmark to run (omit to list them)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncllm`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "positional_model", None) is not None:  # `asyncllm serve org/name`, as vLLM's
        if args.model is not None and args.model != args.positional_model:
            parser.error(f"the model is given twice: {args.positional_model!r} and --model {args.model!r}")
        args.model = args.positional_model
    if args.command == "bench":
        return _bench(args)
    if args.command == "serve":  # the app's defaults (imported here: the other commands need no HTTP)
        from asyncllm.http import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENT_REQUESTS
        if args.max_body_bytes is None:
            args.max_body_bytes = DEFAULT_MAX_BODY_BYTES
        if args.body_timeout is None:
            args.body_timeout = DEFAULT_BODY_TIMEOUT
        if args.max_concurrent_requests is None:
            args.max_concurrent_requests = DEFAULT_MAX_CONCURRENT_REQUESTS
    # Progress (model conversion, loading) goes to stderr; generated text alone goes to stdout.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    run = {"generate": _generate, "chat": _chat, "serve": _serve}[args.command]
    try:
        anyio.run(run, args, backend=args.backend)
    except KeyboardInterrupt:
        return 130
    except (AsyncLLMError, ValueError, OSError) as exc:
        print(f"asyncllm {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
