"""asyncllm and vLLM's CPU backend, plain and n-gram, single stream, decode speed measured the same way.

    python benchmarks/speculative_same_method.py [--repeats 2] [--vllm-python /tmp/vllm-venv/bin/python]

vLLM's offline API does not stream, so ``benchmarks/speculative.py`` takes vLLM's decode tokens/s as
(tokens - 1) / (a whole ``generate`` - a 1-token ``generate``) and asyncllm's from stream timestamps.
Here both engines are measured as vLLM is: per rewrite prompt (``speculative.REPETITIVE``, as token ids
with asyncllm's chat template), greedy, 192 tokens at most, the prefix cache reset before each call, a
1-token generate (its time: TTFT) then a whole one. asyncllm also prints the stream's figure and its
engine statistics per request (steps, device forward/sample seconds, the prefill's forward), vLLM its
speculative counters (``LLM.get_metrics()``, which needs ``disable_log_stats=False``). asyncllm's two
engines run first (alternating), then vLLM's two peers, one process each, one after the other: the
systems do not interleave, so on a shared machine the load may differ between them. Writes the raw
rows to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
MAX_TOKENS = 192
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
STATS = (
    "num_steps",
    "device_busy",
    "device_forward",
    "device_sample",
    "device_idle",
    "spec_num_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)


def _vllm_side(spec_path: str) -> None:
    """Runs under vLLM's interpreter: one peer (plain or n-gram), every prompt, ``repeats`` times."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    options: dict[str, Any] = {"disable_log_stats": False, "max_model_len": 1024, "seed": 0}
    options["kv_cache_memory_bytes"] = 256 << 20
    if spec["system"] == "ngram":
        options["speculative_config"] = NGRAM
    llm = LLM(model=spec["model"], dtype="float32", **options)

    def generate(ids: list[int], n: int) -> tuple[float, list[int]]:
        llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False
        )
        return time.perf_counter() - start, list(out[0].outputs[0].token_ids)

    def counters() -> dict[str, float]:
        return {m.name: m.value for m in llm.get_metrics() if "spec_decode" in m.name and hasattr(m, "value")}

    generate(spec["prompts"][0], 4)  # warm-up
    rows = []
    for repeat in range(spec["repeats"]):
        for index, ids in enumerate(spec["prompts"]):
            ttft, _ = generate(ids, 1)
            before = counters()
            whole, tokens = generate(ids, MAX_TOKENS)
            after = counters()
            rows.append(
                {
                    "system": f"vllm {spec['system']}",
                    "repeat": repeat,
                    "prompt": index,
                    "ttft": ttft,
                    "whole": whole,
                    "tokens": len(tokens),
                    "token_ids": tokens,
                    "spec": {k: after[k] - before.get(k, 0) for k in after},
                }
            )
    Path(spec["out"]).write_text(json.dumps(rows))


