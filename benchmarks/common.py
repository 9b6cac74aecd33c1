"""Shared pieces of the benchmark scripts: workloads, models, the HF peers, progress, tables, JSON.

The scripts (``throughput.py``, ``latency.py``, ``serving.py``, ...) load this file by path
(``asyncllm.testing.import_path``, under one private module name), so they run as
``python benchmarks/<name>.py`` from anywhere, and import as modules (``main(argv)``) from tests and
from ``asyncllm bench``.

Conventions of every benchmark:
- asyncllm and its peers run the same seeded workload in the same process and the same run; the
  peers run one after another, never at the same time, and repeats are interleaved (repeat 1 of
  every system, then repeat 2, ...) so that a machine that gets slower or faster affects all alike.
- Every reported number is the median over ``--repeats`` runs; the per-run values go to ``--json``.
- A ratio is always oriented so that > 1 means asyncllm is better: throughput asyncllm/peer,
  latency peer/asyncllm.
- Nothing here asserts a time: the scripts print, people judge.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncllm.worker._cpu_threads import set_openmp_spin_default

#: The synthetic benchmark model: Llama architecture, random float32 weights (seeded). Arguments of
#: ``asyncllm.testing.tiny_models.build_tiny_model``.
SYNTHETIC_MODEL: dict[str, Any] = {
    "hidden_size": 512,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1536,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "seed": 0,
}
SYNTHETIC_FAMILY = "llama"

#: Whether this process put asyncllm's OpenMP spin (``GOMP_SPINCOUNT``) in its environment. The engine runs in the
#: benchmark's own process, whose scripts import torch (``machine_info``) before they open it, so the engine's
#: default is set here, before that import; peers' processes get the environment without it (``peer_environment``).
ENGINE_SPIN_SET = set_openmp_spin_default()


def peer_environment() -> dict[str, str]:
    """``os.environ`` for a peer engine's process, without the spin this module set for asyncllm's (a peer
    keeps its own runtime's default, as it would alone)."""
    env = dict(os.environ)
    if ENGINE_SPIN_SET:
        env.pop("GOMP_SPINCOUNT", None)
    return env

#: The peers every benchmark knows; ``--peers`` picks among them (vLLM needs ``--vllm-python``).
HF_STATIC = "hf-static"
HF_CB = "hf-cb"
VLLM = "vllm"
PEER_LABELS = {
    "asyncllm": "asyncllm",
    HF_STATIC: "HF generate() static batches",
    HF_CB: "HF continuous batching",
    VLLM: "vLLM CPU",
}
# Ids 0-2 are the special tokens of the synthetic and tiny models (pad/bos, im_start, eos); random
# prompts start above them so that no prompt contains an end-of-sequence token.
_FIRST_RANDOM_ID = 3


# ------------------------------------------------------------------------------------------------
# Workloads
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: the prompt's token ids and exactly how many tokens to generate."""

    prompt_ids: tuple[int, ...]
    output_len: int


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int,
) -> list[RequestSpec]:
    """Random token-id requests, the same ones for the same arguments.

    Args:
        num_requests: How many requests.
        prompt_len: Inclusive (min, max) of the prompt length, drawn uniformly.
        output_len: Inclusive (min, max) of the output length, drawn uniformly.
        vocab_size: Prompt ids are drawn uniformly from [3, vocab_size).
        seed: Seed of the private generator.

    Returns:
        The requests, in submission order.
    """
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_len)
        prompt = tuple(rng.randrange(_FIRST_RANDOM_ID, vocab_size) for _ in range(length))
        requests.append(RequestSpec(prompt, rng.randint(*output_len)))
    return requests


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds (the first at 0) of a Poisson process of ``rate`` requests/s."""
    rng = random.Random(seed + 1)
    times, now = [], 0.0
    for index in range(num_requests):
        if index:
            now += rng.expovariate(rate)
        times.append(now)
    return times


def workload_json(workload: Sequence[RequestSpec]) -> list[list[Any]]:
    """The workload as JSON-able ``[prompt_ids, output_len]`` pairs (for the vLLM subprocess)."""
    return [[list(r.prompt_ids), r.output_len] for r in workload]


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------


def synthetic_model_path() -> Path:
    """The synthetic benchmark model's folder, built once under ``cache_root()/"bench-models"``."""
    from asyncllm.default_model import cache_root
    from asyncllm.testing.tiny_models import tiny_model_path
    root = cache_root() / "bench-models"
    log(f"synthetic model: Llama, hidden 512, 8 layers, 8/4 heads, vocab 32000 (cached under {root})")
    return tiny_model_path(root, SYNTHETIC_FAMILY, **SYNTHETIC_MODEL)


def resolve_model(spec: str) -> Path:
    """``--model``: ``synthetic`` (built once, cached), ``default`` (SmolLM2-135M) or a folder."""
    if spec == "synthetic":
        return synthetic_model_path()
    from asyncllm.default_model import resolve_model_path
    return resolve_model_path(None if spec == "default" else spec, progress=log)


def model_config(path: Path) -> dict[str, Any]:
    """The model folder's ``config.json``."""
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config


def vocab_size(path: Path) -> int:
    """The model's vocabulary size (from ``config.json``)."""
    return int(model_config(path)["vocab_size"])


