"""The roofline of a benchmark workload: the least time this machine needs for it, to read results against.

    python benchmarks/roofline.py [--model synthetic|default|PATH] [--num-requests 64]
                                  [--prompt-len 32 512] [--output-len 16 256] [--json PATH]

A ratio between two engines says which is faster, not how much either leaves on the table. This
measures the machine (the best float32 matmul rate MKL reaches on operands in cache, the memory's
read bandwidth with torch's threads), counts what a workload must compute and read, and gives the
time an engine without any overhead would need. The throughput and latency benchmarks print each
system's time as a fraction of it ("of roofline": 1.0 would be a perfect engine).

The model of the work (float32; ``ModelCost``):
- Prefill is compute: 2 FLOPs per weight per prompt token for the decoder layers, causal attention
  (``4 * heads * head_dim`` FLOPs per query-key pair and layer), and the output projection for the
  last prompt token only (the one whose logits are sampled).
- Each decode step takes ``max(FLOPs / peak, bytes / bandwidth)``: the FLOPs of one token per
  running request through every layer, the attention over its context and the output projection;
  the bytes of all weights (read once per step, whatever the batch) and of every running request's
  cached keys and values.
- The schedule is the natural one for requests that all arrive at once: every prompt prefilled,
  then one decode step per generated token after the first (which the prefill yields), each with
  the requests that still have tokens to generate. Folding decode tokens into prefill steps could
  hide some of their memory traffic, so ``compute_only`` (all FLOPs at the peak rate) is printed
  too: no schedule can beat it.

Element-wise work (norms, rotary, activations), sampling and the KV writes are left out: the
roofline is a floor, not a prediction.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asyncllm.testing import import_path

common = import_path(Path(__file__).with_name("common.py"), "asyncllm_benchmarks_common")


def main(argv: list[str] | None = None) -> int:
    """Measure the machine and print the throughput workload's roofline. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="roofline", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="synthetic", help="synthetic, default (SmolLM2-135M) or a folder")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    model_path = common.resolve_model(args.model)
    cost = common.model_cost(model_path)
    workload = common.make_workload(
        args.num_requests, tuple(args.prompt_len), tuple(args.output_len), common.vocab_size(model_path), args.seed
    )
    common.log("measuring the machine's peak matmul rate and memory bandwidth")
    peaks = common.measure_machine()
    bound = common.workload_roofline(cost, workload, peaks)
    output_tokens = sum(r.output_len for r in workload)
    print(f"machine: {peaks.describe()}")
    print(f"model: {common.model_summary(model_path)}; weights {cost.weight_bytes / 1e6:.0f} MB")
    print(f"workload: {len(workload)} requests, {output_tokens} output tokens")
    print(f"roofline: {bound.describe()}; at most {output_tokens / bound.total:.0f} output tokens/s")
    common.write_json(
        args.json,
        {
            "benchmark": "roofline",
            "peaks": {"flops": peaks.flops, "bandwidth": peaks.bandwidth},
            "roofline": bound.as_json(),
            "max_tokens_per_s": output_tokens / bound.total,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
