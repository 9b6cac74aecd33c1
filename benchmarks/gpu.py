"""GPU benchmark: the Triton kernels against the memory bandwidth, and the engine on the nano-vllm workload.

    python benchmarks/gpu.py [--quick] [--skip-kernels] [--skip-fused-norm] [--skip-engine] [--enforce-eager]
                             [--json PATH]

Needs one CUDA GPU (it was written for an H200 and sized to finish inside 5 minutes there); on a
machine without one it prints why and exits with status 2 (``--help`` works anywhere). Nothing is
downloaded: the model is Qwen3-0.6B-shaped (28 layers, hidden 1024, 16 query / 8 KV heads of 128,
vocab 151,936, tied embeddings) with random bf16 weights created on the device; only its
``config.json`` is written to a temporary folder.

What it prints:

1. Device-to-device copy bandwidth (a 1 GiB ``copy_``, bytes read + written per second): the
   yardstick for everything below.
2. Kernel level, one layer of that model: paged attention at decode batch 1/64/256 with contexts of
   512/4096 tokens (the split-KV kernels where the runner would pick them), and the KV-cache write
   of the same batch: time per call and achieved bytes/s as a fraction of the copy bandwidth.
3. The fused residual-add + RMSNorm (``DecoderForCausalLM.fused_norm``): a whole-model decode step
   at batch 1/64/256 with 512-token contexts, eager and replayed from a CUDA graph, with the fused
   kernels and with the unfused torch ops (interleaved, best of two each), and the speed-up.
4. Engine level, the nano-vllm workload: 256 requests, prompt and output lengths uniform in
   100..1024, ignore_eos, random token ids, all submitted at once: output tokens/s, and the fraction
   of wall time the device thread spends between steps (the GPU has nothing queued then: a step
   ends with its one synchronisation). For reference nano-vllm reports 1,434 tok/s and vLLM 1,362
   tok/s on this workload on an RTX 4070 Laptop GPU.
5. The decode steps of that run with all 256 requests decoding: median step time against the memory
   roofline (weight bytes + the KV bytes those 256 contexts read, over the copy bandwidth), printed
   as the fraction of the roofline achieved (target >= 70%).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

QWEN3_06B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See docs/gpu.md.")
    parser.add_argument("--quick", action="store_true", help="64 requests and fewer kernel shapes (a smoke run)")
    parser.add_argument("--skip-kernels", action="store_true", help="skip the kernel-level measurements")
    parser.add_argument("--skip-fused-norm", action="store_true", help="skip the fused-norm on/off comparison")
    parser.add_argument("--skip-engine", action="store_true", help="skip the engine-level workload")
    parser.add_argument("--enforce-eager", action="store_true", help="run the engine without CUDA graphs")
    parser.add_argument("--requests", type=int, default=256, help="requests of the engine workload (256)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384, help="engine step budget (16384)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the weights")
    parser.add_argument("--json", type=Path, help="also write every number to this file")
    return parser.parse_args(argv)


class NullTokenizer:
    """Token ids in, one character per token out: the workload is ids, and detokenizing stays cheap."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * len(token_ids)


def write_config(folder: Path) -> Path:
    from transformers import Qwen3Config

    Qwen3Config(**QWEN3_06B).save_pretrained(folder)
    return folder