def model_summary(path: Path) -> str:
    """One line describing the model folder's architecture."""
    c = model_config(path)
    return (
        f"{path.name}: {c.get('model_type', '?')}, hidden {c.get('hidden_size')}, {c.get('num_hidden_layers')} layers, "
        f"{c.get('num_attention_heads')}/{c.get('num_key_value_heads')} heads, "
        f"intermediate {c.get('intermediate_size')}, vocab {c.get('vocab_size')}"
    )


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark takes."""
    parser.add_argument(
        "--model", default="synthetic", help="'synthetic' (default; built once), 'default' (SmolLM2-135M) or a folder"
    )
    parser.add_argument("--repeats", type=int, default=None, help="runs per system; medians are reported (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and 1 repeat: a smoke test, not a measure")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    parser.add_argument("--device", default="cpu", help="device of asyncllm and the HF peers (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"), help="anyio backend")
    parser.add_argument(
        "--no-roofline", action="store_true", help="skip measuring the machine for the roofline (float32 CPU runs)"
    )
    parser.add_argument(
        "--peers",
        default=f"{HF_STATIC},{HF_CB}",
        help=f"comma-separated peers among {HF_STATIC},{HF_CB},{VLLM} ('none' for asyncllm alone); "
        f"{VLLM} is added when --vllm-python is given",
    )
    parser.add_argument(
        "--engine-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Engine.open option, VALUE as JSON when it parses (e.g. max_num_seqs=128); repeatable",
    )


def parse_peers(args: argparse.Namespace, supported: Iterable[str]) -> list[str]:
    """``--peers`` as a checked list (plus vLLM with ``--vllm-python``)."""
    text = args.peers.strip()
    peers = [] if text in ("", "none") else [p.strip() for p in text.split(",") if p.strip()]
    if getattr(args, "vllm_python", None) and VLLM not in peers:
        peers.append(VLLM)
    allowed = set(supported)
    for peer in peers:
        if peer not in allowed:
            raise SystemExit(f"unknown or unsupported peer {peer!r} for this benchmark; choose among {sorted(allowed)}")
    return peers


def parse_key_values(items: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as a dict, each VALUE decoded as JSON when it parses, else kept as text."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``Engine.open`` keyword arguments for this run."""
    return {"device": args.device, "dtype": args.dtype, **parse_key_values(args.engine_opt)}


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


_T0 = time.perf_counter()


