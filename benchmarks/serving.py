"""Online serving: Poisson arrivals through ``engine.stream()``; TTFT, ITL, e2e percentiles and goodput.

    python benchmarks/serving.py [--quick] [--model synthetic|default|PATH] [--rate 1.0]
                                 [--num-requests 32] [--slo-ttft 1.0] [--slo-itl 0.1] [--repeats 3] [--json PATH]

Workload (seeded): ``--num-requests`` requests arriving as a Poisson process of ``--rate``
requests/s, prompt lengths uniform in 32..512, output lengths uniform in 16..256, random token ids,
greedy, ignore_eos. Each asyncllm request is its own task that sleeps until its arrival time and
then consumes ``engine.stream()``, stamping every chunk as it arrives.

Metrics, per run (the table shows the median over ``--repeats`` runs of each):
- TTFT: first token's arrival minus the request's arrival time.
- ITL: every inter-token gap, pooled over all requests (a chunk carrying k tokens after a gap g
  counts as k gaps of g/k).
- e2e: last token's arrival minus the request's arrival.
- goodput: requests/s that met both SLOs (TTFT <= ``--slo-ttft`` and the request's mean ITL, i.e.
  its time per output token, <= ``--slo-itl``), over the time from the first arrival to the last
  completion; also the share of requests that met them.

Peers, on the same arrivals:
- ``hf-static``: a naive HF server: whenever it is free it takes up to ``--batch-size`` requests
  that have arrived and runs one left-padded ``generate()`` for the longest output among them; a
  streamer stamps each step, and each request counts as done at its own last useful token (as if
  the server streamed rows out).
- ``hf-cb``: HF continuous batching; requests are added by a thread at their arrival times, and
  the manager records per-token timestamps (``record_timestamps``): times are when the token was
  produced inside the manager, with no delivery to a consumer.

Ratios: goodput asyncllm/peer; latencies peer/asyncllm. > 1 means asyncllm is better.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from asyncllm.testing import import_path

common = import_path(Path(__file__).with_name("common.py"), "asyncllm_benchmarks_common")

FULL = {
    "num_requests": 32,
    "rate": 1.0,
    "prompt_len": (32, 512),
    "output_len": (16, 256),
    "repeats": 3,
    "batch_size": 16,
}
QUICK = {"num_requests": 8, "rate": 20.0, "prompt_len": (8, 48), "output_len": (4, 24), "repeats": 1, "batch_size": 4}
PERCENTILES = (50, 90, 99)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serving", description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--rate", type=float, default=None, help="mean arrivals per second (default 1.0)")
    parser.add_argument("--num-requests", type=int, default=None, help="requests (default 32)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="32 512")
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="16 256")
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="TTFT objective in seconds (default 1.0)")
    parser.add_argument("--slo-itl", type=float, default=0.1, help="mean ITL objective in seconds (default 0.1)")
    parser.add_argument("--batch-size", type=int, default=None, help="HF static server's batch size (default 16)")
    parser.add_argument(
        "--max-batch-tokens", type=int, default=2048, help="HF continuous batching token budget per step (2048)"
    )
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rate <= 0:
        parser.error("--rate must be positive")
    return args


# ------------------------------------------------------------------------------------------------
# Per-request records and their summary
# ------------------------------------------------------------------------------------------------


def record(arrival: float, stamps: list[tuple[float, int]]) -> dict[str, Any]:
    """One request's metrics from its arrival time and its (arrival time, tokens) chunk stamps."""
    first, last = stamps[0][0], stamps[-1][0]
    tokens = sum(n for _, n in stamps)
    gaps: list[float] = []
    for (previous, _), (now, count) in itertools.pairwise(stamps):
        gaps.extend([(now - previous) / count] * count)
    later = tokens - stamps[0][1]
    return {
        "ttft": first - arrival,
        "tpot": (last - first) / later if later else 0.0,
        "e2e": last - arrival,
        "tokens": tokens,
        "gaps": gaps,
        "arrival": arrival,
        "finish": last,
    }


def summarize(records: list[dict[str, Any]], slo_ttft: float, slo_itl: float) -> dict[str, Any]:
    """Percentiles, goodput and throughput of one run."""
    gaps = [g for r in records for g in r["gaps"]]
    good = sum(r["ttft"] <= slo_ttft and r["tpot"] <= slo_itl for r in records)
    duration = max(r["finish"] for r in records) - min(r["arrival"] for r in records)
    summary: dict[str, Any] = {}
    for name, values in (("ttft", [r["ttft"] for r in records]), ("itl", gaps), ("e2e", [r["e2e"] for r in records])):
        for q in PERCENTILES:
            summary[f"{name}_p{q}"] = common.percentile(values, q)
    summary.update(
        good_requests=good,
        good_fraction=good / len(records),
        goodput=good / duration,
        duration=duration,
        output_tokens_per_s=sum(r["tokens"] for r in records) / duration,
    )
    return summary


