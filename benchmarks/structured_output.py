"""Structured output: what a grammar costs, how fast schemas compile, and how many real schemas work.

    python benchmarks/structured_output.py [--quick] [--model default|synthetic|PATH] [--repeats 3]
                                           [--parts throughput,compile,itl,coverage] [--json PATH]

Parts, each in the same run:
- ``throughput``: the throughput benchmark's workload (64 requests, prompts 32..512 tokens, outputs
  16..256, greedy, all at t=0), once unconstrained and once with every request under a JSON schema
  (an array of at least 1,000 objects with a string, a bounded integer, an enum and a nested array:
  the grammar cannot end before ``max_tokens``, so both runs generate exactly the same token counts).
  Repeats are interleaved; the ratio is constrained / unconstrained output tokens/s.
- ``compile``: every schema of the JSONSchemaBench sample (``benchmarks/data/jsonschemabench``)
  compiled cold (first sight, in the engine's worker thread) and again (the LRU cache): median, p90
  and max milliseconds.
- ``itl``: 8 unconstrained streams decoding while the largest schemas of the sample compile, one after
  another: the streams' inter-token latency (median, p99, max) against the same streams with nothing
  compiling. Compilation runs in a worker thread, so the loop keeps stepping.
- ``coverage``: per JSONSchemaBench dataset, the fraction of schemas for which the engine accepts the
  schema and the model's greedy output (up to ``--coverage-max-tokens``) ends and validates against it
  (``jsonschema``), greedy with ``--coverage-repetition-penalty`` (1.3), strict and ``lenient``, next
  to the JSONSchemaBench paper's best figure where known
  (arXiv 2501.10868; GitHub-Hard).

vLLM's CPU backend is not run here: this machine has no vLLM venv (docs/structured-output.md says so).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from asyncllm.testing import import_path

common = import_path(Path(__file__).with_name("common.py"), "asyncllm_benchmarks_common")

DATA = Path(__file__).with_name("data") / "jsonschemabench"

FULL = {
    "num_requests": 64,
    "prompt_len": (32, 512),
    "output_len": (16, 256),
    "repeats": 3,
    "per_dataset": 0,
    "schema_chars": 1500,
}
QUICK = {
    "num_requests": 8,
    "prompt_len": (8, 48),
    "output_len": (8, 24),
    "repeats": 1,
    "per_dataset": 2,
    "schema_chars": 200,
}

PARTS = ("throughput", "compile", "itl", "coverage")

THROUGHPUT_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        },
        "required": ["name", "age", "role", "tags"],
        "additionalProperties": False,
    },
}
"""A schema the output cannot complete within the workload's ``max_tokens``: every step is masked."""