def log(message: str) -> None:
    """A progress or diagnostic line on stderr (stdout carries only the results), stamped with the
    seconds since the benchmark module was loaded."""
    print(f"[{time.perf_counter() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


class Progress:
    """A one-line progress bar on stderr, redrawn with ``\\r`` at most ten times a second.

    Args:
        description: What is being counted.
        total: The count at completion.
    """

    def __init__(self, description: str, total: int) -> None:
        self.description = description
        self.total = max(total, 1)
        self.done = 0
        self._start = time.perf_counter()
        self._drawn = 0.0
        self._lock = threading.Lock()  # the HF continuous batching peer updates from its own thread
        self._live = sys.stderr.isatty()
        self._draw(force=True)

    def update(self, count: int = 1) -> None:
        """Count ``count`` more items done."""
        with self._lock:
            self.done += count
            self._draw(force=self.done >= self.total)

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self._live or (not force and now - self._drawn < 0.1):
            return
        self._drawn = now
        width = 24
        filled = int(width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r  {self.description:<34} [{bar}] {self.done}/{self.total} {now - self._start:6.1f}s")
        sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line (on a terminal) or write one summary line (in a log)."""
        elapsed = time.perf_counter() - self._start
        if self._live:
            self._draw(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            log(f"  {self.description}: {self.done}/{self.total} in {elapsed:.1f}s")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def machine_info() -> dict[str, Any]:
    """The machine and versions header: CPU model, cores, torch threads, library versions."""
    import torch
    import transformers

    import asyncllm

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
        "openmp_spin": os.environ.get("GOMP_SPINCOUNT", "the runtime's default"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "asyncllm": asyncllm.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def print_header(title: str, info: dict[str, Any], lines: Iterable[str] = ()) -> None:
    """Print the benchmark's title, the machine/versions header and the workload lines."""
    print(f"# {title}")
    print(
        f"machine: {info['cpu']}, {info['cores']} cores ({info['usable_cores']} usable), "
        f"torch threads {info['torch_threads']}, OpenMP spin {info.get('openmp_spin', '?')}"
        + (f", GPU {info['gpu']}" if "gpu" in info else "")
    )
    print(
        f"versions: python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
        f"asyncllm {info['asyncllm']}" + (f", vllm {info['vllm']}" if "vllm" in info else "")
    )
    for line in lines:
        print(line)
    print()


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (aligned, so it also reads well in a terminal)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        lines.append(
            "| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) + " |"
        )
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        if abs(value) >= 0.1 or value == 0:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def write_json(path: Path | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON to ``path`` (if given)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    log(f"results written to {path}")


# ------------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    """The median (NaN for no values)."""
    data = list(values)
    return statistics.median(data) if data else math.nan


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear interpolation between order statistics (NaN if empty)."""
    data = sorted(values)
    if not data:
        return math.nan
    position = (len(data) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (position - low)


def ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``, None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or math.isnan(numerator) or math.isnan(denominator):
        return None
    if denominator == 0:
        return None
    return numerator / denominator


def median_of_runs(runs: Sequence[dict[str, Any]], key: str) -> float:
    """The median of ``run[key]`` over the runs."""
    return median(run[key] for run in runs if run.get(key) is not None)


# ------------------------------------------------------------------------------------------------
# Roofline: the least time the machine needs for a workload (see roofline.py for the model)
# ------------------------------------------------------------------------------------------------

FLOAT32_BYTES = 4

#: Matmul shapes (rows, inputs, outputs) timed for the peak: the benchmark model's prefill
#: projections and a square one. The best rate over all of them counts.
PEAK_SHAPES = ((2048, 512, 3072), (2048, 1536, 512), (1024, 1024, 1024))
#: Bytes summed for the bandwidth: several times any last-level cache, so the read comes from memory.
BANDWIDTH_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True)
class MachinePeaks:
    """What the machine reaches at best, measured with torch's current thread count."""

    flops: float
    """float32 matmul FLOPs per second (MKL through ``torch.mm``, operands in cache)."""
    bandwidth: float
    """Memory read bytes per second (``torch.sum`` over ``BANDWIDTH_BYTES``)."""

    def describe(self) -> str:
        return f"float32 matmul {self.flops / 1e9:.0f} GFLOPS, memory read {self.bandwidth / 1e9:.1f} GB/s"


def _best_seconds(fn: Callable[..., Any], *args: Any, repeats: int, **kwargs: Any) -> float:
    fn(*args, **kwargs)  # the first call pays for allocation and the thread pool's start
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best


def roofline_applies(args: argparse.Namespace) -> bool:
    """Whether the roofline's model (float32 on the CPU) describes this run."""
    return bool(args.device == "cpu" and args.dtype == "float32" and not args.no_roofline)


def measure_machine(repeats: int = 8, bandwidth_bytes: int = BANDWIDTH_BYTES) -> MachinePeaks:
    """Time the peak matmul rate and the read bandwidth (about a second or two); best of ``repeats``."""
    import torch

    generator = torch.Generator().manual_seed(0)
    flops = 0.0
    for rows, inputs, outputs in PEAK_SHAPES:
        a = torch.randn(rows, inputs, generator=generator)
        b = torch.randn(inputs, outputs, generator=generator)
        out = torch.empty(rows, outputs)
        seconds = _best_seconds(torch.mm, a, b, out=out, repeats=repeats)
        flops = max(flops, 2 * rows * inputs * outputs / seconds)
    data = torch.ones(bandwidth_bytes // FLOAT32_BYTES)
    seconds = _best_seconds(data.sum, repeats=repeats)
    return MachinePeaks(flops=flops, bandwidth=data.numel() * FLOAT32_BYTES / seconds)


@dataclass(frozen=True)
class ModelCost:
    """Per-token costs of a Llama-style decoder in float32, from its ``config.json``."""

    layer_weights: int
    """Weights of all decoder layers' projections (q, k, v, o, gate, up, down)."""
    head_weights: int
    """Weights of the output projection (vocab x hidden)."""
    attention_flops_per_pair: int
    """FLOPs of one query against one cached key and value, summed over heads and layers."""
    kv_bytes_per_token: int
    """Bytes of one token's cached keys and values, all layers."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelCost:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        layers = int(config["num_hidden_layers"])
        attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
        mlp = 3 * hidden * int(config["intermediate_size"])
        return cls(
            layer_weights=layers * (attention + mlp),
            head_weights=int(config["vocab_size"]) * hidden,
            # q.k and p.v: two multiply-adds per head dimension, per head.
            attention_flops_per_pair=4 * heads * head_dim * layers,
            kv_bytes_per_token=2 * kv_heads * head_dim * layers * FLOAT32_BYTES,
        )

    @property
    def weight_bytes(self) -> int:
        return (self.layer_weights + self.head_weights) * FLOAT32_BYTES

    def prefill_flops(self, prompt_len: int) -> float:
        """One prompt's prefill: its tokens through the layers, causal attention, logits of the last."""
        pairs = prompt_len * (prompt_len + 1) // 2
        return 2 * prompt_len * self.layer_weights + self.attention_flops_per_pair * pairs + 2 * self.head_weights

    def decode_step(self, contexts: Sequence[int]) -> tuple[float, float]:
        """(FLOPs, bytes) of one decode step for running requests with these context lengths."""
        context = sum(contexts)
        flops = 2 * len(contexts) * (self.layer_weights + self.head_weights)
        flops += self.attention_flops_per_pair * context
        return flops, self.weight_bytes + self.kv_bytes_per_token * context


def model_cost(path: Path) -> ModelCost:
    """The float32 per-token costs of the model folder (its ``config.json``)."""
    return ModelCost.from_config(model_config(path))


@dataclass(frozen=True)
class Roofline:
    """The least time for a workload (seconds), and its parts."""

    prefill: float
    decode: float
    compute_only: float
    """Every FLOP at the peak rate, nothing waiting for memory: a floor for any schedule."""
    decode_steps: int

    @property
    def total(self) -> float:
        return self.prefill + self.decode

    def fraction(self, seconds: float) -> float:
        """How close a measured time is to the roofline (1.0: no time lost)."""
        return self.total / seconds if seconds > 0 else float("nan")

    def as_json(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "prefill": self.prefill,
            "decode": self.decode,
            "compute_only": self.compute_only,
            "decode_steps": self.decode_steps,
        }

    def describe(self) -> str:
        return (
            f"{self.total:.2f} s (prefill {self.prefill:.2f} s at peak FLOPS, {self.decode_steps} decode steps "
            f"{self.decode:.2f} s at max(compute, memory); all FLOPs at peak alone {self.compute_only:.2f} s)"
        )


def workload_roofline(cost: ModelCost, workload: Sequence[RequestSpec], peaks: MachinePeaks) -> Roofline:
    """The roofline of ``workload``, every request arriving at once."""
    requests = [(len(r.prompt_ids), r.output_len) for r in workload]
    prefill_flops = sum(cost.prefill_flops(prompt) for prompt, _ in requests)
    decode_seconds, decode_flops = 0.0, 0.0
    steps = max((output for _, output in requests), default=1) - 1
    for step in range(1, steps + 1):
        # Step s computes token s + 1 of each request that wants more than s tokens; its context
        # is the prompt and the s tokens before it.
        contexts = [prompt + step for prompt, output in requests if output > step]
        flops, nbytes = cost.decode_step(contexts)
        decode_flops += flops
        decode_seconds += max(flops / peaks.flops, nbytes / peaks.bandwidth)
    return Roofline(
        prefill=prefill_flops / peaks.flops,
        decode=decode_seconds,
        compute_only=(prefill_flops + decode_flops) / peaks.flops,
        decode_steps=steps,
    )


def latency_roofline(cost: ModelCost, prompt_len: int, output_len: int, peaks: MachinePeaks) -> tuple[float, float]:
    """(TTFT, mean inter-token latency) floors of one request alone, in seconds."""
    ttft = cost.prefill_flops(prompt_len) / peaks.flops
    steps = [cost.decode_step([prompt_len + step]) for step in range(1, output_len)]
    itl = sum(max(f / peaks.flops, b / peaks.bandwidth) for f, b in steps) / max(len(steps), 1)
    return ttft, itl


# ------------------------------------------------------------------------------------------------
# asyncllm helpers
# ------------------------------------------------------------------------------------------------


_GAUGES = frozenset({"num_running", "num_waiting", "num_cached_blocks"})


def statistics_delta(before: Any, after: Any) -> dict[str, Any]:
    """The counters of two ``EngineStatistics`` snapshots (numeric fields, not gauges), as after - before.

    Fields added to ``EngineStatistics`` later (step timings, device idle time) show up here with no
    change to the benchmarks.
    """
    import msgspec

    a, b = msgspec.structs.asdict(before), msgspec.structs.asdict(after)
    delta: dict[str, Any] = {}
    for key, value in b.items():
        old = a.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(old, (int, float)):
            if key in _GAUGES or key.startswith("kv_") or key.endswith("_rate"):
                continue  # gauges, not counters
            delta[key] = value - old
    return delta


def format_statistics(delta: dict[str, Any]) -> str:
    """The statistics delta on one line."""

    def cell(value: Any) -> Any:
        if isinstance(value, list):  # per-request results: too long for a log line
            return f"[{len(value)} entries]"
        return _cell(float(value)) if isinstance(value, float) else value

    return ", ".join(f"{k}={cell(v)}" for k, v in delta.items()) or "-"


# ------------------------------------------------------------------------------------------------
# HF transformers peers
# ------------------------------------------------------------------------------------------------


def load_hf_model(path: Path, device: str, dtype: str) -> Any:
    """The HF ``AutoModelForCausalLM`` of the folder, in eval mode, on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def hf_pad_id(model: Any) -> int:
    """The id to pad HF batches with: the config's pad token, else its EOS, else 0."""
    config = model.config
    for value in (config.pad_token_id, config.eos_token_id):
        if isinstance(value, int):
            return value
        if isinstance(value, (list, tuple)) and value:
            return int(value[0])
    return 0


class StepTimes:
    """An HF ``BaseStreamer`` that records when each decoding step's tokens reach the host.

    ``generate`` puts the prompt first (ignored here), then each step's tokens (one per row of the
    batch): ``times[i]`` is when the ``i``-th generated token of every row was ready.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: Any) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate_batch(
    model: Any, prompts: Sequence[Sequence[int]], new_tokens: int, streamer: StepTimes | None = None
) -> list[list[int]]:
    """One static, left-padded ``generate()`` call: greedy, exactly ``new_tokens`` tokens per row.

    ``min_new_tokens == max_new_tokens`` suppresses EOS, so every row generates ``new_tokens``
    tokens, as ``ignore_eos`` does. Returns each row's generated ids.
    """
    import torch

    pad = hf_pad_id(model)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=pad,
            streamer=streamer,
        )
    return [row[width:].tolist() for row in out.cpu()]


def static_batches(workload: Sequence[RequestSpec], batch_size: int, sort: bool) -> list[list[int]]:
    """Indices of the workload grouped into static batches of ``batch_size``.

    With ``sort``, requests are grouped by output length (longest first, then prompt length), so a
    batch wastes fewer steps on rows that are already done; otherwise in submission order.
    """
    order = list(range(len(workload)))
    if sort:
        order.sort(key=lambda i: (-workload[i].output_len, -len(workload[i].prompt_ids)))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def run_hf_static(
    model: Any, workload: Sequence[RequestSpec], batch_size: int, sort: bool, label: str
) -> dict[str, Any]:
    """The HF ``generate()`` static-batching throughput run.

    Each batch generates max(output_len) of its rows for every row; only each request's own
    ``output_len`` tokens count as useful output (``output_tokens``); ``computed_tokens`` counts all.
    """
    batches = static_batches(workload, batch_size, sort)
    useful = computed = 0
    outputs: dict[int, list[int]] = {}
    with Progress(label, len(workload)) as progress:
        start = time.perf_counter()
        for batch in batches:
            longest = max(workload[i].output_len for i in batch)
            generated = hf_generate_batch(model, [workload[i].prompt_ids for i in batch], longest)
            for i, ids in zip(batch, generated):
                outputs[i] = ids[: workload[i].output_len]
                useful += workload[i].output_len
            computed += longest * len(batch)
            progress.update(len(batch))
        seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "output_tokens": useful,
        "computed_tokens": computed,
        "tokens_per_s": useful / seconds,
        "outputs": [outputs[i] for i in range(len(workload))],
    }


def hf_cb_config(workload: Sequence[RequestSpec], max_batch_tokens: int) -> Any:
    """A ``ContinuousBatchingConfig`` whose KV cache holds the whole workload at once.

    Left to itself on CPU, transformers sizes the paged cache at 60% of RAM, and that makes every
    step far slower (38 s instead of 1.3 s for 8 tiny requests, measured with transformers 5.24):
    the cache is sized to the workload instead, as a user tuning it would, with the same per-step
    token budget as asyncllm's ``max_num_batched_tokens``.
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    blocks = sum(-(-(len(r.prompt_ids) + r.output_len) // page) for r in workload) + 2
    return ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=max_batch_tokens)


class HFContinuousBatching:
    """HF transformers' continuous batching (``generate_batch``'s manager), one run per ``with``.

    ``generate_batch(inputs, max_new_tokens=...)`` takes one ``max_new_tokens`` for all requests;
    its manager's ``add_request`` takes one per request, so this drives the manager directly (as
    ``generate_batch`` does) to generate exactly each request's ``output_len`` tokens, with EOS off
    (``eos_token_id=-1``) and greedy decoding.
    """

    def __init__(self, model: Any, workload: Sequence[RequestSpec], max_batch_tokens: int) -> None:
        from transformers import GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints

        self.model = model
        longest = max(r.output_len for r in workload)
        self.generation_config = GenerationConfig(
            do_sample=False, max_new_tokens=longest, eos_token_id=-1, pad_token_id=hf_pad_id(model)
        )
        self.cb_config = hf_cb_config(workload, max_batch_tokens)
        self.hints = WorkloadHints(
            max_prompt_length=max(len(r.prompt_ids) for r in workload),
            max_generated_length=longest,
            num_requests=len(workload),
        )
        self._cm: Any = None
        self.manager: Any = None

    def __enter__(self) -> HFContinuousBatching:
        self._cm = self.model.continuous_batching_context_manager(
            generation_config=self.generation_config,
            continuous_batching_config=self.cb_config,
            block=True,
            timeout=30,
            workload_hints=self.hints,
        )
        self.manager = self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)

    def add(self, request_id: str, request: RequestSpec, record_timestamps: bool = False) -> None:
        """Submit one request (``output_len`` tokens exactly)."""
        self.manager.add_request(
            list(request.prompt_ids),
            request_id=request_id,
            max_new_tokens=request.output_len,
            eos_token_id=-1,
            record_timestamps=record_timestamps,
        )

    def collect(self, count: int, progress: Progress | None = None, timeout: float = 900.0) -> dict[str, Any]:
        """Wait for ``count`` finished requests; return their ``GenerationOutput`` by request id.

        Raises:
            TimeoutError: No request finished for ``timeout`` seconds.
            RuntimeError: The manager stopped, or a request failed.
        """
        results: dict[str, Any] = {}
        deadline = time.perf_counter() + timeout
        while len(results) < count:
            result = self.manager.get_result(timeout=0.05)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before every request finished")
                if time.perf_counter() > deadline:
                    raise TimeoutError(
                        f"HF continuous batching: no request finished for {timeout}s ({len(results)}/{count})"
                    )
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"HF continuous batching failed request {result.request_id}: {result.error}")
                results[result.request_id] = result
                deadline = time.perf_counter() + timeout
                if progress is not None:
                    progress.update()
        return results


def run_hf_cb(model: Any, workload: Sequence[RequestSpec], max_batch_tokens: int, label: str) -> dict[str, Any]:
    """The HF continuous batching throughput run: every request submitted at t=0."""
    with HFContinuousBatching(model, workload, max_batch_tokens) as cb, Progress(label, len(workload)) as progress:
        start = time.perf_counter()
        for index, request in enumerate(workload):
            cb.add(f"r{index}", request)
        results = cb.collect(len(workload), progress)
        seconds = time.perf_counter() - start
    outputs = [list(results[f"r{i}"].generated_tokens) for i in range(len(workload))]
    tokens = sum(len(o) for o in outputs)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds, "outputs": outputs}


def hf_warmup(model: Any, vocab: int) -> None:
    """One short ``generate`` so that first-call costs (allocations, lazy imports) are not timed."""
    rng = random.Random(12345)
    prompt = [rng.randrange(_FIRST_RANDOM_ID, vocab) for _ in range(16)]
    hf_generate_batch(model, [prompt, prompt[:8]], 4)


# ------------------------------------------------------------------------------------------------
# vLLM peer (a subprocess in its own virtual environment)
# ------------------------------------------------------------------------------------------------


@dataclass
class VLLMResult:
    """What the vLLM worker reported, or why there is nothing."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    version: str | None = None
    skipped: str | None = None
    preload: str | None = None
    """LD_PRELOAD and the VLLM_CPU_* environment variables the worker ran with."""


@functools.cache
def _preload_libraries(python: str) -> list[str]:
    """tcmalloc and Intel OpenMP, as vLLM's CPU docs advise, where they are found (looked for once per
    interpreter: a recursive search of its site-packages takes seconds, and a benchmark may start
    several workers)."""
    import glob
    import subprocess

    try:
        prefix = subprocess.run(
            [python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True, check=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        prefix = ""
    system_dirs = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
    ]
    found: list[str] = []
    for names, dirs in (
        (("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), [*system_dirs, f"{prefix}/lib"]),
        (("libiomp5.so",), [f"{prefix}/lib", *system_dirs]),
    ):
        hit = next((f"{d}/{n}" for n in names for d in dirs if d and os.path.isfile(f"{d}/{n}")), None)
        if hit is None and prefix:  # wheels sometimes keep it inside site-packages
            matches = [
                m for n in names for m in glob.glob(f"{prefix}/lib/python3*/site-packages/**/{n}", recursive=True)
            ]
            hit = matches[0] if matches else None
        if hit:
            found.append(hit)
    return found


class VLLMWorker:
    """vLLM's CPU backend as a peer: ``_vllm_worker.py`` under ``python`` (a venv with ``vllm-cpu``).

    The worker starts on entry, loads the model and warms up once, then times one repeat per
    ``run()``, so a benchmark interleaves vLLM's repeats with the other systems' (its own engine stays
    loaded and idle meanwhile); it is stopped on exit. The worker gets the same workload (as JSON);
    tcmalloc and Intel OpenMP are preloaded (``LD_PRELOAD``) when found. Never raises for a missing or
    failing vLLM: ``run()`` returns None from then on and ``result().skipped`` says why.

    Args:
        python: The interpreter, or None (the peer is skipped).
        mode: ``"throughput"``, ``"latency"`` or ``"single"`` (what one repeat measures; see ``_vllm_worker.py``).
        model: The model folder.
        workload: The requests (latency: the first one).
        dtype: The weights' dtype.
        options: Extra ``vllm.LLM`` keyword arguments.
        reply_timeout: Seconds to wait for any one reply (loading the model, one repeat); a worker
            that takes longer is killed and the peer skipped, so a hung vLLM cannot hang the benchmark.
    """

    def __init__(
        self,
        python: str | None,
        mode: str,
        model: Path,
        workload: Sequence[RequestSpec],
        dtype: str,
        options: dict[str, Any],
        reply_timeout: float = 1800.0,
    ) -> None:
        self.python = python
        self.reply_timeout = reply_timeout
        self.spec = {"mode": mode, "model": str(model), "dtype": dtype, "options": options}
        self.workload = workload
        self.runs: list[dict[str, Any]] = []
        self.version: str | None = None
        self.skipped: str | None = None
        self._preload: str | None = None
        self._process: Any = None  # subprocess.Popen, once started
        self._reply_fd: int | None = None
        self._buffer = b""
        self._tmp: Any = None  # tempfile.TemporaryDirectory holding the workload's JSON
        self._quiet_cpu: float | None = None  # the worker's CPU seconds when _settle found it idle

    def __enter__(self) -> VLLMWorker:
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def _start(self) -> None:
        import subprocess
        import tempfile

        python = self.python
        if not python:
            self.skipped = "no --vllm-python given"
            return
        if not os.path.exists(python):
            self.skipped = f"--vllm-python {python} does not exist"
            return
        try:
            probe = subprocess.run(
                [python, "-c", "import vllm; print(vllm.__version__)"],
                capture_output=True,
                text=True,
                timeout=self.reply_timeout,
            )
        except subprocess.TimeoutExpired:
            self.skipped = f"importing vllm under {python} took over {self.reply_timeout:g}s"
            return
        if probe.returncode != 0:
            tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
            self.skipped = f"vllm does not import under {python}: {tail}"
            return
        env = peer_environment()
        preload = _preload_libraries(python)
        if preload:
            env["LD_PRELOAD"] = ":".join([*preload, *([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else [])])
        settings = [f"LD_PRELOAD={env.get('LD_PRELOAD', '(nothing found)')}"]
        missing = [
            name
            for name, kind in (("tcmalloc", "tcmalloc"), ("Intel OpenMP", "libiomp5"))
            if kind not in env.get("LD_PRELOAD", "")
        ]
        if missing:  # below vLLM's best setting: say so where the ratios are read
            settings.append(f"NOT preloaded (not found): {' and '.join(missing)}, below vLLM's best setting")
        settings += [f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("VLLM_CPU_")]
        self._preload = ", ".join(settings)
        self._tmp = tempfile.TemporaryDirectory(prefix="asyncllm-bench-")
        spec_path = Path(self._tmp.name) / "workload.json"
        spec_path.write_text(json.dumps({**self.spec, "requests": workload_json(self.workload)}))
        log(f"starting the vLLM {probe.stdout.strip()} worker ({self.spec['mode']}), {self._preload}")
        # vLLM logs to stdout; stdout is for the results table, so the worker's goes to stderr (file
        # descriptor 2 when sys.stderr is not a file, as under pytest's capture). Replies come back
        # through a pipe of their own.
        try:
            sink = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
            sink = 2
        read_fd, write_fd = os.pipe()
        self._reply_fd = read_fd
        try:
            self._process = subprocess.Popen(
                [python, str(Path(__file__).with_name("_vllm_worker.py")), str(spec_path), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=sink,
                env=env,
                pass_fds=(write_fd,),
                # Its own process group: vLLM runs its engine in a child process, which a kill of the
                # worker alone would leave running (holding the model and its cache, maybe a core).
                start_new_session=True,
            )
        finally:
            os.close(write_fd)  # the worker holds its own copy; end of file then means it is gone
        start = time.perf_counter()
        hello = self._reply("while loading the model")
        if hello is not None and "error" in hello:  # vllm.LLM refused the options: its own words
            self._stop()
            status = self._process.returncode
            self.skipped = (
                f"the vLLM worker failed while loading the model (exit status {status}): vllm.LLM with the "
                f"options {self.spec['options']} raised {hello['error']}"
            )
            log(f"  {self.skipped}")
        elif hello is not None:
            self.version = hello.get("version")
            log(f"vLLM worker ready (model loaded, warmed up) in {time.perf_counter() - start:.1f}s; {self._settle()}")

    def run(self, label: str) -> dict[str, Any] | None:
        """Time one repeat in the worker (blocking); its result, or None once vLLM is skipped.

        Args:
            label: What the log line calls this repeat, e.g. ``"vLLM (repeat 1/3)"``.
        """
        if self.skipped is not None:
            return None
        # The CPU time vLLM's processes took while the other systems ran, and the time this process
        # (asyncllm's engine, the HF peers) takes while vLLM runs: both about 0 when the idle side idles.
        idle_cpu = self._cpu_since_quiet()
        with contextlib.suppress(OSError):  # BrokenPipeError: the worker is gone; _reply says how it ended
            self._process.stdin.write(b"run\n")
            self._process.stdin.flush()
        cpu = time.process_time()
        result = self._reply(f"in {label}")
        if result is None:
            return None
        ours = time.process_time() - cpu
        log(f"  {label}: {format_statistics(result)}; {self._settle()}")
        log(f"    CPU while idle: vLLM's processes {idle_cpu} before this repeat, this process {ours:.2f}s during it")
        self.runs.append(result)
        return result

    def _settle(self) -> str:
        """Wait (10 s at most) until the worker's processes stop using CPU; a note for the log.

        After each ``generate`` vLLM's engine keeps a core busy for about a second (vllm-cpu 0.32.0 on
        2 cores), which would slow whichever system runs next.
        """
        start = time.perf_counter()
        last = _process_tree_cpu(self._process.pid)
        if last is None:  # no /proc
            time.sleep(2.0)
            self._quiet_cpu = None
            return "waited 2s for vLLM to go idle"
        while time.perf_counter() - start < 10.0:
            time.sleep(0.25)
            now = _process_tree_cpu(self._process.pid)
            if now is None or now - last < 0.025:  # gone (then the next call says so), or < 10% of a core
                self._quiet_cpu = now
                return f"vLLM idle again after {time.perf_counter() - start:.1f}s"
            last = now
        self._quiet_cpu = last
        return "vLLM still busy after 10s"

    def _cpu_since_quiet(self) -> str:
        """The CPU seconds the worker's processes used since ``_settle`` last found them idle, as text."""
        now = _process_tree_cpu(self._process.pid)
        if now is None or self._quiet_cpu is None:
            return "?"
        return f"{now - self._quiet_cpu:.2f}s"

    def result(self) -> VLLMResult:
        """What vLLM reported: every repeat's result, or why it was skipped (then no result at all)."""
        if self.skipped is not None:
            return VLLMResult(skipped=self.skipped, preload=self._preload)
        return VLLMResult(runs=list(self.runs), version=self.version, preload=self._preload)

    def _reply(self, during: str) -> dict[str, Any] | None:
        """The worker's next reply line, or None (and ``skipped`` set, the worker stopped) if it failed."""
        import select

        assert self._reply_fd is not None
        deadline = time.perf_counter() + self.reply_timeout
        while b"\n" not in self._buffer:
            if time.perf_counter() > deadline:
                self._fail(f"{during} (no reply within {self.reply_timeout:g}s)", kill=True)
                return None
            exited = self._process.poll() is not None
            ready, _, _ = select.select([self._reply_fd], [], [], 0 if exited else 1.0)
            chunk = os.read(self._reply_fd, 1 << 16) if ready else b""
            if chunk:
                self._buffer += chunk
            elif exited or ready:  # gone, or end of file: it closed the pipe
                self._fail(during)
                return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            reply: dict[str, Any] = json.loads(line)
        except ValueError:
            self._fail(f"{during} (unreadable reply {line[:80]!r})")
            return None
        return reply

    def _fail(self, during: str, kill: bool = False) -> None:
        self._stop(kill)
        status = self._process.returncode
        self.skipped = f"the vLLM worker failed {during} (exit status {status}); see its stderr above"
        log(f"  {self.skipped}")

    def _stop(self, kill: bool = False) -> None:
        """End the worker (end of file on its stdin; killed if it lingers, or at once with ``kill``) and
        free the pipe and files."""
        import subprocess

        process = self._process
        if process is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
            if kill:
                _kill_group(process)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                process.wait()
        if self._reply_fd is not None:
            os.close(self._reply_fd)
            self._reply_fd = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _kill_group(process: Any) -> None:
    """SIGKILL the worker's process group: the worker and vLLM's engine processes under it."""
    import signal

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    if process.poll() is None:  # not a group leader after all (no session support): the worker at least
        process.kill()