# ------------------------------------------------------------------------------------------------
# The systems
# ------------------------------------------------------------------------------------------------


async def run_asyncllm(engine: Any, workload: list[Any], arrivals: list[float], label: str) -> list[dict[str, Any]]:
    import anyio

    from asyncllm import SamplingParams
    records: list[dict[str, Any]] = [{} for _ in workload]

    async def one(index: int, start: float, progress: Any) -> None:
        request = workload[index]
        await anyio.sleep(max(0.0, start + arrivals[index] - time.perf_counter()))
        arrival = time.perf_counter()
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        stamps: list[tuple[float, int]] = []
        async with engine.stream(list(request.prompt_ids), params) as stream:
            async for chunk in stream:
                if chunk.token_ids:
                    stamps.append((time.perf_counter(), len(chunk.token_ids)))
        records[index] = record(arrival, stamps)
        progress.update()

    engine.reset_prefix_cache()
    with common.Progress(label, len(workload)) as progress:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for index in range(len(workload)):
                tg.start_soon(one, index, start, progress)
    return records


def run_hf_static(
    model: Any, workload: list[Any], arrivals: list[float], batch_size: int, label: str
) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [{} for _ in workload]
    pending = deque(range(len(workload)))
    with common.Progress(label, len(workload)) as progress:
        start = time.perf_counter()
        while pending:
            wait = start + arrivals[pending[0]] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            now = time.perf_counter() - start
            batch = []
            while pending and arrivals[pending[0]] <= now and len(batch) < batch_size:
                batch.append(pending.popleft())
            streamer = common.StepTimes()
            longest = max(workload[i].output_len for i in batch)
            common.hf_generate_batch(model, [workload[i].prompt_ids for i in batch], longest, streamer=streamer)
            for i in batch:
                stamps = [(t, 1) for t in streamer.times[: workload[i].output_len]]
                records[i] = record(start + arrivals[i], stamps)
            progress.update(len(batch))
    return records


def run_hf_cb(
    model: Any, workload: list[Any], arrivals: list[float], max_batch_tokens: int, label: str
) -> list[dict[str, Any]]:
    with common.HFContinuousBatching(model, workload, max_batch_tokens) as cb:
        start = time.perf_counter()
        failure: list[BaseException] = []

        def submit() -> None:
            try:
                for index, request in enumerate(workload):
                    wait = start + arrivals[index] - time.perf_counter()
                    if wait > 0:
                        time.sleep(wait)
                    cb.add(f"r{index}", request, record_timestamps=True)
            except BaseException as exc:  # reported by the collecting thread
                failure.append(exc)

        submitter = threading.Thread(target=submit, name="hf-cb-arrivals", daemon=True)
        submitter.start()
        with common.Progress(label, len(workload)) as progress:
            results = cb.collect(len(workload), progress)
        submitter.join()
        if failure:
            raise failure[0]
    records = []
    for index in range(len(workload)):
        result = results[f"r{index}"]
        records.append(record(result.created_time, [(t, 1) for t in result.timestamps or []]))
    return records


async def _measure(
    args: argparse.Namespace, model_path: Path, workload: list[Any], arrivals: list[float], peers: list[str]
) -> dict[str, list[dict[str, Any]]]:
    from asyncllm import Engine, SamplingParams
    runs: dict[str, list[dict[str, Any]]] = {"asyncllm": [], **{p: [] for p in peers}}
    common.log(f"loading asyncllm engine on {model_path}")
    async with Engine.open(model_path, **common.engine_options(args)) as engine:
        warm = list(workload[0].prompt_ids[:16])
        await engine.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        hf_model = None
        if peers:
            common.log("loading the HF transformers model")
            hf_model = common.load_hf_model(model_path, args.device, args.dtype)
            common.hf_warmup(hf_model, common.vocab_size(model_path))
        for repeat in range(args.repeats):
            tag = f"(repeat {repeat + 1}/{args.repeats})"
            runs["asyncllm"].append({"records": await run_asyncllm(engine, workload, arrivals, f"asyncllm {tag}")})
            if common.HF_STATIC in runs:
                records = await common.run_blocking(
                    run_hf_static, hf_model, workload, arrivals, args.batch_size, f"HF static {tag}"
                )
                runs[common.HF_STATIC].append({"records": records})
            if common.HF_CB in runs:
                records = await common.run_blocking(
                    run_hf_cb, hf_model, workload, arrivals, args.max_batch_tokens, f"HF CB {tag}"
                )
                runs[common.HF_CB].append({"records": records})
    for system_runs in runs.values():
        for run in system_runs:
            run.update(summarize(run["records"], args.slo_ttft, args.slo_itl))
    return runs


