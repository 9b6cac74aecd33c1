"""Smoke tests of the benchmark scripts in benchmarks/: each runs end to end with ``--quick`` on a tiny model.

No test looks at a time: the numbers are noise at these sizes. They check that every system ran the
whole workload, that the tables have their rows, and that the ratios are positive numbers.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import signal
import stat
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# The engine would size its KV cache from memory (1 GiB on CPU); a --quick workload needs a few
# dozen blocks, and allocating less keeps these tests fast.
SMALL_KV = ["--engine-opt", "kv_cache_blocks=256"]


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"asyncllm_bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(name: str, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, Any]]:
    out_json = tmp_path / f"{name}.json"
    assert load(name).main([*argv, "--quick", "--json", str(out_json), *SMALL_KV]) == 0
    return capsys.readouterr().out, json.loads(out_json.read_text())


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_throughput_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, result = run("throughput", ["--model", str(tiny_llama)], tmp_path, capsys)
    for row in ("| asyncllm ", "| HF generate() static batches ", "| HF continuous batching "):
        assert row in out
    assert "asyncllm / peer" in out and "machine:" in out and "versions:" in out
    assert (
        "of roofline" in out
        and positive(result["roofline"]["total"])
        and positive(result["roofline"]["peaks"]["flops"])
    )
    assert set(result["ratios"]) == {"hf-static", "hf-cb"}
    assert all(positive(r) for r in result["ratios"].values())
    requested = result["workload"]["output_tokens"]
    assert result["workload"]["num_requests"] == 8
    for system in ("asyncllm", "hf-static", "hf-cb"):
        assert positive(result["results"][system]["tokens_per_s"])
        assert [run["output_tokens"] for run in result["results"][system]["runs"]] == [requested]
    # Static batches compute more than they deliver; only the requested tokens count.
    assert result["results"]["hf-static"]["runs"][0]["computed_tokens"] >= requested
    assert "only those count" in out


def test_latency_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, result = run("latency", ["--model", str(tiny_llama)], tmp_path, capsys)
    for row in ("| asyncllm ", "| HF generate() ", "| HF continuous batching "):
        assert row in out
    assert "TTFT ms" in out and "mean ITL ms" in out
    assert positive(result["roofline"]["ttft"]) and positive(result["roofline"]["itl"]) and "of roofline" in out
    for system in ("asyncllm", "hf-static", "hf-cb"):
        assert positive(result["results"][system]["ttft"]) and positive(result["results"][system]["itl"])
        assert [run["output_tokens"] for run in result["results"][system]["runs"]] == [16]
    for peer in ("hf-static", "hf-cb"):
        assert positive(result["ratios"][peer]["ttft"]) and positive(result["ratios"][peer]["itl"])


def test_serving_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, result = run("serving", ["--model", str(tiny_llama), "--backend", "trio"], tmp_path, capsys)
    for row in ("| asyncllm ", "| HF generate() static batches ", "| HF continuous batching "):
        assert out.count(row) == 2  # the percentile table and the goodput table
    assert "TTFT p99 ms" in out and "goodput req/s" in out
    for system in ("asyncllm", "hf-static", "hf-cb"):
        median = result["results"][system]["median"]
        for key in ("ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99"):
            assert positive(median[key]), (system, key)
        assert median["ttft_p50"] <= median["ttft_p99"] and median["e2e_p50"] <= median["e2e_p99"]
        assert 0 <= median["good_fraction"] <= 1
    for peer in ("hf-static", "hf-cb"):
        ratios = result["ratios"][peer]
        for key in ("ttft_p50", "itl_p50", "e2e_p50"):
            assert positive(ratios[key])
        assert ratios["goodput"] is None or positive(ratios["goodput"])


FAKE_VLLM = """
import os

