"""Quickstart on asyncio: stream a completion, then one chat turn.

python examples/quickstart.py                       # the default model (SmolLM2-135M-Instruct)
ASYNCLLM_MODEL=path/to/model python examples/quickstart.py
"""

from __future__ import annotations

import asyncio
import os

from asyncllm import Engine, SamplingParams


async def main(model: str | None = None) -> None:
    async with Engine.open(model) as engine:
        # Text arrives as it is generated; leaving the loop early would abort the request.
        async for chunk in engine.stream("Once upon a time", SamplingParams(max_tokens=48, temperature=0.0)):
            print(chunk.text, end="", flush=True)
        print()

        # One chat turn through the model's chat template, awaited whole.
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        reply = await engine.chat(messages, SamplingParams(max_tokens=48, temperature=0.0))
        print(f"assistant: {reply.text} [{reply.finish_reason}]")


if __name__ == "__main__":
    asyncio.run(main(os.environ.get("ASYNCLLM_MODEL")))