def patch_random_weights(seed: int) -> None:
    """Make ``TorchModelRunner.load`` take random bf16 weights made on the GPU instead of reading files."""
    import torch

    import asyncllm.worker._model_runner as model_runner
    from asyncllm.models import build_model
    from asyncllm.worker._weights import CheckpointTensor, load_config

    def random_tensors(model_path: Path) -> Iterator[CheckpointTensor]:
        with torch.device("meta"):
            shapes = {name: tuple(t.shape) for name, t in build_model(load_config(model_path)).state_dict().items()}
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def rows(name: str, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
            if name.endswith("norm.weight"):
                return torch.ones((stop - start, *shape[1:]), device="cuda", dtype=torch.bfloat16)
            chunk = torch.randn((stop - start, *shape[1:]), generator=gen, device="cuda", dtype=torch.bfloat16)
            return chunk * 0.02

        for name, shape in shapes.items():
            yield name, shape, functools.partial(rows, name, shape)

    model_runner.checkpoint_tensors = random_tensors  # type: ignore[assignment]


def bench_ms(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def copy_bandwidth() -> float:
    """Device-to-device bytes/s of a 1 GiB copy (read + write)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def measure_shape(batch: int, context: int) -> dict[str, Any]:
    """Time one layer's decode attention and KV write at (batch, context); bytes moved per call."""
    import torch

    from asyncllm.backends.triton._kernels.reshape_and_cache import reshape_and_cache
    from asyncllm.backends.triton._launchers import build_metadata, paged_attention
    from asyncllm.executor._runner import SequenceInput
    from asyncllm.sampling_params import SamplingParams
    from asyncllm.worker._input_batch import step_inputs
    heads, kv_heads, head_dim, block = 16, 8, 128, 16
    device = torch.device("cuda")
    blocks_per_seq = context // block
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks * block, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks).tolist()
    params = SamplingParams()
    sequences = [
        SequenceInput(i, [0], context - 1, order[i * blocks_per_seq : (i + 1) * blocks_per_seq], True, params)
        for i in range(batch)
    ]
    meta = build_metadata(step_inputs(sequences, block), num_kv_heads=kv_heads, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
    k_new = torch.randn(batch, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    attn_ms = bench_ms(lambda: paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5))
    write_ms = bench_ms(lambda: reshape_and_cache(k_new, v_new, k_cache, v_cache, meta.slot_mapping))
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2 + 2 * q.numel() * 2
    write_bytes = 2 * 2 * k_new.numel() * 2
    return {
        "batch": batch,
        "context": context,
        "splits": meta.num_kv_splits,
        "attention_ms": attn_ms,
        "attention_bytes_per_s": kv_bytes / (attn_ms / 1e3),
        "kv_write_ms": write_ms,
        "kv_write_bytes_per_s": write_bytes / (write_ms / 1e3),
    }


def kernel_level(bandwidth: float, quick: bool, results: dict[str, Any]) -> None:
    import torch

    rows = []
    print("\nkernel level (one layer of the model, bf16, decode)")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'attn us':>9} {'attn GB/s':>10} {'of copy':>8} "
          f"{'kv-write us':>12} {'of copy':>8}")  # fmt: skip
    for batch in (1, 64) if quick else (1, 64, 256):
        for context in (512, 4096):
            row = measure_shape(batch, context)
            torch.cuda.empty_cache()
            rows.append(row)
            attn_bw, write_bw = row["attention_bytes_per_s"], row["kv_write_bytes_per_s"]
            print(f"{batch:>6} {context:>8} {row['splits']:>6} {row['attention_ms'] * 1e3:>9.1f} "
                  f"{attn_bw / 1e9:>10.0f} {attn_bw / bandwidth:>8.0%} {row['kv_write_ms'] * 1e3:>12.1f} "
                  f"{write_bw / bandwidth:>8.1%}")  # fmt: skip
    results["kernels"] = rows