__version__ = "0.0.0+fake"
# The generate() call (1 = the worker's warm-up) that crashes the worker; 0: loading the model does.
_FAIL_AT = int(os.environ.get("FAKE_VLLM_FAIL_AT", "-1"))
# The generate() call that never returns (a hung vLLM).
_HANG_AT = int(os.environ.get("FAKE_VLLM_HANG_AT", "-1"))


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, min_tokens=0, ignore_eos=False):
        # Exactly max_tokens tokens, or (the "single" mode) greedy up to max_tokens.
        assert temperature == 0.0 and (ignore_eos and min_tokens == max_tokens or not ignore_eos and not min_tokens)
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _RequestOutput:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class LLM:
    def __init__(self, model, dtype, **options):
        assert dtype == "float32", dtype
        if _FAIL_AT == 0:
            raise RuntimeError("fake vLLM fails to load")
        if "speculative_config" in options and os.environ.get("FAKE_VLLM_NO_SPECULATION"):
            raise NotImplementedError("fake vLLM: speculative decoding is not supported on this backend")
        self.calls = 0

    def reset_prefix_cache(self):
        return True

    def generate(self, prompts, sampling_params, use_tqdm=True):
        print("FAKE VLLM LOG LINE")  # vLLM logs to stdout; the benchmark must keep it off its own
        self.calls += 1
        if self.calls == _FAIL_AT:
            os._exit(3)
        if self.calls == _HANG_AT:
            # As vLLM does, an engine in a child process; then the hang.
            import subprocess, sys, threading

            child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
            with open(os.environ["FAKE_VLLM_CHILD_PID_FILE"], "w") as f:
                f.write(str(child.pid))
            threading.Event().wait()
        assert len(prompts) == len(sampling_params)
        assert all(isinstance(p["prompt_token_ids"], list) for p in prompts)
        return [_RequestOutput([7] * p.max_tokens) for p in sampling_params]