PAPER_BEST = {"Github_hard": ("Guidance", 0.41)}
"""The paper's best empirical coverage where this project has the figure (GitHub-Hard: Guidance 41%,
llama.cpp 39%, XGrammar 28%, Outlines 3%); its per-dataset table was not available here, so the other
datasets are printed without a reference."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="structured_output", description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.set_defaults(model="default", peers="none")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated among {','.join(PARTS)}")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--per-dataset", type=int, default=None, help="schemas per dataset (0: all of the sample)")
    parser.add_argument("--coverage-max-tokens", type=int, default=384, help="output budget of a coverage answer")
    parser.add_argument(
        "--coverage-repetition-penalty",
        type=float,
        default=1.3,
        help="repetition_penalty of the greedy coverage answers (1.3: a small model loops in strings without it)",
    )
    parser.add_argument("--schema-chars", type=int, default=None, help="schema text shown in a coverage prompt (1500)")
    parser.add_argument("--data", type=Path, default=DATA, help="the JSONSchemaBench sample folder")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    for part in args.parts:
        if part not in PARTS:
            raise SystemExit(f"unknown part {part!r}; choose among {PARTS}")
    return args


def load_schemas(folder: Path, per_dataset: int) -> dict[str, list[tuple[str, Any]]]:
    """The sample's schemas per dataset (``<dataset>.jsonl`` lines of ``{"id", "schema"}``), in file order."""
    datasets: dict[str, list[tuple[str, Any]]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if per_dataset:
            rows = rows[:per_dataset]
        datasets[path.stem] = [(str(row["id"]), row["schema"]) for row in rows]
    return datasets


# -- throughput -------------------------------------------------------------------------------------


async def run_workload(engine: Any, workload: list[Any], constrained: bool, label: str) -> dict[str, Any]:
    """Every request at t=0, greedy; with ``constrained`` each under ``THROUGHPUT_SCHEMA``."""
    import anyio

    from asyncllm import SamplingParams, StructuredOutput

    spec = StructuredOutput(json_schema=THROUGHPUT_SCHEMA) if constrained else None
    counts = [0] * len(workload)

    async def one(index: int, progress: Any) -> None:
        request = workload[index]
        params = SamplingParams(
            max_tokens=request.output_len, temperature=0.0, ignore_eos=spec is None, structured_output=spec
        )
        completion = await engine.generate(list(request.prompt_ids), params)
        counts[index] = len(completion.token_ids)
        progress.update()

    engine.reset_prefix_cache()
    with common.Progress(label, len(workload)) as progress:
        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for index in range(len(workload)):
                group.start_soon(one, index, progress)
        seconds = time.perf_counter() - start
    short = sum(count != request.output_len for count, request in zip(counts, workload))
    if short:
        common.log(f"  warning: {short} requests did not generate their exact output length")
    return {"seconds": seconds, "output_tokens": sum(counts), "tokens_per_s": sum(counts) / seconds}


async def measure_throughput(engine: Any, args: argparse.Namespace, model_path: Path) -> dict[str, Any]:
    from asyncllm import SamplingParams, StructuredOutput

    workload = common.make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), common.vocab_size(model_path), args.seed
    )
    warm = list(workload[0].prompt_ids[:16])
    await engine.generate(
        warm, SamplingParams(max_tokens=4, structured_output=StructuredOutput(json_schema=THROUGHPUT_SCHEMA))
    )
    runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "json schema": []}
    for repeat in range(args.repeats):
        tag = f"(repeat {repeat + 1}/{args.repeats})"
        runs["unconstrained"].append(await run_workload(engine, workload, False, f"unconstrained {tag}"))
        runs["json schema"].append(await run_workload(engine, workload, True, f"json schema {tag}"))
    plain = common.median_of_runs(runs["unconstrained"], "tokens_per_s")
    constrained = common.median_of_runs(runs["json schema"], "tokens_per_s")
    per_round = common.per_round_ratios(runs["json schema"], runs["unconstrained"], "tokens_per_s")
    return {
        "unconstrained_tokens_per_s": plain,
        "constrained_tokens_per_s": constrained,
        "ratio": common.ratio(constrained, plain),
        "per_round_ratios": per_round,
        "output_tokens": runs["unconstrained"][0]["output_tokens"],
    }


# -- compile ---------------------------------------------------------------------------------------


async def measure_compile(engine: Any, datasets: dict[str, list[tuple[str, Any]]]) -> dict[str, Any]:
    """Cold and cached compile times through the engine's own compiler (its worker thread and cache)."""
    from asyncllm import StructuredOutput, StructuredOutputError

    compiler = engine._inputs.grammars  # the engine's compiler: the same thread, limits and cache as requests
    cold: list[float] = []
    cached: list[float] = []
    failed = 0
    total = sum(len(rows) for rows in datasets.values())
    with common.Progress("compiling schemas", total) as progress:
        for rows in datasets.values():
            for _, schema in rows:
                spec = StructuredOutput(json_schema=schema)
                for times in (cold, cached):
                    start = time.perf_counter()
                    try:
                        await compiler.compile_async(spec)
                    except StructuredOutputError:
                        if times is cold:
                            failed += 1
                    times.append(1000 * (time.perf_counter() - start))
                progress.update()
    return {
        "schemas": total,
        "failed": failed,
        "cold_ms": _spread(cold),
        "cached_ms": _spread(cached),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": common.median(values),
        "p90": common.percentile(values, 90),
        "max": max(values) if values else math.nan,
    }