def _process_tree_cpu(root: int) -> float | None:
    """The CPU seconds (user + system) used so far by process ``root`` and its descendants, read from
    ``/proc``; None where there is no ``/proc`` or no such process."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    children: dict[int, list[int]] = {}
    used: dict[int, float] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        except (OSError, IndexError):  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
        used[int(name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    if root not in used:
        return None
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += used.get(pid, 0.0)
        stack.extend(children.get(pid, []))
    return total


def open_vllm(
    args: argparse.Namespace, peers: Sequence[str], mode: str, model: Path, workload: Sequence[RequestSpec]
) -> contextlib.AbstractContextManager[VLLMWorker | None]:
    """The benchmark's ``VLLMWorker`` (from ``--vllm-python`` and ``--vllm-opt``), or None without the peer."""
    if VLLM not in peers:
        return contextlib.nullcontext()
    options = parse_key_values(args.vllm_opt)
    return VLLMWorker(args.vllm_python, mode, model, workload, args.dtype, options)


def report_vllm(
    worker: VLLMWorker | None, runs: dict[str, list[dict[str, Any]]], info: dict[str, Any], notes: list[str]
) -> None:
    """Add vLLM's repeats to ``runs`` (last row of the table), its version to ``info``, and a note."""
    if worker is None:
        return
    result = worker.result()
    if result.skipped:
        notes.append(f"vLLM skipped: {result.skipped}")
        return
    runs[VLLM] = result.runs
    info["vllm"] = result.version
    notes.append(f"vLLM ran with {result.preload}")


