"""Prefix caching: time to first token of requests sharing a long system prompt, cached vs not.

16 requests share a 1,024-token system prompt and differ in a 32-token suffix (random token ids,
seeded). Each request runs alone (one after another) so that TTFT measures the prefill it needs:
with prefix caching the shared full blocks are found in the cache after the first request and only
the suffix (plus the partial block) is computed. Both engines run in the same process and run, on
the same model; the script prints mean TTFT for each and the ratio cached / uncached
(target: <= 0.15).

    python benchmarks/prefix_cache.py                  # the default model (SmolLM2-135M-Instruct)
    python benchmarks/prefix_cache.py --quick          # a smoke test on a smaller workload
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

from asyncllm.testing import import_path

common = import_path(Path(__file__).with_name("common.py"), "asyncllm_benchmarks_common")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="synthetic | default | PATH (default: default)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--shared-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--quick", action="store_true", help="4 requests, a 256-token shared prompt")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.shared_tokens = 4, 256
    return args


async def _mean_ttft(model: Path, prompts: list[list[int]], enable: bool, device: str) -> dict[str, Any]:
    from asyncllm import Engine, SamplingParams
    total = len(prompts[0]) + 8
    async with Engine.open(
        model, device=device, enable_prefix_caching=enable, max_model_len=total, kv_cache_blocks=4 * total // 16 + 8
    ) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=1)
        await engine.generate([5, 6, 7], params)  # warm-up, not timed
        ttfts = []
        for prompt in prompts:
            started = time.perf_counter()
            async for _ in engine.stream(prompt, params):
                ttfts.append(time.perf_counter() - started)
                break
        stats = engine.statistics()
    return {
        "mean_ttft": sum(ttfts) / len(ttfts),
        "first_ttft": ttfts[0],
        "rest_mean_ttft": sum(ttfts[1:]) / max(1, len(ttfts) - 1),
        "hit_rate": stats.prefix_cache_hit_rate,
        "prompt_tokens_computed": stats.num_prompt_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    import anyio

    args = parse_args(argv)
    model = common.resolve_model(args.model)
    vocab = common.vocab_size(model)
    rng = random.Random(0)
    shared = [rng.randrange(3, vocab) for _ in range(args.shared_tokens)]
    prompts = [shared + [rng.randrange(3, vocab) for _ in range(args.suffix_tokens)] for _ in range(args.requests)]
    info = common.machine_info()
    common.print_header(
        "prefix_cache" + (" (--quick: a smoke test, not a measurement)" if args.quick else ""),
        info,
        [
            f"model: {common.model_summary(model)}",
            f"workload: {args.requests} requests, {args.shared_tokens} shared + {args.suffix_tokens} own tokens, "
            "run one at a time",
        ],
    )
    uncached = anyio.run(_mean_ttft, model, prompts, False, args.device, backend=args.backend)
    cached = anyio.run(_mean_ttft, model, prompts, True, args.device, backend=args.backend)
    rows = [
        ["prefix caching off", uncached["mean_ttft"], uncached["hit_rate"], uncached["prompt_tokens_computed"]],
        ["prefix caching on", cached["mean_ttft"], cached["hit_rate"], cached["prompt_tokens_computed"]],
    ]
    print(common.format_table(["engine", "mean TTFT (s)", "cache hit rate", "prompt tokens computed"], rows))
    ratio = cached["mean_ttft"] / uncached["mean_ttft"]
    print(f"\ncached / uncached mean TTFT: {ratio:.3f} (target <= 0.15)")
    print(f"cached, after the first request: {cached['rest_mean_ttft']:.4f} s (first: {cached['first_ttft']:.3f} s)")
    common.write_json(args.json, {"uncached": uncached, "cached": cached, "ratio": ratio, "machine": info})
    return 0


if __name__ == "__main__":
    sys.exit(main())
