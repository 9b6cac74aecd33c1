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
import inspect
import logging
import os
import re
import signal
import subprocess
import sys
import time
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from asyncllm.engine import Engine
from asyncllm.errors import AsyncLLMError, ChatTemplateError, InvalidRequestError
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger("asyncllm")

_ENGINE_PREFIX = "engine__"  # argparse dest prefix of the engine options
_NOT_FLAGS = frozenset({"model", "runner", "tokenizer"})  # --model is added by hand; the others are objects


def _arg_docs(doc: str | None) -> dict[str, str]:
    """The ``Args:`` section of a Google-style docstring, as {name: one-line description}."""
    docs: dict[str, str] = {}
    in_args, name = False, None
    for line in (doc or "").splitlines():
        stripped = line.strip()
        if stripped == "Args:":
            in_args = True
            continue
        if not in_args:
            continue
        if stripped.endswith(":") and " " not in stripped:  # the next section (Returns:, Raises:)
            break
        match = re.match(r"^(\w+): (.*)$", stripped)
        if match and line.startswith(" " * 12) and not line.startswith(" " * 13):
            name = match.group(1)
            docs[name] = match.group(2)
        elif name is not None and stripped:
            docs[name] += " " + stripped
    return docs


def _engine_parameters() -> list[tuple[str, Any, Any]]:
    """(name, type, default) of each keyword option of ``Engine.open`` that makes sense as a flag."""
    hints = typing.get_type_hints(Engine.open)
    result = []
    for name, parameter in inspect.signature(Engine.open).parameters.items():
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name not in _NOT_FLAGS:
            result.append((name, hints.get(name, str), parameter.default))
    return result


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
    group = parser.add_argument_group("engine options (those of Engine.open)")
    docs = _arg_docs(Engine.open.__doc__)
    group.add_argument("--model", default=None, help=docs.get("model", "local HF-format model folder"))
    taken = {action.dest for action in parser._actions}
    for name, kind, default in _engine_parameters():
        flag = name.replace("_", "-")
        if name in taken:  # e.g. the sampling --seed: the engine's one becomes --engine-seed
            flag = f"engine-{flag}"
        help_text = docs.get(name, "").replace("%", "%%")  # argparse formats help with %
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


async def _wait_for_signal() -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("received %s, shutting down", signal.Signals(signum).name)
            return


async def _serve(args: argparse.Namespace) -> None:
    from hypercorn.config import Config

    from asyncllm.http import create_app

    config = Config()
    host = f"[{args.host}]" if ":" in args.host else args.host
    config.bind = [f"{host}:{args.port}"]
    # Through the logging module (to stderr, as set up in main) rather than hypercorn's own handlers.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = logging.getLogger("hypercorn.access") if args.access_log else None
    config.graceful_timeout = 5.0
    async with _open_engine(args) as engine:
        app = create_app(
            engine,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            model_name=args.served_model_name,
            max_choices=args.max_choices,
            max_completion_logprobs=args.max_completion_logprobs,
            max_top_logprobs=args.max_top_logprobs,
        )
        logger.info("serving %s on http://%s:%d/v1 (%s)", app.model_name, host, args.port, args.backend)
        if args.backend == "trio":
            from hypercorn.trio import serve as trio_serve

            await trio_serve(app, config, shutdown_trigger=_wait_for_signal)  # type: ignore[arg-type]
        else:
            from hypercorn.asyncio import serve as asyncio_serve

            await asyncio_serve(app, config, shutdown_trigger=_wait_for_signal)  # type: ignore[arg-type]


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
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on [8000]")
    serve.add_argument(
        "--api-key",
        default=os.environ.get("ASYNCLLM_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on /v1 [$ASYNCLLM_API_KEY]",
    )
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API [the folder's name]")
    serve.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 [4 MiB]")
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

    bench = commands.add_parser("bench", help="run benchmarks/NAME.py, passing ARGS on")
    bench.add_argument("--dir", default=None, help="the benchmarks folder [./benchmarks, then the checkout's]")
    bench.add_argument("name", nargs="?", help="benchmark to run (omit to list them)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``asyncllm`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args)
    if args.command == "serve" and args.max_body_bytes is None:
        from asyncllm.http import DEFAULT_MAX_BODY_BYTES

        args.max_body_bytes = DEFAULT_MAX_BODY_BYTES
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