def fused_norm_ab(
    model: Any,
    kv_caches: list[tuple[Any, Any]],
    *,
    block_size: int,
    batches: tuple[int, ...],
    context: int,
    timer: Callable[[Callable[[], object]], float] = bench_ms,
    graphs: bool = True,
) -> list[dict[str, Any]]:
    """Time a decode step of the whole model with ``model.fused_norm`` on and off.

    Each batch is ``batch`` sequences decoding one token at position ``context - 1`` in their own
    blocks (``kv_caches`` must hold ``batch * context`` slots). Every variant is timed twice,
    interleaved (off, on, off, on), and the faster time kept. With ``graphs`` the step is also
    captured in a CUDA graph per setting and the replay timed: that is what the runner runs.

    Args:
        model: A loaded ``DecoderForCausalLM`` (eager layers).
        kv_caches: Its per-layer caches.
        block_size: Tokens per cache block.
        batches: Decode batch sizes.
        context: Tokens of context per sequence, the new one included.
        timer: Milliseconds one call of a function takes (``bench_ms``; a plain clock on the CPU).
        graphs: Also time CUDA-graph replays (CUDA only).

    Returns:
        One row per (batch, mode): milliseconds fused and unfused, and their ratio.
    """
    import torch

    from asyncllm.backends.triton._launchers import build_metadata
    from asyncllm.executor._runner import SequenceInput
    from asyncllm.sampling_params import SamplingParams
    from asyncllm.worker._input_batch import step_inputs
    device = next(model.parameters()).device
    blocks = -(-context // block_size)
    rows = []
    for batch in batches:
        sequences = [
            SequenceInput(i, [i], context - 1, list(range(i * blocks, (i + 1) * blocks)), True, SamplingParams())
            for i in range(batch)
        ]
        step = step_inputs(sequences, block_size)
        meta = build_metadata(step, num_kv_heads=model.spec.num_kv_heads, device=device)
        ids = torch.from_numpy(step.input_ids).to(device)
        positions = torch.from_numpy(step.positions).to(device)
        forward = functools.partial(model, ids, positions, kv_caches, meta)
        for mode in ("eager", "graph") if graphs else ("eager",):
            best = {False: float("inf"), True: float("inf")}
            with torch.inference_mode():
                for fused in (False, True, False, True):
                    model.fused_norm = fused
                    forward()  # compiles this path's kernels outside the capture and the timing
                    best[fused] = min(best[fused], timer(_graphed(forward) if mode == "graph" else forward))
            model.fused_norm = True
            rows.append({"batch": batch, "context": context, "mode": mode, "fused_ms": best[True],
                         "unfused_ms": best[False], "speedup": best[False] / best[True]})  # fmt: skip
    return rows


def _graphed(function: Callable[[], object]) -> Callable[[], object]:
    """``function`` captured in a CUDA graph; returns the replay."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        function()
    return graph.replay


def fused_norm_level(folder: Path, quick: bool, results: dict[str, Any]) -> None:
    """``fused_norm_ab`` on the benchmark model (its own runner, freed again before the engine run)."""
    import torch

    from asyncllm.worker._model_runner import TorchModelRunner
    batches, context, block = ((1, 64) if quick else (1, 64, 256)), 512, 16
    runner = TorchModelRunner(
        folder, device="cuda", dtype="bfloat16", attention_backend="triton", enforce_eager=True,
        block_size=block, kv_cache_blocks=max(batches) * context // block,
    )  # fmt: skip
    runner.load()
    print("\nfused residual-add + RMSNorm: whole-model decode step, bf16, context 512 (best of 2, interleaved)")
    print(f"{'batch':>6} {'mode':>6} {'unfused ms':>11} {'fused ms':>9} {'speed-up':>9}")
    rows = fused_norm_ab(runner.model, runner.kv_caches, block_size=block, batches=batches, context=context)
    for row in rows:
        print(f"{row['batch']:>6} {row['mode']:>6} {row['unfused_ms']:>11.3f} {row['fused_ms']:>9.3f} "
              f"{row['speedup']:>8.2f}x")  # fmt: skip
    results["fused_norm"] = rows
    runner.close()
    torch.cuda.empty_cache()


async def engine_level(args: argparse.Namespace, folder: Path, bandwidth: float, results: dict[str, Any]) -> None:
    import anyio
    import torch

    from asyncllm import Engine, SamplingParams
    from asyncllm.worker._model_runner import TorchModelRunner
    requests = 64 if args.quick else args.requests
    rng = random.Random(args.seed)
    vocab = QWEN3_06B["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 1024))] for _ in range(requests)]
    outputs = [rng.randint(100, 1024) for _ in range(requests)]
    start = time.perf_counter()
    runner = TorchModelRunner(
        folder, device="cuda", dtype="bfloat16", attention_backend="triton", enforce_eager=args.enforce_eager,
        max_num_seqs=256, max_model_len=4096,
    )  # fmt: skip
    steps: list[tuple[float, float, int, bool, int]] = []
    execute = runner.execute

    def timed(batch: Any) -> Any:
        t0 = time.perf_counter()
        out = execute(batch)
        seqs = batch.sequences
        decode = bool(seqs) and all(len(s.token_ids) == 1 for s in seqs)
        steps.append((t0, time.perf_counter(), len(seqs), decode, sum(s.start_position + 1 for s in seqs)))
        return out

    runner.execute = timed  # type: ignore[method-assign]
    async with Engine.open(
        folder, device="cuda", dtype="bfloat16", max_num_seqs=256, max_model_len=4096,
        max_num_batched_tokens=args.max_num_batched_tokens, runner=runner, tokenizer=NullTokenizer(),
    ) as engine:  # fmt: skip
        startup = time.perf_counter() - start
        print(f"\nengine start-up (load + CUDA graph capture): {startup:.1f} s")
        await engine.generate(prompts[0][:512], SamplingParams(max_tokens=16, ignore_eos=True))  # compile kernels
        steps.clear()
        produced = [0] * requests

        async def one(i: int) -> None:
            done = await engine.generate(prompts[i], SamplingParams(max_tokens=outputs[i], ignore_eos=True))
            produced[i] = len(done.token_ids)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(requests):
                tg.start_soon(one, i)
        wall = time.perf_counter() - t0
    tokens = sum(produced)
    in_steps = sum(t1 - t0 for t0, t1, *_ in steps)
    idle = 1 - in_steps / wall
    print(f"nano-vllm workload: {requests} requests, {tokens} output tokens in {wall:.1f} s = "
          f"{tokens / wall:,.0f} tok/s; {len(steps)} steps; device thread idle between steps {idle:.1%}")  # fmt: skip
    results["engine"] = {"requests": requests, "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                         "steps": len(steps), "idle_fraction": idle, "startup_s": startup}  # fmt: skip
    # Decode steps with every request decoding: time against weights + KV bytes over the bandwidth.
    full = [(t1 - t0, ctx) for t0, t1, n, decode, ctx in steps if decode and n == min(256, requests)]
    if not full:
        print("no all-decode step at full batch was recorded")
        return
    spec = QWEN3_06B
    weight_bytes = 2 * (
        spec["vocab_size"] * spec["hidden_size"]
        + spec["num_hidden_layers"] * (
            spec["hidden_size"] * spec["head_dim"] * (2 * spec["num_attention_heads"] + 2 * spec["num_key_value_heads"])
            + 3 * spec["hidden_size"] * spec["intermediate_size"]
        )
    )  # fmt: skip
    kv_per_token = 2 * spec["num_hidden_layers"] * spec["num_key_value_heads"] * spec["head_dim"] * 2
    step_s = statistics.median(d for d, _ in full)
    context = statistics.median(c for _, c in full)
    roofline_s = (weight_bytes + context * kv_per_token) / bandwidth
    print(f"decode at batch {min(256, requests)}: median step {step_s * 1e3:.2f} ms over {len(full)} steps, "
          f"{context / min(256, requests):.0f} tokens of context per request; roofline {roofline_s * 1e3:.2f} ms "
          f"(weights {weight_bytes / 1e9:.2f} GB + KV {context * kv_per_token / 1e9:.2f} GB); "
          f"achieved {roofline_s / step_s:.0%} of the roofline (target >= 70%)")  # fmt: skip
    results["decode_roofline"] = {"step_s": step_s, "roofline_s": roofline_s, "fraction": roofline_s / step_s,
                                  "context_tokens": context, "steps": len(full)}  # fmt: skip
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU; none is visible here (the GPU run is pending, see docs/gpu.md)")
        return 2
    import anyio

    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    bandwidth = copy_bandwidth()
    results["copy_bytes_per_s"] = bandwidth
    print(f"{results['device']}: device-to-device copy {bandwidth / 1e9:,.0f} GB/s (read + write)")
    if not args.skip_kernels:
        kernel_level(bandwidth, args.quick, results)
    if not (args.skip_fused_norm and args.skip_engine):
        patch_random_weights(args.seed)
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_config(Path(tmp))
            if not args.skip_fused_norm:
                fused_norm_level(folder, args.quick, results)
            if not args.skip_engine:
                anyio.run(engine_level, args, folder, bandwidth, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
