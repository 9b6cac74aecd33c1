"""Tensor parallelism: the same workload on 2 ranks against 1, and what the ranks' communication costs.

    python benchmarks/tensor_parallel.py [--quick] [--model synthetic|default|PATH] [--repeats 3]
                                         [--sizes 1 2] [--json PATH] [--engine-opt KEY=VALUE]

Workload (seeded): 32 requests, prompt lengths uniform in 32..256, output lengths uniform in 32..128,
random token ids, greedy, ``ignore_eos``, all submitted at t=0 through ``Engine.generate``; the
engine is opened with ``tensor_parallel_size`` 1, then 2 (each round opens both, one after the other:
repeats are interleaved), on the CPU unless ``--device`` says otherwise. The greedy tokens of every
size must be the same (checked; a difference is reported, not hidden).

Printed per size (medians over repeats): output tokens/s, the device thread's time per step, and for
2 ranks what rank 0 spends per step on communication: in all-reduces and gathers (``collectives``,
waiting for the other rank included), and sending the step (``broadcast``: encoding it and writing it
to the other ranks' pipes), with the step's latency as the other rank measured it (from rank 0's send
to the step decoded there). The communication share is (collectives + broadcast) / step time on rank
0. On a CPU the ranks share the host's cores, so a speed-up is not expected with few cores: the
figures say what the split costs, not what it gains.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from asyncllm.testing import import_path

common = import_path(Path(__file__).with_name("common.py"), "asyncllm_benchmarks_common")

FULL = {"num_requests": 32, "prompt_len": (32, 256), "output_len": (32, 128), "repeats": 3}
QUICK = {"num_requests": 4, "prompt_len": (8, 32), "output_len": (4, 12), "repeats": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tensor_parallel", description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--num-requests", type=int, default=None, help="requests (default 32)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="32 256")
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="32 128")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="tensor_parallel_size values (1 2)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


async def run_size(model: Path, size: int, workload: list[Any], options: dict[str, Any]) -> dict[str, Any]:
    """Open an engine of ``size`` ranks, warm it up, run the workload once; its figures."""
    import anyio

    from asyncllm import Engine, SamplingParams

    async with Engine.open(model, tensor_parallel_size=size, **options) as engine:
        await engine.generate(list(workload[0].prompt_ids[:8]), SamplingParams(max_tokens=4, temperature=0.0))
        runner: Any = engine._core.runner if engine._core is not None else None
        collectives = getattr(runner, "collectives", None)
        ranks = engine._ranks
        engine.reset_prefix_cache()
        before = engine.statistics()
        coll_before = collectives.seconds if collectives is not None else 0.0
        calls_before = collectives.calls if collectives is not None else 0
        sent_before = (ranks.send_seconds, ranks.num_sent) if ranks is not None else (0.0, 0)
        outputs: list[list[int]] = [[] for _ in workload]

        async def one(index: int) -> None:
            request = workload[index]
            params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
            outputs[index] = list((await engine.generate(list(request.prompt_ids), params)).token_ids)

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for index in range(len(workload)):
                group.start_soon(one, index)
        seconds = time.perf_counter() - start
        delta = common.statistics_delta(before, engine.statistics())
        steps = max(1, int(delta["num_steps"]))
        result: dict[str, Any] = {
            "size": size,
            "seconds": seconds,
            "output_tokens": sum(len(o) for o in outputs),
            "tokens_per_s": sum(len(o) for o in outputs) / seconds,
            "steps": steps,
            "step_ms": delta["device_busy"] / steps * 1e3,
            "outputs": outputs,
        }
        if collectives is not None and ranks is not None:
            result["collective_ms"] = (collectives.seconds - coll_before) / steps * 1e3
            result["collectives_per_step"] = (collectives.calls - calls_before) / steps
            sent = ranks.send_seconds - sent_before[0]
            result["broadcast_send_us"] = sent / max(1, ranks.num_sent - sent_before[1]) * 1e6
            result["comm_share"] = (collectives.seconds - coll_before + sent) / delta["device_busy"]
    if ranks is not None and ranks.reports:  # the other ranks' counters, sent as they stopped (whole run)
        report = ranks.reports[1]
        result["broadcast_latency_us"] = report.broadcast_seconds / max(1, report.steps - 1) * 1e6
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import anyio

    model = common.resolve_model(args.model)
    workload = common.make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), common.vocab_size(model), args.seed
    )
    options = common.engine_options(args)
    info = common.machine_info()
    common.print_header(
        "Tensor parallelism: ranks against one",
        info,
        [
            f"model: {common.model_summary(model)}",
            f"workload: {args.num_requests} requests, prompts {args.prompt_len[0]}..{args.prompt_len[1]}, "
            f"outputs {args.output_len[0]}..{args.output_len[1]}, greedy, all at t=0; sizes {args.sizes}, "
            f"{args.repeats} interleaved repeat(s); engine options {options}",
        ],
    )
    runs: dict[int, list[dict[str, Any]]] = {size: [] for size in args.sizes}
    for round_ in range(args.repeats):
        for size in args.sizes:
            common.log(f"round {round_ + 1}/{args.repeats}: tensor_parallel_size={size}")
            runs[size].append(anyio.run(run_size, model, size, workload, options, backend=args.backend))
    reference = runs[args.sizes[0]][0]["outputs"]
    mismatched = {size: sum(r["outputs"] != reference for r in size_runs) for size, size_runs in runs.items()}
    keys = ("tokens_per_s", "step_ms", "collective_ms", "collectives_per_step", "broadcast_send_us",
            "broadcast_latency_us", "comm_share")  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    for size, size_runs in runs.items():
        results[str(size)] = {
            key: common.median(r[key] for r in size_runs) for key in keys if all(key in r for r in size_runs)
        }
        results[str(size)]["runs"] = [{k: v for k, v in r.items() if k != "outputs"} for r in size_runs]
    rows = []
    base = results[str(args.sizes[0])]
    for size in args.sizes:
        r = results[str(size)]
        rows.append([
            size, r["tokens_per_s"], common.ratio(r["tokens_per_s"], base["tokens_per_s"]), r["step_ms"],
            r.get("collective_ms"), r.get("collectives_per_step"), r.get("broadcast_send_us"),
            r.get("broadcast_latency_us"), r.get("comm_share"),
        ])  # fmt: skip
    headers = ["ranks", "tok/s", f"vs {args.sizes[0]}", "step ms", "collectives ms/step", "collectives/step",
               "broadcast send us", "broadcast latency us", "comm share"]  # fmt: skip
    print(common.format_table(headers, rows))
    print()
    print(
        "comm share: rank 0's time in collectives (waiting for the other ranks included) plus sending the step, "
        "over its step time. broadcast latency: from rank 0's send to the step decoded on rank 1."
    )
    for size, count in mismatched.items():
        if count:
            print(f"WARNING: {count} run(s) of {size} rank(s) generated other tokens than {args.sizes[0]} rank(s)")
    ratios = {str(s): common.ratio(results[str(s)]["tokens_per_s"], base["tokens_per_s"]) for s in args.sizes}
    common.write_json(
        args.json,
        {"machine": info, "workload": {"num_requests": args.num_requests, "sizes": args.sizes},
         "results": results, "ratios": ratios, "token_mismatches": mismatched},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