def interleaved_note(systems: Iterable[str], repeats: int, labels: Mapping[str, str] = PEER_LABELS) -> str:
    """The note that says how the repeats ran: in rounds of asyncllm, vLLM, then the HF peers.

    Args:
        systems: The systems that have results.
        repeats: How many rounds.
        labels: The systems' names in the table.
    """
    ran = set(systems)
    order = ", ".join(labels[s] for s in ("asyncllm", VLLM, HF_STATIC, HF_CB) if s in ran)
    rounds = f"{repeats} round{'s' if repeats != 1 else ''}"
    return (
        f"repeats interleaved: {rounds}, each running {order} once in that order, so ratios compare neighbours in time"
    )


def per_round_ratios(
    ours: Sequence[dict[str, Any]], theirs: Sequence[dict[str, Any]], key: str, *, ours_first: bool = True
) -> list[float]:
    """Round by round, ``ours[i][key] / theirs[i][key]`` (or the inverse): each ratio from one round's
    neighbours in time, which the host's drift between rounds does not skew. Rounds missing either side
    are skipped."""
    ratios = []
    for mine, peer in zip(ours, theirs):
        value = ratio(mine.get(key), peer.get(key)) if ours_first else ratio(peer.get(key), mine.get(key))
        if value is not None:
            ratios.append(value)
    return ratios


def per_round_note(label: str, what: str, ratios: Sequence[float]) -> str:
    """The note listing one peer's per-round ratios and their median (empty ratios: a note saying so)."""
    if not ratios:
        return f"{what} per round, {label}: no complete round"
    listed = ", ".join(f"{value:.2f}" for value in ratios)
    return f"{what} per round, {label}: {listed} (median {median(ratios):.2f})"


def run_blocking(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in a worker thread from async code (an HF peer while the engine is idle)."""
    import anyio

    return anyio.to_thread.run_sync(lambda: fn(*args))


if __name__ == "__main__":
    sys.exit(
        "benchmarks/common.py holds what the benchmark scripts share; run one of them instead: "
        "throughput.py, latency.py or serving.py (or `asyncllm bench NAME`)"
    )