# -- inter-token latency while compiling -----------------------------------------------------------


async def measure_itl(engine: Any, datasets: dict[str, list[tuple[str, Any]]], quick: bool) -> dict[str, Any]:
    """ITL of 8 unconstrained streams, alone and while the largest schemas compile one after another."""
    import anyio

    from asyncllm import SamplingParams, StructuredOutput, StructuredOutputError

    everything = [schema for rows in datasets.values() for _, schema in rows]
    largest = sorted(everything, key=lambda s: len(json.dumps(s)), reverse=True)[: 4 if quick else 16]
    params = SamplingParams(max_tokens=32 if quick else 160, temperature=0.0, ignore_eos=True)

    async def streams(gaps: list[float]) -> None:
        async def one(index: int) -> None:
            stream = await engine.open_stream(f"stream {index}: tell me a story", params)
            last = None
            async with stream:
                async for _ in stream:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(1000 * (now - last))
                    last = now

        async with anyio.create_task_group() as group:
            for index in range(8):
                group.start_soon(one, index)

    alone: list[float] = []
    await streams(alone)
    engine._inputs.grammars._cache.clear()  # these schemas compile cold
    compiling: list[float] = []
    compile_seconds = 0.0
    async with anyio.create_task_group() as group:
        group.start_soon(streams, compiling)
        start = time.perf_counter()
        for schema in largest:
            with contextlib.suppress(StructuredOutputError):
                await engine._inputs.grammars.compile_async(StructuredOutput(json_schema=schema))
        compile_seconds = time.perf_counter() - start
    return {
        "schemas": len(largest),
        "largest_schema_bytes": len(json.dumps(largest[0])) if largest else 0,
        "compile_seconds": compile_seconds,
        "alone_ms": _spread(alone) | {"p99": common.percentile(alone, 99)},
        "compiling_ms": _spread(compiling) | {"p99": common.percentile(compiling, 99)},
    }


# -- coverage --------------------------------------------------------------------------------------


def _validates(schema: Any, text: str) -> bool | None:
    """Whether ``text`` is JSON that validates; None when jsonschema cannot process the schema itself."""
    import jsonschema

    try:
        document = json.loads(text)
    except ValueError:
        return False
    try:
        validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        return bool(validator(schema).is_valid(document))
    except Exception:  # an unresolvable $ref or a broken schema: jsonschema cannot judge it
        return None


async def measure_coverage(
    engine: Any,
    datasets: dict[str, list[tuple[str, Any]]],
    max_tokens: int,
    lenient: bool,
    schema_chars: int,
    repetition_penalty: float,
) -> dict[str, dict[str, Any]]:
    """Per dataset: schemas accepted, answers that ended, answers that validate (greedy, SmolLM2's chat)."""
    import anyio

    from asyncllm import SamplingParams, StructuredOutput, StructuredOutputError

    results: dict[str, dict[str, Any]] = {}
    limiter = anyio.Semaphore(32)
    for dataset, rows in datasets.items():
        counts = {"schemas": len(rows), "compiled": 0, "ended": 0, "valid": 0, "unknown": 0}

        async def one(schema: Any, progress: Any, counts: dict[str, int] = counts) -> None:
            async with limiter:
                text = json.dumps(schema)[:schema_chars]
                messages = [{"role": "user", "content": f"Write one JSON document that follows this schema:\n{text}"}]
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=0.0,
                    repetition_penalty=repetition_penalty,
                    structured_output=StructuredOutput(json_schema=schema, lenient=lenient),
                )
                try:
                    completion = await engine.chat(messages, params)
                except StructuredOutputError:
                    progress.update()
                    return
                counts["compiled"] += 1
                sample = completion.samples[0]
                if sample.finish_reason == "stop":
                    counts["ended"] += 1
                    verdict = _validates(schema, sample.text)
                    if verdict is None:
                        counts["unknown"] += 1
                    elif verdict:
                        counts["valid"] += 1
                progress.update()

        with common.Progress(f"coverage {dataset}{' (lenient)' if lenient else ''}", len(rows)) as progress:
            async with anyio.create_task_group() as group:
                for _, schema in rows:
                    group.start_soon(one, schema, progress)
        judged = counts["schemas"] - counts["unknown"]
        results[dataset] = {**counts, "coverage": counts["valid"] / judged if judged else math.nan}
    return results


