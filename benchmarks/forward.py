"""Forward-step microbenchmark: what each CPU speed-up of ``TorchModelRunner`` is worth, step by step.

Runs synthetic steps through ``TorchModelRunner.execute`` (flat batch in, sampled ids out: input
preparation, the forward, logits and greedy sampling) on the synthetic benchmark model (Llama,
hidden 512, 8 layers, 8/4 heads, intermediate 1,536, vocab 32,000, float32), for a ladder of
runner variants, each adding one thing to the previous one:

- ``eager``: HF's separate projections, the ``torch`` reference attention, torch's default threads;
- ``+fused``: q/k/v and gate/up stacked into one matmul each (``fuse_projections``);
- ``+attention``: the ``cpu`` attention backend (the C decode kernel, no gathered KV);
- ``+packed``: linear weights packed once for a packed GEMM (``packed_gemm``, ``asyncllm.models._linear``:
  ``gemm_cpu``'s column panels with AVX-512, else MKL's packed layout);
- ``+kernels``: each residual add fused into the RMSNorm after it, and rotary in place, as C kernels
  (``fused_norm``, ``asyncllm.backends.cpu._elementwise``);
- ``+lean``: the layer stack as direct kernel calls into per-step scratch (``model.lean_forward``,
  ``asyncllm.backends.cpu._lean_forward``; the variants before it run the modules);
- ``+compile``: ``torch.compile`` of every layer's dense parts (``compile=True``; the compiled graphs call
  the packed weights through the ``asyncllm::packed_linear`` operator, and inductor's
  own fused norms and rotary replace the C kernels and the lean forward);
- ``+threads``: the intra-op thread count the runner decides at load (``num_threads=None``), or
  ``--threads``.

Steps: decode-only batches of 1, 16 and 64 sequences at contexts of 128 and 512 tokens (block
tables shuffled, as a busy cache fragments them), and a mixed step (a 512-token prompt prefilled
beside 32 decodes at context 256). Every variant is loaded once and they share one KV cache.
Repeats are interleaved (repeat 1 of every variant on a step, then repeat 2, ...; the variant order
rotates), each repeat times ``--steps`` consecutive steps and keeps their median; the table shows
the median over repeats in ms per step, and the spread table the half-range over repeats in % of it.

    python benchmarks/forward.py                  # the tables in docs/performance-log.md
    python benchmarks/forward.py --quick          # smoke run (tiny shapes, one repeat)
    python benchmarks/forward.py --gemm           # only the matmuls: F.linear, MKL packed, panels (GFLOPS)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncllm.testing import import_path

common = import_path(Path(__file__).with_name("common.py"), "asyncllm_benchmarks_common")

VARIANTS = ("eager", "+fused", "+attention", "+packed", "+kernels", "+lean", "+compile", "+threads")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Scenario:
    """One kind of step: ``decodes`` single-token sequences at ``context``, plus an optional prefill."""

    name: str
    decodes: int
    context: int
    prefill: int = 0

    @property
    def tokens(self) -> int:
        return self.decodes + self.prefill


FULL_SCENARIOS = (
    Scenario("decode b1 ctx128", 1, 128),
    Scenario("decode b1 ctx512", 1, 512),
    Scenario("decode b16 ctx128", 16, 128),
    Scenario("decode b16 ctx512", 16, 512),
    Scenario("decode b64 ctx128", 64, 128),
    Scenario("decode b64 ctx512", 64, 512),
    Scenario("mixed: prefill 512 + 32 decodes ctx256", 32, 256, prefill=512),
)
QUICK_SCENARIOS = (
    Scenario("decode b1 ctx32", 1, 32),
    Scenario("decode b4 ctx64", 4, 64),
    Scenario("mixed: prefill 24 + 2 decodes ctx40", 2, 40, prefill=24),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="synthetic", help="'synthetic' (default), 'default' or a model folder")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats per step and variant")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per repeat (their median is kept)")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}"
    )
    parser.add_argument("--threads", type=int, default=None, help="threads of the +threads variant (default: auto)")
    parser.add_argument(
        "--base-threads",
        type=int,
        default=None,
        help="threads of the variants before +threads (default: torch's default, all cores)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny steps, one repeat: a smoke test")
    parser.add_argument(
        "--gemm", action="store_true", help="only the model's matmul shapes: F.linear against MKL-packed, GFLOPS"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.quick:
        args.repeats, args.steps = 1, 1
    return args


def variant_options(name: str, default_threads: int, threads: int | None) -> dict[str, Any]:
    """``TorchModelRunner`` keyword arguments of a variant: everything up to it in the ladder."""
    rank = VARIANTS.index(name)
    return {
        "fuse_projections": rank >= 1,
        "attention_backend": "cpu" if rank >= 2 else "torch",
        "packed_gemm": rank >= 3,
        "fused_norm": rank >= 4,
        "compile": rank >= 6,
        "num_threads": threads if rank >= 7 else default_threads,
    }


def variant_lean(name: str) -> bool:
    """Whether a variant runs the lean forward where the model has one (a model switch, not a runner option)."""
    return VARIANTS.index(name) >= VARIANTS.index("+lean")


def make_batch(scenario: Scenario, seed: int, vocab_size: int) -> Any:
    """The scenario's ``StepBatch``: disjoint, shuffled block tables; greedy sampling for every sequence."""
    from asyncllm.executor._runner import SequenceInput, StepBatch
    from asyncllm.sampling_params import SamplingParams
    rng = random.Random(seed)
    blocks_per_decode = -(-scenario.context // BLOCK_SIZE)
    prefill_blocks = -(-scenario.prefill // BLOCK_SIZE)
    blocks = list(range(scenario.decodes * blocks_per_decode + prefill_blocks))
    rng.shuffle(blocks)
    params = SamplingParams(temperature=0.0)
    sequences = []
    for index in range(scenario.decodes):
        table = blocks[index * blocks_per_decode : (index + 1) * blocks_per_decode]
        token = rng.randrange(3, vocab_size)
        sequences.append(SequenceInput(index, [token], scenario.context - 1, table, True, params))
    if scenario.prefill:
        table = blocks[scenario.decodes * blocks_per_decode :]
        prompt = [rng.randrange(3, vocab_size) for _ in range(scenario.prefill)]
        sequences.append(SequenceInput(scenario.decodes, prompt, 0, table, True, params, prompt_token_ids=prompt))
    return StepBatch(sequences, [])


def blocks_needed(scenarios: tuple[Scenario, ...]) -> int:
    return max(s.decodes * -(-s.context // BLOCK_SIZE) + -(-s.prefill // BLOCK_SIZE) for s in scenarios)


GEMM_ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 2048)


def gemm_table(path: Path, repeats: int, quick: bool) -> str:
    """GFLOPS of every distinct linear shape of the model per row count: F.linear / MKL packed / panels.

    Each timed batch of calls cycles through copies of the weight that together exceed the cache
    (128 MB of each layout), so the weights come from memory as they do in a decode step, where
    every matmul reads its weight once; ``quick`` uses one copy.
    """
    import statistics

    import torch

    from asyncllm.backends.cpu import _gemm as gemm_cpu
    from asyncllm.models._linear import PackedWeight, packed_gemm_available
    if not packed_gemm_available():
        return "MKL's packed GEMM is unavailable in this torch build"
    panels_available = gemm_cpu.available()
    config = common.model_config(path)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (vocab, hidden),
    }
    rows_list = GEMM_ROWS[:4] if quick else GEMM_ROWS
    labels = ("linear", "mkl", "panels") if panels_available else ("linear", "mkl")
    generator = torch.Generator().manual_seed(0)
    table = []
    for name, (out_features, in_features) in shapes.items():
        copies = 1 if quick else -(-(128 << 20) // (4 * out_features * in_features))
        weights = [torch.randn(out_features, in_features, generator=generator) for _ in range(copies)]
        layouts: dict[str, list[Any]] = {
            "linear": weights,
            "mkl": [PackedWeight(weight) for weight in weights],
            "panels": [gemm_cpu.PanelWeight(weight) for weight in weights] if panels_available else [],
        }
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, in_features, generator=generator)
            budget = 20_000_000 if quick else 2_000_000_000  # flops per timed batch of calls
            calls = max(copies, budget // (2 * rows * out_features * in_features))
            timings: dict[str, list[float]] = {label: [] for label in labels}
            for _ in range(repeats):  # interleaved
                for label in labels:
                    timings[label].append(_seconds_per_call(x, layouts[label], calls))
            flops = 2 * rows * out_features * in_features
            cells.append(" / ".join(f"{flops / statistics.median(timings[k]) / 1e9:.0f}" for k in labels))
        table.append([f"{name} [{out_features} x {in_features}]", *cells])
    names = {"linear": "F.linear", "mkl": "MKL packed", "panels": "panels"}
    header = f"matmul (GFLOPS: {' / '.join(names[k] for k in labels)})"
    return common.format_table([header, *(f"{r} rows" for r in rows_list)], table)


def _seconds_per_call(x: Any, layouts: list[Any], calls: int) -> float:
    import torch
    import torch.nn.functional as F

    def run(layout: Any) -> Any:
        return F.linear(x, layout) if isinstance(layout, torch.Tensor) else layout.linear(x)

    run(layouts[-1])  # warm
    start = time.perf_counter()
    for call in range(calls):
        run(layouts[call % len(layouts)])
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.gemm:
        path = common.synthetic_model_path() if args.model == "synthetic" else common.resolve_model(args.model)
        if args.threads:
            torch.set_num_threads(args.threads)
        common.print_header(
            "asyncllm matmul microbenchmark (F.linear, MKL-packed and panel-packed weights, float32, CPU)",
            common.machine_info(),
            [f"model: {common.model_summary(path)}", f"{args.repeats} interleaved repeats; median GFLOPS"],
        )
        print(gemm_table(path, args.repeats, args.quick))
        return 0

    from asyncllm.worker._cpu_threads import configure_cpu_threads
    from asyncllm.worker._model_runner import TorchModelRunner
    scenarios = QUICK_SCENARIOS if args.quick else FULL_SCENARIOS
    variants = [v for v in VARIANTS if v in args.variants.split(",")]
    path = common.synthetic_model_path() if args.model == "synthetic" else common.resolve_model(args.model)
    default_threads = args.base_threads or torch.get_num_threads()
    auto_threads = configure_cpu_threads(args.threads)
    torch.set_num_threads(default_threads)
    info = common.machine_info()
    common.print_header(
        "asyncllm forward microbenchmark (TorchModelRunner.execute, float32, CPU)",
        info,
        [
            f"model: {common.model_summary(path)}",
            f"variants (cumulative): {', '.join(variants)}; threads: default {default_threads}, "
            f"+threads {auto_threads}",
            f"{args.repeats} interleaved repeats x {args.steps} timed steps; table: median ms per step",
        ],
    )
    runners: dict[str, TorchModelRunner] = {}
    load_seconds: dict[str, float] = {}
    shared_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    for name in variants:
        options = variant_options(name, default_threads, auto_threads)
        common.log(f"loading variant {name}: {options}")
        start = time.perf_counter()
        runner = TorchModelRunner(
            path, device="cpu", dtype="float32", block_size=BLOCK_SIZE, kv_cache_blocks=1, **options
        )
        runner.load()
        if runner.model is not None:
            runner.model.lean_forward = variant_lean(name)
        load_seconds[name] = time.perf_counter() - start
        if options["attention_backend"] == "cpu" and runner.attention_backend != "cpu":
            common.log(f"variant {name}: the cpu attention kernel is unavailable, it runs torch attention")
        if shared_kv is None:
            spec = runner.model.spec if runner.model is not None else None
            assert spec is not None
            slots = blocks_needed(scenarios) * BLOCK_SIZE
            shared_kv = [
                (
                    torch.zeros(slots, spec.num_kv_heads, spec.head_dim),
                    torch.zeros(slots, spec.num_kv_heads, spec.head_dim),
                )
                for _ in range(spec.num_layers)
            ]
        runner.kv_caches = shared_kv  # every variant reads and writes the same cache
        runners[name] = runner
    vocab_size = common.vocab_size(path)
    batches = [make_batch(s, seed, vocab_size) for seed, s in enumerate(scenarios)]
    samples: dict[tuple[str, str], list[float]] = {(s.name, v): [] for s in scenarios for v in variants}
    cpu_samples: dict[tuple[str, str], list[float]] = {(s.name, v): [] for s in scenarios for v in variants}
    total = args.repeats * len(scenarios) * len(variants)
    with common.Progress("steps timed (variant x step x repeat)", total) as progress:
        for repeat in range(args.repeats):
            for scenario, batch in zip(scenarios, batches):
                order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
                for name in order:
                    runner = runners[name]
                    torch.set_num_threads(runner.num_threads or default_threads)
                    runner.execute(batch)  # warm: caches, allocator
                    times, cpu_times = [], []
                    for _ in range(args.steps):
                        start, cpu_start = time.perf_counter(), time.thread_time()
                        runner.execute(batch)
                        times.append(time.perf_counter() - start)
                        cpu_times.append(time.thread_time() - cpu_start)
                    samples[(scenario.name, name)].append(common.median(times) * 1e3)
                    cpu_samples[(scenario.name, name)].append(common.median(cpu_times) * 1e3)
                    progress.update(1)
    torch.set_num_threads(default_threads)
    headers = ["step", *(f"{v} ms" for v in variants)]
    if len(variants) > 1:
        headers.append(f"{variants[0]} / {variants[-1]}")
    rows, spread_rows, cpu_rows, results = [], [], [], {}
    for scenario in scenarios:
        medians = [common.median(samples[(scenario.name, v)]) for v in variants]
        spreads = []
        for v, m in zip(variants, medians):
            values = samples[(scenario.name, v)]
            spreads.append((max(values) - min(values)) / 2 / m * 100 if m > 0 else None)
        row: list[Any] = [scenario.name, *medians]
        if len(variants) > 1:
            row.append(common.ratio(medians[0], medians[-1]))
        rows.append(row)
        spread_rows.append([scenario.name, *spreads])
        cpu_rows.append([scenario.name, *(common.median(cpu_samples[(scenario.name, v)]) for v in variants)])
        results[scenario.name] = {
            "tokens": scenario.tokens,
            "ms_per_step": dict(zip(variants, medians)),
            "runs_ms": {v: samples[(scenario.name, v)] for v in variants},
            "thread_cpu_ms": {v: cpu_samples[(scenario.name, v)] for v in variants},
        }
    print(common.format_table(headers, rows))
    print()
    print("spread: half the range over repeats, in % of the median")
    print(common.format_table(["step", *(f"{v} ±%" for v in variants)], spread_rows))
    print()
    print("CPU time of the calling thread, median ms per step (the whole step when it runs on 1 thread;")
    print("less sensitive to other processes than wall time, but it misses the work of extra threads)")
    print(common.format_table(["step", *(f"{v} cpu ms" for v in variants)], cpu_rows))
    print()
    print("load (incl. compile) s: " + ", ".join(f"{v} {load_seconds[v]:.1f}" for v in variants))
    common.write_json(
        args.json,
        {
            "benchmark": "forward",
            "machine": info,
            "variants": {v: variant_options(v, default_threads, auto_threads) for v in variants},
            "load_seconds": load_seconds,
            "repeats": args.repeats,
            "steps": args.steps,
            "results": results,
        },
    )
    for runner in runners.values():
        runner.kv_caches = []
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
