"""Fire 32 streaming completions at once at an asyncllm server, with the official ``openai`` client.

    asyncllm serve &                                  # or any OpenAI-compatible server
    python examples/concurrent_client.py [--base-url http://127.0.0.1:8000/v1] [--streams 32]

The server batches all of them into the same steps (continuous batching): the wall time is far
below 32 times one request's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from openai import AsyncOpenAI


async def one_stream(client: AsyncOpenAI, model: str, index: int, max_tokens: int) -> tuple[str, float]:
    """Stream one completion; return its text and its time to first token."""
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    stream = await client.completions.create(
        model=model, prompt=f"Story number {index}:", max_tokens=max_tokens, temperature=0.8, seed=index, stream=True
    )
    async for event in stream:
        if first is None:
            first = time.perf_counter() - start
        parts.append(event.choices[0].text)
    return "".join(parts), first or 0.0


async def main(base_url: str, api_key: str, streams: int = 32, max_tokens: int = 32) -> list[str]:
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        model = (await client.models.list()).data[0].id
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, model, i, max_tokens) for i in range(streams)))
        elapsed = time.perf_counter() - start
    ttfts = sorted(ttft for _, ttft in results)
    print(
        f"{streams} streams of up to {max_tokens} tokens from {model} in {elapsed:.2f} s; "
        f"time to first token: median {ttfts[len(ttfts) // 2]:.3f} s, worst {ttfts[-1]:.3f} s"
    )
    return [text for text, _ in results]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("ASYNCLLM_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--api-key", default=os.environ.get("ASYNCLLM_API_KEY", "none"))
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(main(args.base_url, args.api_key, args.streams, args.max_tokens))
