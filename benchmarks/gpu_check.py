"""The one-shot device check: everything about the GPU path that only a GPU can show, in one run.

    python benchmarks/gpu_check.py --out DIR [--budget 450]

Writes ``DIR/gpu_check.json`` (one entry per step: status, seconds, figures) and ``DIR/gpu_check.log``
(every step's full output). Sized to finish within 8 minutes on an H200; each step has its own
time limit, and a step that fails or runs out of time is recorded and the next one runs. Steps:

1. ``nvidia-smi``: the device, driver and memory.
2. The Triton kernel tests, compiled for the real device (tests/backends/triton; the interpreter
   is only switched on where there is no CUDA).
3. ``compute-sanitizer --tool memcheck`` over the attention kernel tests: out-of-bounds or
   misaligned accesses that numerics can miss.
4. CUDA-graph capture and replay (tests/backends/triton/test_graphs.py, compiled).
5. The engine on a tiny bfloat16 model, greedy: the triton and torch attention backends, each eager
   and with CUDA graphs, give the same tokens (the agreement is recorded; bfloat16 rounding can
   differ between backends, so the report says how many tokens agree before the first difference).
6. The number of Triton kernel variants compiled by steps 5 and 7 (cubins in a fresh cache).
7. ``benchmarks/gpu.py --quick``: kernel bandwidth, the fused norm, and the engine on the
   nano-vllm workload with the decode step against the memory roofline.
8. ``benchmarks/moe.py --fused``: the MoE layer (float32) on the torch path, a dense layer of equal
   active parameters, transformers' block and the fused-MoE Triton kernels, at 1 to 2,048 tokens.

Where there is no CUDA, each device step is recorded as skipped and the script exits 0: its flow
is tested on the CPU (tests/test_benchmarks.py). docs/gpu.md says how to run it on a lent machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

ENGINE_PARITY = r"""
import json, sys, tempfile
from pathlib import Path
import anyio, torch
from asyncllm import Engine, SamplingParams
from asyncllm.testing.tiny_models import tiny_model_path

path = tiny_model_path(Path(tempfile.mkdtemp()), "llama")  # float32 weights, run in bfloat16
prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(5 + 9 * i)] for i in range(8)]

async def run(backend, eager):
    async with Engine.open(path, device="cuda", dtype="bfloat16", attention_backend=backend,
                           enforce_eager=eager, kv_cache_blocks=256) as engine:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        outs = [await engine.generate(p, params) for p in prompts]
        return [list(o.token_ids) for o in outs]

results = {f"{b}/{'eager' if e else 'graphs'}": anyio.run(run, b, e)
           for b in ("triton", "torch") for e in (True, False)}
reference = results["torch/eager"]
def agree(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
report = {name: {"identical": toks == reference,
                 "tokens_agreeing_before_first_difference": sum(agree(a, b) for a, b in zip(toks, reference)),
                 "tokens": sum(len(t) for t in toks)} for name, toks in results.items()}
print("ENGINE_PARITY " + json.dumps(report))
sys.exit(0 if results["triton/eager"] == results["triton/graphs"] and
         results["torch/eager"] == results["torch/graphs"] else 1)
"""


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def run_step(name: str, command: list[str], limit: float, log: Any, env: dict[str, str]) -> dict[str, Any]:
    """Run one step as a subprocess within ``limit`` seconds; its output goes to the log."""
    log.write(f"\n===== {name}: {' '.join(command)} (limit {limit:.0f} s)\n")
    log.flush()
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=limit
        )
        output, status = done.stdout, ("passed" if done.returncode == 0 else f"failed (exit {done.returncode})")
    except subprocess.TimeoutExpired as expired:
        raw = expired.stdout or ""
        output = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        status = "timed out"
    except OSError as error:
        output, status = str(error), "could not start"
    log.write(output)
    log.write(f"\n===== {name}: {status} in {time.monotonic() - start:.1f} s\n")
    log.flush()
    return {"status": status, "seconds": round(time.monotonic() - start, 1), "tail": output[-2000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See docs/gpu.md.")
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.log")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"cuda": cuda_available(), "steps": {}}
    cache = Path(tempfile.mkdtemp(prefix="triton-cache-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_CACHE_DIR": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    python = sys.executable
    pytest = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly"]
    steps: list[tuple[str, list[str], float]] = [
        ("nvidia-smi", ["nvidia-smi"], 20),
        ("kernel tests, compiled", [*pytest, "tests/backends/triton"], 120),
        (
            "compute-sanitizer memcheck, attention",
            ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", *pytest,
             "tests/backends/triton/test_attention.py", "-x"],
            120,
        ),
        ("CUDA graphs", [*pytest, "tests/backends/triton/test_graphs.py"], 45),
        ("engine parity, bfloat16", [python, "-c", ENGINE_PARITY], 90),
        ("benchmarks/gpu.py --quick", [python, "benchmarks/gpu.py", "--quick", "--json", str(args.out / "gpu.json")], 100),
        (
            "benchmarks/moe.py --fused",
            [python, "benchmarks/moe.py", "--device", "cuda", "--fused", "--tokens", "1", "16", "256", "2048"],
            60,
        ),
    ]
    with open(args.out / "gpu_check.log", "w") as log:
        for name, command, limit in steps:
            if not report["cuda"] and name != "nvidia-smi":
                report["steps"][name] = {"status": "skipped: no CUDA device"}
                continue
            if shutil.which(command[0]) is None and not command[0].startswith(python):
                report["steps"][name] = {"status": f"skipped: {command[0]} not found"}
                continue
            report["steps"][name] = run_step(name, command, limit, log, env)
    parity = report["steps"].get("engine parity, bfloat16", {})
    for line in parity.get("tail", "").splitlines():
        if line.startswith("ENGINE_PARITY "):
            parity["figures"] = json.loads(line.removeprefix("ENGINE_PARITY "))
    report["triton_variants_compiled"] = len(list(cache.rglob("*.cubin")))
    shutil.rmtree(cache, ignore_errors=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    for name, step in report["steps"].items():
        print(f"{name}: {step['status']}" + (f" ({step['seconds']} s)" if "seconds" in step else ""))
    print(f"Triton kernel variants compiled: {report['triton_variants_compiled']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