# -- main ------------------------------------------------------------------------------------------


async def _measure(args: argparse.Namespace, model_path: Path) -> dict[str, Any]:
    from asyncllm import Engine

    datasets = load_schemas(args.data, args.per_dataset) if {"compile", "itl", "coverage"} & set(args.parts) else {}
    results: dict[str, Any] = {}
    common.log(f"loading asyncllm engine on {model_path}")
    async with Engine.open(model_path, **common.engine_options(args)) as engine:
        if "throughput" in args.parts:
            results["throughput"] = await measure_throughput(engine, args, model_path)
        if "compile" in args.parts:
            results["compile"] = await measure_compile(engine, datasets)
        if "itl" in args.parts:
            results["itl"] = await measure_itl(engine, datasets, args.quick)
        if "coverage" in args.parts:
            for key, lenient in (("coverage", False), ("coverage_lenient", True)):
                results[key] = await measure_coverage(
                    engine,
                    datasets,
                    args.coverage_max_tokens,
                    lenient,
                    args.schema_chars,
                    args.coverage_repetition_penalty,
                )
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the chosen parts; print their tables (and write ``--json``). Returns the exit status."""
    import anyio

    args = parse_args(argv)
    info = common.machine_info()
    model_path = common.resolve_model(args.model)
    results = anyio.run(_measure, args, model_path, backend=args.backend)
    import llguidance

    common.print_header(
        "structured output",
        info,
        [f"model: {common.model_summary(model_path)}", f"grammar engine: llguidance {llguidance.__version__}"],
    )
    if "throughput" in results:
        t = results["throughput"]
        print("## Throughput: every request under a JSON schema against the same run unconstrained\n")
        print(
            common.format_table(
                ["run", "output tok/s", "ratio"],
                [
                    ["unconstrained", t["unconstrained_tokens_per_s"], None],
                    ["json schema", t["constrained_tokens_per_s"], t["ratio"]],
                ],
            )
        )
        print(f"\n{common.per_round_note('json schema', 'constrained / unconstrained', t['per_round_ratios'])}\n")
    if "compile" in results:
        c = results["compile"]
        print(f"## Compile time: {c['schemas']} JSONSchemaBench schemas ({c['failed']} refused)\n")
        print(
            common.format_table(
                ["", "median ms", "p90 ms", "max ms"],
                [[name, *c[f"{name}_ms"].values()] for name in ("cold", "cached")],
            )
        )
        print()
    if "itl" in results:
        i = results["itl"]
        print(
            f"## Inter-token latency of 8 unconstrained streams while {i['schemas']} large schemas compile "
            f"({i['compile_seconds']:.2f} s of compiling; the largest {i['largest_schema_bytes']} bytes)\n"
        )
        rows = [
            [name, i[f"{name}_ms"]["median"], i[f"{name}_ms"]["p99"], i[f"{name}_ms"]["max"]]
            for name in ("alone", "compiling")
        ]
        print(common.format_table(["streams", "ITL median ms", "p99 ms", "max ms"], rows))
        print()
    for key, mode in (("coverage", "strict"), ("coverage_lenient", "lenient")):
        if key not in results:
            continue
        print(f"## Coverage on the JSONSchemaBench sample, {mode} (compiled, ended, validates)\n")
        rows = []
        for dataset, r in results[key].items():
            best = PAPER_BEST.get(dataset)
            rows.append(
                [
                    dataset,
                    r["schemas"],
                    r["compiled"],
                    r["ended"],
                    r["valid"],
                    r["unknown"],
                    r["coverage"],
                    None if best is None else f"{best[1]:.2f} ({best[0]})",
                ]
            )
        print(
            common.format_table(
                ["dataset", "schemas", "compiled", "ended", "valid", "unjudgeable", "coverage", "paper's best"], rows
            )
        )
        print()
    common.write_json(args.json, {"machine": info, "model": str(model_path), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