"""


@pytest.fixture
def fake_vllm_python(tmp_path: Path) -> Path:
    """An "interpreter" whose ``import vllm`` finds a stand-in that generates instantly."""
    package = tmp_path / "fake-site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    (package / "inputs.py").write_text("def TokensPrompt(**fields):\n    return dict(fields)\n")
    python = tmp_path / "vllm-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{package.parent}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return python


def test_vllm_peer_runs_in_its_interpreter(
    tiny_llama: Path,
    fake_vllm_python: Path,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No tcmalloc or Intel OpenMP found: the run goes on, and the notes say it is below vLLM's best setting.
    monkeypatch.setattr(common, "_preload_libraries", lambda python: [])
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    argv = ["--model", str(tiny_llama), "--peers", "none", "--vllm-python", str(fake_vllm_python)]
    out_json = tmp_path / "throughput.json"
    assert load("throughput").main([*argv, "--quick", "--json", str(out_json), *SMALL_KV]) == 0
    out, err = capfd.readouterr()
    result = json.loads(out_json.read_text())
    assert "FAKE VLLM LOG LINE" in err and "FAKE VLLM LOG LINE" not in out
    assert "| vLLM CPU " in out and "vLLM ran with LD_PRELOAD=(nothing found)" in out
    assert "NOT preloaded (not found): tcmalloc and Intel OpenMP, below vLLM's best setting" in out
    assert "repeats interleaved: 1 round, each running asyncllm, vLLM CPU once in that order" in out
    assert result["machine"]["vllm"] == "0.0.0+fake"
    assert result["results"]["vllm"]["runs"][0]["output_tokens"] == result["workload"]["output_tokens"]
    assert positive(result["ratios"]["vllm"])


@pytest.mark.parametrize("name", ["throughput", "latency"])
def test_repeats_are_interleaved_with_vllm(
    name: str,
    tiny_llama: Path,
    fake_vllm_python: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Round r is asyncllm's repeat r, then vLLM's (from the worker started once), then the HF peer's.
    module = load(name)
    order: list[str] = []
    asyncllm_run, vllm_run = module.run_asyncllm, common.VLLMWorker.run
    hf_owner, hf_name = (common, "run_hf_static") if name == "throughput" else (module, "run_hf_generate")
    hf_run = getattr(hf_owner, hf_name)

    async def asyncllm(*args: Any) -> Any:
        order.append("asyncllm")
        return await asyncllm_run(*args)

    def vllm(self: Any, label: str) -> Any:
        order.append("vllm")
        assert self.version == "0.0.0+fake"  # loaded before the first round
        return vllm_run(self, label)

    def hf(*args: Any) -> Any:
        order.append("hf-static")
        return hf_run(*args)

    monkeypatch.setattr(module, "run_asyncllm", asyncllm)
    monkeypatch.setattr(common.VLLMWorker, "run", vllm)
    monkeypatch.setattr(hf_owner, hf_name, hf)
    out_json = tmp_path / f"{name}.json"
    argv = ["--model", str(tiny_llama), "--peers", "hf-static", "--vllm-python", str(fake_vllm_python)]
    assert module.main([*argv, "--quick", "--repeats", "2", "--json", str(out_json), *SMALL_KV]) == 0
    out = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    assert order == ["asyncllm", "vllm", "hf-static"] * 2
    assert all(len(result["results"][s]["runs"]) == 2 for s in ("asyncllm", "vllm", "hf-static"))
    assert set(result["ratios"]) == {"hf-static", "vllm"}
    label = "HF generate()" if name == "latency" else "HF generate() static batches"
    assert f"repeats interleaved: 2 rounds, each running asyncllm, vLLM CPU, {label} once in that order" in out
    # Each round's ratio from its own neighbours, listed with their median.
    key = "per_round_itl_ratios" if name == "latency" else "per_round_ratios"
    assert len(result["results"]["vllm"][key]) == 2
    what = "ITL peer / asyncllm" if name == "latency" else "asyncllm / peer"
    assert f"{what} per round, vLLM CPU: " in out


def test_vllm_worker_answers_one_repeat_at_a_time(fake_vllm_python: Path) -> None:
    workload = common.make_workload(3, (4, 8), (2, 5), 100, seed=0)
    with common.VLLMWorker(str(fake_vllm_python), "latency", Path("m"), workload, "float32", {}) as worker:
        assert worker.version == "0.0.0+fake" and worker.skipped is None
        first, second = worker.run("r1"), worker.run("r2")
        assert first is not None and second is not None
        assert first["output_tokens"] == workload[0].output_len and positive(first["ttft"])
    assert worker._process.returncode == 0  # it ended at the end of its stdin
    result = worker.result()
    assert result.runs == [first, second] and result.skipped is None and result.version == "0.0.0+fake"


@pytest.mark.parametrize(("fail_at", "during"), [(0, "while loading the model"), (3, "in r2")])
def test_vllm_worker_failure_is_a_skip(
    fail_at: int, during: str, fake_vllm_python: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Generate call 1 is the warm-up, 2 the first repeat, 3 the second: the worker dies there.
    monkeypatch.setenv("FAKE_VLLM_FAIL_AT", str(fail_at))
    workload = common.make_workload(2, (4, 8), (2, 5), 100, seed=0)
    with common.VLLMWorker(str(fake_vllm_python), "throughput", Path("m"), workload, "float32", {}) as worker:
        runs = [worker.run(f"r{i}") for i in (1, 2, 3)]
    assert runs[1:] == [None, None] and (runs[0] is None) == (fail_at == 0)
    result = worker.result()
    assert result.runs == [] and result.skipped is not None
    assert during in result.skipped and "exit status" in result.skipped
    assert worker._process.returncode != 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_hung_vllm_worker_is_killed_and_skipped(
    fake_vllm_python: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FAKE_VLLM_HANG_AT", "2")  # the first timed repeat never returns
    child_pid_file = tmp_path / "engine.pid"
    monkeypatch.setenv("FAKE_VLLM_CHILD_PID_FILE", str(child_pid_file))
    workload = common.make_workload(2, (4, 8), (2, 5), 100, seed=0)
    worker = common.VLLMWorker(str(fake_vllm_python), "throughput", Path("m"), workload, "float32", {}, reply_timeout=8)
    with worker:
        assert worker.skipped is None  # loading and the warm-up answered in time
        assert worker.run("r1") is None and worker.run("r2") is None
    assert worker.skipped is not None and "in r1 (no reply within 8s)" in worker.skipped
    assert worker._process.returncode == -signal.SIGKILL
    # The "engine" child went with it (its whole process group was killed); SIGKILL is delivered
    # asynchronously, so wait for it to end, with a bound.
    engine = int(child_pid_file.read_text())
    deadline = time.monotonic() + 30
    while _alive(engine) and time.monotonic() < deadline:
        os.sched_yield()
    assert not _alive(engine)


def test_vllm_peer_is_skipped_when_absent(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-python"
    argv = ["--model", str(tiny_llama), "--peers", "none", "--vllm-python", str(missing)]
    out, result = run("latency", argv, tmp_path, capsys)
    assert "vLLM skipped" in out and "does not exist" in out
    assert set(result["results"]) == {"asyncllm"} and result["ratios"] == {}


# -- common.py helpers ---------------------------------------------------------------------------

common = load("throughput").common  # the very module the scripts use


def test_workload_is_seeded_and_in_range() -> None:
    first = common.make_workload(64, (32, 512), (16, 256), 32000, seed=0)
    assert first == common.make_workload(64, (32, 512), (16, 256), 32000, seed=0)
    assert first != common.make_workload(64, (32, 512), (16, 256), 32000, seed=1)
    assert all(32 <= len(r.prompt_ids) <= 512 and 16 <= r.output_len <= 256 for r in first)
    assert all(3 <= t < 32000 for r in first for t in r.prompt_ids)


def test_poisson_arrivals_are_seeded_and_increasing() -> None:
    times = common.poisson_arrivals(200, rate=4.0, seed=0)
    assert times == common.poisson_arrivals(200, rate=4.0, seed=0)
    assert times[0] == 0 and all(a < b for a, b in itertools.pairwise(times))
    assert 20 < times[-1] < 80  # about 200 / 4 = 50 s


def test_percentile_and_ratio() -> None:
    assert common.percentile([3, 1, 2], 50) == 2
    assert common.percentile([0, 10], 90) == 9
    assert math.isnan(common.percentile([], 50))
    assert common.ratio(6.0, 3.0) == 2.0 and common.ratio(1.0, 0.0) is None


def test_per_round_ratios_pair_each_round_with_its_neighbour() -> None:
    ours = [{"t": 10.0}, {"t": 12.0}, {"t": None}, {"t": 9.0}]
    theirs = [{"t": 5.0}, {"t": 4.0}, {"t": 3.0}, {"t": 3.0}]
    assert common.per_round_ratios(ours, theirs, "t") == [2.0, 3.0, 3.0]  # the round without a value is skipped
    assert common.per_round_ratios(ours, theirs, "t", ours_first=False) == [0.5, 1 / 3, 1 / 3]
    assert common.per_round_note("vLLM CPU", "asyncllm / peer", [2.0, 3.0, 3.0]) == (
        "asyncllm / peer per round, vLLM CPU: 2.00, 3.00, 3.00 (median 3.00)"
    )
    assert "no complete round" in common.per_round_note("vLLM CPU", "asyncllm / peer", [])


def test_static_batches_group_by_output_length() -> None:
    workload = common.make_workload(10, (4, 8), (1, 50), 100, seed=3)
    batches = common.static_batches(workload, 4, sort=True)
    assert sorted(i for b in batches for i in b) == list(range(10)) and [len(b) for b in batches] == [4, 4, 2]
    lengths = [workload[i].output_len for b in batches for i in b]
    assert lengths == sorted(lengths, reverse=True)
    assert common.static_batches(workload, 4, sort=False)[0] == [0, 1, 2, 3]


def test_format_table_and_key_values() -> None:
    table = common.format_table(["system", "tok/s"], [["a", 1234.5], ["b", None]])
    header, rule, first, second = table.splitlines()
    assert header.split("|")[1].strip() == "system" and set(rule) == {"|", "-"}
    assert first.split("|")[2].strip() == "1234" and second.split("|")[2].strip() == "-"
    assert common.parse_key_values(["a=1", "b=x", "c=[1, 2]"]) == {"a": 1, "b": "x", "c": [1, 2]}


def test_synthetic_model_is_the_one_issue_7_asks_for() -> None:
    assert common.SYNTHETIC_FAMILY == "llama"
    assert {k: v for k, v in common.SYNTHETIC_MODEL.items() if k != "seed"} == {
        "hidden_size": 512,
        "num_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 4,
        "intermediate_size": 1536,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    }


TINY_CONFIG = {
    "hidden_size": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "intermediate_size": 8,
    "vocab_size": 10,
}


def test_model_cost_counts_the_benchmark_models_weights_and_kv() -> None:
    cost = common.ModelCost.from_config(
        {
            "hidden_size": 512,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "num_hidden_layers": 8,
            "intermediate_size": 1536,
            "vocab_size": 32000,
        }
    )
    # Per layer: q and o 512 x 512 each, k and v 512 x 256 each, gate/up/down 512 x 1536 each.
    assert cost.layer_weights == 8 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1536) == 25_165_824
    assert cost.head_weights == 32000 * 512
    assert cost.weight_bytes == 4 * (25_165_824 + 16_384_000)  # the 166 MB a decode step streams
    assert cost.attention_flops_per_pair == 4 * 8 * 64 * 8
    assert cost.kv_bytes_per_token == 2 * 4 * 64 * 8 * 4


def test_workload_roofline_by_hand() -> None:
    cost = common.ModelCost.from_config(TINY_CONFIG)
    # Weights: q, o 4 x 4; k, v 4 x 2; gate, up, down 4 x 8: 144; the head 10 x 4: 40.
    assert (cost.layer_weights, cost.head_weights, cost.attention_flops_per_pair) == (144, 40, 16)
    assert cost.kv_bytes_per_token == 16 and cost.weight_bytes == 736
    workload = [common.RequestSpec((5, 6), 3), common.RequestSpec((7,), 1)]
    peaks = common.MachinePeaks(flops=1e9, bandwidth=2e9)
    bound = common.workload_roofline(cost, workload, peaks)
    # Prefill: 2 FLOPs per weight per token, 16 per causal pair (3 and 1 pairs), the head once each.
    prefill_flops = (2 * 2 * 144 + 16 * 3 + 2 * 40) + (2 * 1 * 144 + 16 * 1 + 2 * 40)
    assert bound.prefill == pytest.approx(prefill_flops / 1e9)
    # Two decode steps, only the first request running, contexts 3 and 4: memory decides both
    # (weights 736 bytes + 16 per cached token, at 2e9 B/s, against 368 + 16 * context FLOPs at 1e9).
    step_flops = [2 * 184 + 16 * 3, 2 * 184 + 16 * 4]
    assert bound.decode_steps == 2
    assert bound.decode == pytest.approx(
        max(step_flops[0] / 1e9, (736 + 48) / 2e9) + max(step_flops[1] / 1e9, (736 + 64) / 2e9)
    )
    assert bound.compute_only == pytest.approx((prefill_flops + sum(step_flops)) / 1e9)
    assert bound.total == pytest.approx(bound.prefill + bound.decode)
    assert bound.fraction(2 * bound.total) == pytest.approx(0.5)
    ttft, itl = common.latency_roofline(cost, 2, 3, peaks)
    assert ttft == pytest.approx((2 * 2 * 144 + 16 * 3 + 2 * 40) / 1e9) and itl == pytest.approx(bound.decode / 2)


def test_measure_machine_reports_positive_rates() -> None:
    peaks = common.measure_machine(repeats=1, bandwidth_bytes=1 << 22)
    assert positive(peaks.flops) and positive(peaks.bandwidth)
    assert "GFLOPS" in peaks.describe() and "GB/s" in peaks.describe()


def test_roofline_script(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "roofline.json"
    argv = ["--model", str(tiny_llama), "--num-requests", "4", "--prompt-len", "4", "8", "--output-len", "2", "5"]
    assert load("roofline").main([*argv, "--json", str(out_json)]) == 0
    out, result = capsys.readouterr().out, json.loads(out_json.read_text())
    assert "roofline:" in out and "output tokens/s" in out
    assert positive(result["roofline"]["total"]) and result["roofline"]["decode_steps"] <= 4
    assert result["roofline"]["compute_only"] <= result["roofline"]["total"] + 1e-12


# -- amx_gemm.py (the float32-from-bfloat16-parts experiment) -------------------------------------


def test_amx_gemm_experiment_is_float32_accurate_or_says_it_cannot_run(capsys):
    amx_gemm = load("amx_gemm")
    library = amx_gemm._library()
    if library is None:
        assert amx_gemm.main(["--rows", "3", "--pairs", "1", "--probes", "1"]) == 2
        return
    generator = torch.Generator().manual_seed(1)
    # A partial column block, a partial input slice and a partial row block; a wide range of magnitudes.
    weight = torch.randn(100, 37, generator=generator) * torch.logspace(-6, 6, 37)
    matmul = amx_gemm.AmxMatmul(library, weight)
    for rows in (1, 33, 300):
        x = torch.randn(rows, 37, generator=generator)
        result = matmul(x)
        exact = x.double() @ weight.double().T
        scale = x.double().abs() @ weight.double().abs().T
        assert ((result.double() - exact).abs() <= 2.0**-20 * scale).all()
        # Not the bfloat16 product: its error is about 2**-8 of the scale.
        bf16 = (x.bfloat16().float() @ weight.bfloat16().float().T).double()
        assert ((bf16 - exact).abs() > 2.0**-12 * scale).any()
    assert amx_gemm.main(["--rows", "40", "--pairs", "1", "--probes", "1"]) == 0
    assert "largest error" in capsys.readouterr().out


# -- grammar_engines.py (llguidance against xgrammar on the JSONSchemaBench sample) ----------------


def test_grammar_engines_llguidance_alone(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # xgrammar is an optional peer: made unimportable here, it is skipped with a message.
    pytest.importorskip("llguidance")
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    out_json = tmp_path / "grammar.json"
    argv = ["--tokenizer", str(tiny_llama), "--datasets", "Github_easy,Glaiveai2K", "--limit", "2"]
    argv += ["--batch", "4", "--batch-steps", "2", "--max-tokens", "64", "--json", str(out_json)]
    assert load("grammar_engines").main(argv) == 0
    out, result = capsys.readouterr().out, json.loads(out_json.read_text())
    assert "xgrammar is not importable" in out and "skipped" in out
    assert "## coverage (compiles and the output validates) (%)" in out and "| overall " in out
    assert "| dataset     | llg |\n" in out  # one engine: no xgrammar column, no ratio
    assert set(result["summaries"]) == {"Github_easy", "Glaiveai2K", "overall"}
    overall = result["summaries"]["overall"]["llguidance"]
    assert overall["schemas"] == 4 and overall["compile_rate"] == 1.0
    assert overall["valid"] + overall["invalid"] + overall["unknown"] + overall["no_output"] == 4
    assert positive(overall["compile_ms_p50"]) and positive(overall["mask_b1_us_p50"])
    assert positive(overall["step_b64_ms_p50"])
    assert [s["id"] for s in result["schemas"]["Github_easy"]] == [
        json.loads(line)["id"]
        for line in (BENCHMARKS / "data" / "jsonschemabench" / "Github_easy.jsonl").read_text().splitlines()[:2]
    ]


def test_grammar_engines_walk_prefers_eos_then_closers() -> None:
    module = load("grammar_engines")

    class Tokens:
        def __len__(self) -> int:
            return 64

        def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
            return ['"' if i == 40 else "a" for i in ids]

    walker = module.Walker(Tokens(), 64, eos=2)
    row = torch.zeros(2, dtype=torch.int32)
    row[0] = 1 << 2 | 1 << 5  # EOS (2) and token 5
    row[1] = 1 << (40 - 32) | 1 << (41 - 32)
    import random

    assert walker.pick(row, random.Random(0)) == 2
    row[0] = 1 << 5
    picks = {walker.pick(row, random.Random(seed)) for seed in range(50)}
    assert picks == {5, 40, 41}
    row.zero_()
    assert walker.pick(row, random.Random(0)) is None


# -- structured_output.py (the grammar's cost, compile times, ITL while compiling, coverage) -------------


def test_structured_output_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(tiny_llama), "--per-dataset", "1", "--coverage-max-tokens", "8", "--no-roofline"]
    out, result = run("structured_output", argv, tmp_path, capsys)
    results = result["results"]
    throughput = results["throughput"]
    assert positive(throughput["unconstrained_tokens_per_s"]) and positive(throughput["ratio"])
    assert "## Throughput" in out and "| json schema " in out
    assert results["compile"]["schemas"] == 10 and positive(results["compile"]["cold_ms"]["median"])
    assert positive(results["itl"]["alone_ms"]["median"]) and positive(results["itl"]["compiling_ms"]["median"])
    for key in ("coverage", "coverage_lenient"):
        assert set(results[key]) == {p.stem for p in (BENCHMARKS / "data" / "jsonschemabench").glob("*.jsonl")}
        assert all(r["schemas"] == 1 for r in results[key].values())
    assert "## Coverage on the JSONSchemaBench sample, strict" in out and "0.41 (Guidance)" in out


def test_serving_http_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Real `asyncllm serve` processes (the thread governor, and fixed threads with a short spin) under the openai
    # client, alone and beside one spinning process.
    out_json = tmp_path / "serving_http.json"
    argv = ["--model", str(tiny_llama), "--quick", "--json", str(out_json), "--engine-opt", "kv_cache_blocks=64"]
    assert load("serving_http").main([*argv, "--engine-opt", "device=cpu"]) == 0
    out, result = capsys.readouterr().out, json.loads(out_json.read_text())
    assert "| asyncllm-spin " in out and "asyncllm against each peer" in out
    runs = result["runs"]
    assert {(r["system"], r["background"]) for r in runs} == {
        (system, background) for system in ("asyncllm", "asyncllm-spin") for background in (0, 1)
    }
    for run_ in runs:
        assert run_["requests"] == 2 and run_["tokens"] == 2 * 4  # every request ran to max_tokens
        assert positive(run_["tok_s"]) and positive(run_["ttft_p50"]) and positive(run_["itl_p50"])


def test_serving_http_quick_through_httpx(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The same load read as raw SSE lines with httpx: every request's tokens counted from its usage chunk, and
    # stamps from its content chunks.
    out_json = tmp_path / "serving_http.json"
    argv = ["--model", str(tiny_llama), "--quick", "--json", str(out_json), "--engine-opt", "kv_cache_blocks=64"]
    argv += ["--engine-opt", "device=cpu", "--client", "httpx", "--systems", "asyncllm"]
    assert load("serving_http").main(argv) == 0
    out, result = capsys.readouterr().out, json.loads(out_json.read_text())
    assert "through httpx" in out
    assert [r["background"] for r in result["runs"]] == [0, 1]
    for run_ in result["runs"]:
        assert run_["requests"] == 2 and run_["tokens"] == 2 * 4
        assert positive(run_["tok_s"]) and positive(run_["ttft_p50"]) and positive(run_["itl_p50"])


# -- tensor_parallel.py (2 ranks against 1) -------------------------------------------------------------


def test_tensor_parallel_quick(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One engine of each size (the 2-rank one starts a real rank process), the same workload.
    out, result = run("tensor_parallel", ["--model", str(tiny_llama), "--engine-opt", "attention_backend=torch"],
                      tmp_path, capsys)  # fmt: skip
    assert "| 1 " in out and "| 2 " in out and "comm share" in out
    assert result["token_mismatches"] == {"1": 0, "2": 0}
    one, two = result["results"]["1"], result["results"]["2"]
    assert positive(one["tokens_per_s"]) and positive(two["tokens_per_s"]) and positive(result["ratios"]["2"])
    for key in ("collective_ms", "broadcast_send_us", "broadcast_latency_us", "comm_share"):
        assert positive(two[key]) and key not in one
    assert two["collectives_per_step"] >= 2 * 2 + 1  # two all-reduces per layer and the embedding's, at least


# -- speculative.py (n-gram drafts against plain decoding) ---------------------------------------------


def test_speculative_quick(
    tiny_llama: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    fake_vllm_python: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM as a peer: a stand-in that runs plain decoding and refuses speculative_config, as a vLLM whose
    # CPU backend lacks n-gram speculation would.
    monkeypatch.setenv("FAKE_VLLM_NO_SPECULATION", "1")
    argv = ["--model", str(tiny_llama), "--draft-model", "--draft-layers", "1", "--vllm-python", str(fake_vllm_python)]
    out, result = run("speculative", argv, tmp_path, capsys)
    rows = ("| repetitive ", "| free ", "| sampled ", "| batch 4 ", " n-gram |", " draft (1 layers) |", " self-draft |")
    for row in rows:
        assert row in out
    for system in ("draft", "self_draft"):
        assert all(len(result["results"][w][system]) == 2 for w in ("repetitive", "free", "sampled"))
        counters = result["draft_counters"][system]
        assert counters["draft_tokens"] >= counters["accepted_tokens"] > 0
    assert result["draft_counters"]["self_draft"]["acceptance_rate"] > 0.9
    assert "decode tokens/s n-gram / plain per round" in out and "noisy" in out
    for workload in ("repetitive", "free", "sampled"):
        assert workload == "sampled" or f"{workload}: greedy outputs identical" in out
        for system in ("plain", "ngram"):
            runs = result["results"][workload][system]
            assert len(runs) == 2 and all(r["output_tokens"] == 12 for r in runs)
            assert workload == "sampled" or all(r["same_tokens"] for r in runs)
            assert all(positive(r["tokens_per_s"]) and positive(r["decode_tokens_per_s"]) for r in runs)
        assert all(positive(result["ratios"][workload][key]) for key in ("decode_tokens_per_s", "tokens_per_s", "itl"))
    for system in ("plain", "ngram"):
        assert [r["output_tokens"] for r in result["results"]["batch"][system]] == [4 * 6]
    assert positive(result["ratios"]["batch"]["tokens_per_s"])
    assert result["counters"]["draft_tokens"] >= result["counters"]["accepted_tokens"] > 0
    workers = result["vllm"]["workers"]
    assert workers["plain"]["version"] == "0.0.0+fake" and workers["plain"]["skipped"] is None
    assert "NotImplementedError: fake vLLM: speculative decoding is not supported" in workers["ngram"]["skipped"]
    assert "vLLM n-gram speculation: not run: the vLLM worker failed while loading the model" in out
    assert "speculative_config" in workers["ngram"]["skipped"]
    for workload in ("repetitive", "free"):
        plain = result["vllm"]["results"][workload]["plain"]
        assert len(plain) == 2 and all(r["output_tokens"] == 12 and positive(r["tokens_per_s"]) for r in plain)
        assert result["vllm"]["results"][workload]["ngram"] == []
        assert f"decode tokens/s asyncllm plain / vLLM per round, {workload}" in out
    assert "ratio asyncllm / vLLM" in out and "plain / plain" in out and "n-gram / n-gram" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the check runs for real (minutes), not as a smoke test")
def test_gpu_check_flow_without_a_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Without CUDA every device step is recorded as skipped, and the report is still written whole.
    assert load("gpu_check").main(["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["cuda"] is False and (tmp_path / "gpu_check.log").exists()
    assert list(report["steps"]) == [
        "nvidia-smi",
        "kernel tests, compiled",
        "compute-sanitizer memcheck, attention",
        "CUDA graphs",
        "engine parity, bfloat16",
        "benchmarks/gpu.py --quick",
        "benchmarks/moe.py --fused",
    ]
    assert all(step["status"].startswith("skipped") for name, step in report["steps"].items() if name != "nvidia-smi")
    assert report["triton_variants_compiled"] == 0
    assert "engine parity, bfloat16: skipped: no CUDA device" in capsys.readouterr().out
