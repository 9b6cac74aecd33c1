"""Heavy requests against the OpenAI app: how long each holds the event loop, and what the others see.

    python benchmarks/heavy_requests.py              # SmolLM2: the figures in docs/reliability.md
    python benchmarks/heavy_requests.py --quick      # smoke run (a small model, small requests)

One engine and its ``create_app`` run in this process, driven over httpx's ASGI transport, so the
requests are handled by the same event loop a server would use. While each heavy request is
handled, three things are watched: a ticker task that sleeps 1 ms at a time (its longest gap is
the longest the event loop was held), another request streaming tokens all along (its longest gap
between chunks; that also holds model steps), and a ``GET /health`` due 20 ms after the heavy
request (how long after that it was answered). The heavy requests are the reliability issue's
reproducers, which the app now refuses (400), and requests just inside the default limits, which
it serves. The objects made at start-up are frozen out of the garbage collector first
(``gc.freeze()``): a full collection walks them all, 0.2-0.4 s on this machine, and would land on
whichever request runs then. ``--many`` shrinks the first reproducer for a run against an engine
without the limits (5,000 prompts times n=64 there run 320,000 sequences).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from asyncllm import Engine, SamplingParams
from asyncllm.http import create_app

TEXT = "The quick brown fox jumps over the lazy dog. "


@dataclass
class Watch:
    """What the ticker and the other stream saw since ``reset``."""

    loop_gap: float = 0.0
    stream_gap: float = 0.0
    last_chunk: float = field(default_factory=time.perf_counter)

    def reset(self) -> None:
        self.loop_gap = self.stream_gap = 0.0
        self.last_chunk = time.perf_counter()


def scenarios(quick: bool, max_prompt_bytes: int, many: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, body) of each heavy request."""
    scale = 50 if quick else 1
    many = many // scale
    user = [{"role": "user", "content": "Say something."}]
    huge_prompt = (TEXT * (4 * 1024 * 1024 // len(TEXT) // scale + 1))[: 4 * 1024 * 1024 // scale - 200]
    return [
        (f"{many:,} prompts x n=64", "/v1/completions", {"prompt": ["hi"] * many, "n": 64, "max_tokens": 1}),
        (
            "chat top_logprobs=49152",
            "/v1/chat/completions",
            {"messages": user, "logprobs": True, "top_logprobs": 49152, "max_tokens": 16},
        ),
        (f"{len(huge_prompt) >> 10} KiB prompt", "/v1/completions", {"prompt": huge_prompt, "max_tokens": 1}),
        (
            "bad_words x 20,000",
            "/v1/completions",
            {"prompt": "hi", "bad_words": [f"word{i}" for i in range(20_000 // scale)], "max_tokens": 1},
        ),
        ("256 choices (4 prompts x n=64)", "/v1/completions", {"prompt": ["hi"] * 4, "n": 64, "max_tokens": 1}),
        (
            "chat top_logprobs=20, 16 tokens",
            "/v1/chat/completions",
            {"messages": user, "logprobs": True, "top_logprobs": 20, "max_tokens": 16},
        ),
        (
            f"prompt of max_prompt_bytes ({max_prompt_bytes >> 10} KiB)",
            "/v1/completions",
            {"prompt": (TEXT * (max_prompt_bytes // len(TEXT) + 1))[:max_prompt_bytes], "max_tokens": 1},
        ),
        (
            "bad_words x 256",
            "/v1/completions",
            {"prompt": "hi", "bad_words": [f"word{i}" for i in range(256)], "max_tokens": 1},
        ),
    ]


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    options: dict[str, Any] = {"device": "cpu"}
    if args.quick:
        options["kv_cache_blocks"] = 256
    async with Engine.open(args.model, **options) as engine:
        app = create_app(engine)
        max_prompt_bytes = getattr(engine.options, "max_prompt_bytes", None) or 16 * engine.max_model_len
        watch = Watch()
        results: list[dict[str, Any]] = []

        async def ticker() -> None:
            last = time.perf_counter()
            while True:
                await anyio.sleep(0.001)
                now = time.perf_counter()
                watch.loop_gap = max(watch.loop_gap, now - last - 0.001)
                last = now

        async def other() -> None:
            params = SamplingParams(max_tokens=min(512, engine.max_model_len - 16), ignore_eos=True)
            while True:
                async with engine.stream("Once upon a time", params) as stream:
                    async for _ in stream:
                        now = time.perf_counter()
                        watch.stream_gap = max(watch.stream_gap, now - watch.last_chunk)
                        watch.last_chunk = now

        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as http,
            anyio.create_task_group() as task_group,
        ):
            task_group.start_soon(ticker)
            task_group.start_soon(other)
            await anyio.sleep(1.0)  # the other stream is under way
            # A full collection walks every object torch and transformers made (0.2-0.4 s here) and
            # lands on whichever request runs then; frozen, they are not walked again.
            gc.collect()
            gc.freeze()
            await anyio.sleep(0.5)  # the ticker's gap over the collection is not the first request's
            for label, path, body in scenarios(args.quick, max_prompt_bytes, args.many):
                payload = json.dumps(body).encode()
                health: list[float] = []

                # Measured from when it was due: a loop held by the heavy request delays the send too.
                due = anyio.current_time() + 0.02

                async def probe(health: list[float] = health, due: float = due) -> None:
                    await anyio.sleep_until(due)
                    await http.get("/health")
                    health.append(anyio.current_time() - due)

                watch.reset()
                start = time.perf_counter()
                async with anyio.create_task_group() as probes:
                    probes.start_soon(probe)
                    response = await http.post(path, content=payload, headers={"content-type": "application/json"})
                elapsed = time.perf_counter() - start
                watch.stream_gap = max(watch.stream_gap, time.perf_counter() - watch.last_chunk)
                error = response.json().get("error", {}) if response.status_code != 200 else {}
                results.append(
                    {
                        "request": label,
                        "body_bytes": len(payload),
                        "status": response.status_code,
                        "param": error.get("param"),
                        "server_s": round(elapsed, 3),
                        "response_bytes": len(response.content),
                        "loop_max_stall_s": round(watch.loop_gap, 3),
                        "other_stream_max_gap_s": round(watch.stream_gap, 3),
                        "health_s": round(health[0], 3) if health else None,
                    }
                )
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
                await anyio.sleep(0.5)
            task_group.cancel_scope.cancel()
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="model folder [the default model]")
    parser.add_argument("--quick", action="store_true", help="smaller requests, for a smoke run")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--many", type=int, default=5000, help="prompts of the many-prompts request [5000]")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = anyio.run(run, args, backend=args.backend)
    headers = list(rows[0])
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in headers) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
