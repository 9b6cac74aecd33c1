"""Quickstart on trio: the same engine code, under ``trio.run``, with two streams in a nursery.

python examples/quickstart_trio.py
ASYNCLLM_MODEL=path/to/model python examples/quickstart_trio.py
"""

from __future__ import annotations

import os

import trio

from asyncllm import Engine, SamplingParams


async def complete(engine: Engine, prompt: str, results: dict[str, str]) -> None:
    parts = []
    async for chunk in engine.stream(prompt, SamplingParams(max_tokens=32, temperature=0.0)):
        parts.append(chunk.text)
    results[prompt] = "".join(parts)


async def main(model: str | None = None) -> None:
    results: dict[str, str] = {}
    async with Engine.open(model) as engine:
        # Both requests run in the same engine steps (continuous batching); the nursery waits for both.
        async with trio.open_nursery() as nursery:
            for prompt in ("The sea is", "Mountains are"):
                nursery.start_soon(complete, engine, prompt, results)
    for prompt, text in results.items():
        print(f"{prompt!r} -> {text!r}")


if __name__ == "__main__":
    trio.run(main, os.environ.get("ASYNCLLM_MODEL"))