async def _asyncllm_side(model: str, prompts: list[list[int]], repeats: int) -> list[dict[str, Any]]:
    from asyncllm import Engine, SamplingParams

    greedy = {"temperature": 0.0}
    rows: list[dict[str, Any]] = []
    options: dict[str, Any] = {"kv_cache_memory": 1 << 30}
    async with (
        Engine.open(model, **options) as plain,
        Engine.open(model, speculative_method="ngram", **options) as ngram,
    ):
        engines = {"plain": plain, "ngram": ngram}
        for engine in engines.values():  # warm-up
            await engine.generate(prompts[0], SamplingParams(max_tokens=4, **greedy))
        for repeat in range(repeats):
            order = ["plain", "ngram"] if repeat % 2 == 0 else ["ngram", "plain"]
            for index, ids in enumerate(prompts):
                for system in order:
                    engine = engines[system]
                    engine.reset_prefix_cache()
                    s0 = engine.statistics()
                    start = time.perf_counter()
                    await engine.generate(ids, SamplingParams(max_tokens=1, **greedy))
                    ttft = time.perf_counter() - start
                    s1 = engine.statistics()
                    engine.reset_prefix_cache()
                    start = time.perf_counter()
                    completion = await engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, **greedy))
                    whole = time.perf_counter() - start
                    s2 = engine.statistics()
                    engine.reset_prefix_cache()
                    stamps: list[tuple[float, int]] = []
                    start = time.perf_counter()
                    async with engine.stream(ids, SamplingParams(max_tokens=MAX_TOKENS, **greedy)) as stream:
                        async for chunk in stream:
                            if chunk.token_ids:
                                stamps.append((time.perf_counter(), len(chunk.token_ids)))
                    streamed = sum(n for _, n in stamps)
                    rows.append(
                        {
                            "system": f"asyncllm {system}",
                            "repeat": repeat,
                            "prompt": index,
                            "ttft": ttft,
                            "whole": whole,
                            "tokens": len(completion.token_ids),
                            "token_ids": list(completion.token_ids),
                            "stream_decode_tokens_per_s": (streamed - stamps[0][1]) / (stamps[-1][0] - stamps[0][0]),
                            "prefill_forward": s1.device_forward - s0.device_forward,
                            "stats": {k: getattr(s2, k) - getattr(s1, k) for k in STATS},
                        }
                    )
    return rows


def main() -> int:
    import anyio

    sys.path.insert(0, str(HERE))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from asyncllm.default_model import resolve_model_path
    from asyncllm.testing import import_path

    speculative = import_path(HERE / "speculative.py", "asyncllm_benchmarks_speculative")
    model = str(resolve_model_path(None))

    async def encode() -> list[list[int]]:
        from asyncllm import Engine

        async with Engine.open(model, kv_cache_memory=1 << 28) as engine:
            return [list(await engine.encode_chat([{"role": "user", "content": p}])) for p in speculative.REPETITIVE]

    prompts = anyio.run(encode)
    rows = anyio.run(_asyncllm_side, model, prompts, args.repeats)
    if args.vllm_python:
        preload = Path(args.vllm_python).resolve().parent.parent / "lib" / "libiomp5.so"
        env = dict(speculative.common.peer_environment(), **({"LD_PRELOAD": str(preload)} if preload.is_file() else {}))
        with tempfile.TemporaryDirectory() as folder:
            for system in ("ngram", "plain"):
                spec = Path(folder) / f"{system}.json"
                out = Path(folder) / f"{system}-out.json"
                spec.write_text(
                    json.dumps(
                        {"system": system, "model": model, "prompts": prompts, "repeats": args.repeats, "out": str(out)}
                    )
                )
                code = f"import runpy; runpy.run_path({str(Path(__file__))!r})['_vllm_side']({str(spec)!r})"
                subprocess.run(
                    [args.vllm_python, "-c", code],
                    env=env,
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                rows += json.loads(out.read_text())
    reference = {r["prompt"]: r["token_ids"] for r in rows if r["system"] == "asyncllm plain"}
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        decode = [(r["tokens"] - 1) / (r["whole"] - r["ttft"]) for r in mine]
        line = (
            f"{system}: decode tok/s (whole - 1-token) median {statistics.median(decode):.1f} "
            f"{[round(d, 1) for d in decode]}, TTFT median {statistics.median(r['ttft'] for r in mine) * 1e3:.0f} ms"
        )
        if "stream_decode_tokens_per_s" in mine[0]:
            line += (
                f", stream decode tok/s median {statistics.median(r['stream_decode_tokens_per_s'] for r in mine):.1f}"
            )
            line += f", prefill forward median {statistics.median(r['prefill_forward'] for r in mine) * 1e3:.0f} ms"
            line += f", steps {[r['stats']['num_steps'] for r in mine]}"
        else:
            line += f", spec counters {[r['spec'] for r in mine][: len(prompts)]}"
        line += f", greedy tokens as asyncllm plain's: {all(r['token_ids'] == reference[r['prompt']] for r in mine)}"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