def main(argv: list[str] | None = None) -> int:
    """Run the serving benchmark; print the tables (and write ``--json``). Returns the exit status."""
    import anyio

    args = parse_args(argv)
    peers = common.parse_peers(args, (common.HF_STATIC, common.HF_CB))
    info = common.machine_info()
    model_path = common.resolve_model(args.model)
    workload = common.make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), common.vocab_size(model_path), args.seed
    )
    arrivals = common.poisson_arrivals(len(workload), args.rate, args.seed)
    runs = anyio.run(_measure, args, model_path, workload, arrivals, peers, backend=args.backend)

    keys = [f"{m}_p{q}" for m in ("ttft", "itl", "e2e") for q in PERCENTILES]
    keys += ["good_requests", "good_fraction", "goodput", "output_tokens_per_s", "duration"]
    medians = {system: {k: common.median_of_runs(r, k) for k in keys} for system, r in runs.items()}
    ours = medians["asyncllm"]
    latency_rows, summary_rows, ratios = [], [], {}
    for system, m in medians.items():
        label = common.PEER_LABELS[system]
        latency_rows.append(
            [
                label,
                *(m[f"ttft_p{q}"] * 1e3 for q in PERCENTILES),
                *(m[f"itl_p{q}"] * 1e3 for q in PERCENTILES),
                *(m[f"e2e_p{q}"] for q in PERCENTILES),
            ]
        )
        r = None
        if system != "asyncllm":
            r = {
                "goodput": common.ratio(ours["goodput"], m["goodput"]),
                "ttft_p50": common.ratio(m["ttft_p50"], ours["ttft_p50"]),
                "itl_p50": common.ratio(m["itl_p50"], ours["itl_p50"]),
                "e2e_p50": common.ratio(m["e2e_p50"], ours["e2e_p50"]),
            }
            ratios[system] = r
        summary_rows.append(
            [
                label,
                m["goodput"],
                f"{100 * m['good_fraction']:.0f}%",
                m["output_tokens_per_s"],
                *((r[k] for k in ("goodput", "ttft_p50", "itl_p50", "e2e_p50")) if r else (None,) * 4),
            ]
        )

    common.print_header(
        "serving" + (" (--quick: a smoke test, not a measurement)" if args.quick else ""),
        info,
        [
            f"model: {common.model_summary(model_path)} ({args.dtype}, {args.device})",
            f"workload: {len(workload)} requests, Poisson arrivals at {args.rate} req/s (seed {args.seed}), prompts "
            f"{args.prompt_len[0]}..{args.prompt_len[1]}, outputs {args.output_len[0]}..{args.output_len[1]}, "
            f"random ids, greedy, ignore_eos; median of {args.repeats}",
            f"SLOs: TTFT <= {args.slo_ttft} s and mean ITL <= {args.slo_itl} s",
        ],
    )
    print(
        common.format_table(
            [
                "system",
                *(f"TTFT p{q} ms" for q in PERCENTILES),
                *(f"ITL p{q} ms" for q in PERCENTILES),
                *(f"e2e p{q} s" for q in PERCENTILES),
            ],
            latency_rows,
        )
    )
    print()
    print(
        common.format_table(
            [
                "system",
                "goodput req/s",
                "met SLOs",
                "output tok/s",
                "goodput asyncllm/peer",
                "TTFT p50 peer/asyncllm",
                "ITL p50 peer/asyncllm",
                "e2e p50 peer/asyncllm",
            ],
            summary_rows,
        )
    )
    print()
    print("- ratios: > 1 means asyncllm is better; '-' where the peer met no SLO (goodput 0)")
    common.write_json(
        args.json,
        {
            "benchmark": "serving",
            "argv": list(sys.argv[1:] if argv is None else argv),
            "machine": info,
            "model": str(model_path),
            "workload": {
                "num_requests": len(workload),
                "rate": args.rate,
                "prompt_len": list(args.prompt_len),
                "output_len": list(args.output_len),
                "seed": args.seed,
                "slo_ttft": args.slo_ttft,
                "slo_itl": args.slo_itl,
            },
            "results": {
                system: {
                    "median": medians[system],
                    "runs": [{k: v for k, v in run.items() if k != "records"} for run in system_runs],
                }
                for system, system_runs in runs.items()
            },
            "ratios": ratios,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
