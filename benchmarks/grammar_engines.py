"""Grammar engines for structured output: llguidance against xgrammar on the JSONSchemaBench sample.

    python benchmarks/grammar_engines.py                      # every dataset, both engines
    python benchmarks/grammar_engines.py --limit 10 --engines llguidance

Both engines get the same schemas (``benchmarks/data/jsonschemabench/*.jsonl``), the same tokenizer
(the default SmolLM2-135M's, vocabulary 49,152, unless ``--tokenizer``) and the same JSON layout
(no free whitespace, separators ", " and ": "). Per schema, the engines take turns going first.

- Compile: schema to a matcher ready for its first mask, cold (a fresh xgrammar compiler without
  cache per schema; llguidance has no grammar cache). "first mask" adds the first mask computation
  (llguidance builds its lexer lazily, xgrammar precomputes its token-mask cache while compiling).
- Mask time at batch 1: each compiled schema's matcher walks one generation; every step's mask fill
  is timed. At batch 64: 64 matchers of the schema fill one [64, vocab/32] bitmask per step through
  each library's parallel API (``llguidance.torch.fill_next_token_bitmask_par`` with an
  ``LLExecutor``; ``xgrammar.BatchGrammarMatcher``), for ``--batch-steps`` steps; a walk that ends is
  restarted in its row, so the batch stays full.
- Generation without a model: a seeded random walk under the mask. EOS whenever it is allowed; else,
  with probability 1/2, a uniform pick among the allowed tokens that contain ``"``, ``}`` or ``]``
  (they close strings, objects and arrays); else a uniform pick among all allowed tokens. A walk that
  reaches ``--max-tokens`` without EOS has no output.
- Coverage: the schema compiles and the walk's output parses and validates with ``jsonschema`` (the
  draft the schema declares, 2020-12 by default, formats checked). When ``jsonschema`` cannot process
  the schema itself (an invalid schema, a reference it cannot resolve) the result is "unknown",
  counted apart and not as covered.

llguidance runs strict, its default: a keyword it does not implement, or ``oneOf``, fails the
compile. ``--lenient`` makes it ignore such keywords and read ``oneOf`` as ``anyOf``, which is what
xgrammar does unasked. Ratios are oriented so that > 1 means llguidance is better: rates llguidance / xgrammar, times
xgrammar / llguidance. xgrammar is optional: without it, llguidance runs alone.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncllm.testing import import_path

common = import_path(Path(__file__).with_name("common.py"), "asyncllm_benchmarks_common")

DATA = Path(__file__).resolve().parent / "data" / "jsonschemabench"
ENGINES = ("llguidance", "xgrammar")
LABELS = {"llguidance": "llg", "xgrammar": "xgr"}
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "
CLOSERS = ('"', "}", "]")
CLOSE_PROBABILITY = 0.5

#: Coverage per dataset reported by the JSONSchemaBench paper (arXiv 2501.10868), best engine first;
#: only the figures quoted in the issue.
PAPER_COVERAGE: dict[str, str] = {
    "Github_hard": "Guidance 41%, llama.cpp 39%, XGrammar 28%, Outlines 3%",
}


# ------------------------------------------------------------------------------------------------
# Engines: the same five operations over each library
# ------------------------------------------------------------------------------------------------


class CompileError(Exception):
    """The engine refused the schema."""


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab: int, threads: int, lenient: bool = False) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._llg = llguidance
        self._torch = llguidance.torch
        self.version = importlib.metadata.version("llguidance")
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.vocab = vocab
        # Strict by default: a keyword it does not implement, or oneOf, is an error. Lenient ignores
        # the keywords and reads oneOf as anyOf, as xgrammar does without being asked.
        self.options = {"lenient": True, "coerce_one_of": True} if lenient else {}

    def compile(self, schema: Any) -> Any:
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(
                json.dumps(schema),
                defaults={
                    "whitespace_flexible": False,
                    "item_separator": ITEM_SEPARATOR,
                    "key_separator": KEY_SEPARATOR,
                    **self.options,
                },
            )
        except Exception as exc:  # the library raises ValueError and RuntimeError alike
            raise CompileError(str(exc)) from exc
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise CompileError(matcher.get_error())
        return [grammar, matcher]

    def matcher(self, compiled: Any) -> Any:
        grammar, first = compiled
        if first is not None:  # the one compile() built; the others are new, from the grammar
            compiled[1] = None
            return first
        return self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self._torch.allocate_token_bitmask(batch, self.vocab)

    def fill_one(self, matcher: Any, bitmask: torch.Tensor) -> None:
        self._torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def fill_batch(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        self._torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def reset(self, matcher: Any) -> None:
        matcher.reset()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab: int, threads: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self.version = importlib.metadata.version("xgrammar")
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.threads = threads
        self.vocab = vocab

    def compile(self, schema: Any) -> Any:
        # A fresh compiler without cache: every schema pays its full, cold compile.
        compiler = self._xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        try:
            compiled = compiler.compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(ITEM_SEPARATOR, KEY_SEPARATOR)
            )
        except Exception as exc:  # RuntimeError, InvalidJSONError, ...
            raise CompileError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from exc
        return [compiled, self._xgr.GrammarMatcher(compiled)]

    def matcher(self, compiled: Any) -> Any:
        grammar, first = compiled
        if first is not None:
            compiled[1] = None
            return first
        return self._xgr.GrammarMatcher(grammar)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(batch, self.vocab)

    def fill_one(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def fill_batch(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(list(matchers), bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def reset(self, matcher: Any) -> None:
        matcher.reset()


# ------------------------------------------------------------------------------------------------
# The random walk
# ------------------------------------------------------------------------------------------------


class Walker:
    """Picks the next token from a bitmask row (see the module's docstring for the policy)."""

    def __init__(self, hf_tokenizer: Any, vocab: int, eos: int) -> None:
        self.vocab, self.eos = vocab, eos
        texts = hf_tokenizer.convert_ids_to_tokens(list(range(min(vocab, len(hf_tokenizer)))))
        closer = np.zeros(-(-vocab // 32) * 32, dtype=bool)
        for token_id, text in enumerate(texts):
            if text is not None and any(c in text for c in CLOSERS):
                closer[token_id] = True
        # Packed like the bitmask (bit i of int32 word w is token 32 w + i, little-endian bytes).
        self._closer_bytes = np.packbits(closer, bitorder="little")

    def pick(self, row: torch.Tensor, rng: random.Random) -> int | None:
        words = row.numpy()
        if (int(words[self.eos >> 5]) >> (self.eos & 31)) & 1:
            return self.eos
        packed = words.view(np.uint8)
        if rng.random() < CLOSE_PROBABILITY:
            closers = np.flatnonzero(np.unpackbits(packed & self._closer_bytes, bitorder="little")[: self.vocab])
            if len(closers):
                return int(closers[rng.randrange(len(closers))])
        ids = np.flatnonzero(np.unpackbits(packed, bitorder="little")[: self.vocab])
        return int(ids[rng.randrange(len(ids))]) if len(ids) else None


@dataclass
class Walk:
    tokens: list[int] = field(default_factory=list)
    mask_seconds: list[float] = field(default_factory=list)
    ended: str = ""  # "eos", "cap", "dead end", "rejected"


def walk_one(engine: Any, matcher: Any, walker: Walker, seed: int, cap: int) -> Walk:
    """One generation of at most ``cap`` tokens, each step's mask fill timed."""
    rng = random.Random(seed)
    bitmask = engine.bitmask(1)
    walk = Walk()
    while len(walk.tokens) < cap:
        start = time.perf_counter()
        engine.fill_one(matcher, bitmask)
        walk.mask_seconds.append(time.perf_counter() - start)
        token = walker.pick(bitmask[0], rng)
        if token is None:
            walk.ended = "dead end"
            return walk
        if not engine.accept(matcher, token):
            walk.ended = "rejected"
            return walk
        if token == walker.eos:
            walk.ended = "eos"
            return walk
        walk.tokens.append(token)
    walk.ended = "cap"
    return walk


def batch_step_seconds(
    engine: Any, compiled: Any, walker: Walker, batch: int, steps: int, seed: int, cap: int
) -> list[float]:
    """Per-step seconds of one batched mask fill over ``batch`` matchers of the schema."""
    matchers = [engine.matcher(compiled) for _ in range(batch)]
    rngs = [random.Random(seed * 1_000 + i) for i in range(batch)]
    lengths = [0] * batch
    bitmask = engine.bitmask(batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.fill_batch(matchers, bitmask)
        times.append(time.perf_counter() - start)
        for i, matcher in enumerate(matchers):
            token = walker.pick(bitmask[i], rngs[i])
            ok = token is not None and engine.accept(matcher, token)
            lengths[i] += 1
            if not ok or token == walker.eos or lengths[i] >= cap:
                engine.reset(matcher)  # a new walk in this row keeps the batch full
                lengths[i] = 0
    return times


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def validate(schema: Any, text: str) -> str:
    """``"valid"``, ``"invalid"`` (not JSON, or fails the schema) or ``"unknown"`` (jsonschema
    cannot process the schema)."""
    import jsonschema

    try:
        instance = json.loads(text)
    except ValueError:
        return "invalid"
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        return "valid" if validator.is_valid(instance) else "invalid"
    except Exception:  # SchemaError, an unresolvable $ref, a pattern Python's re rejects, ...
        return "unknown"


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


@dataclass
class EngineStats:
    schemas: int = 0
    compiled: int = 0
    compile_s: list[float] = field(default_factory=list)
    first_mask_s: list[float] = field(default_factory=list)
    mask_b1_s: list[float] = field(default_factory=list)
    step_b64_s: list[float] = field(default_factory=list)
    valid: int = 0
    invalid: int = 0
    unknown: int = 0
    no_output: int = 0
    errors: dict[str, str] = field(default_factory=dict)

    def add(self, other: EngineStats) -> None:
        self.schemas += other.schemas
        self.compiled += other.compiled
        for name in ("compile_s", "first_mask_s", "mask_b1_s", "step_b64_s"):
            getattr(self, name).extend(getattr(other, name))
        self.valid += other.valid
        self.invalid += other.invalid
        self.unknown += other.unknown
        self.no_output += other.no_output

    def summary(self) -> dict[str, Any]:
        n = max(self.schemas, 1)
        ms = 1e3
        return {
            "schemas": self.schemas,
            "compile_rate": self.compiled / n,
            "compile_ms_p50": common.median(self.compile_s) * ms,
            "compile_ms_p90": common.percentile(self.compile_s, 90) * ms,
            "first_mask_ms_p50": common.median(self.first_mask_s) * ms,
            "mask_b1_us_p50": common.median(self.mask_b1_s) * 1e6,
            "mask_b1_us_p90": common.percentile(self.mask_b1_s, 90) * 1e6,
            "mask_b1_us_mean": (sum(self.mask_b1_s) / len(self.mask_b1_s) * 1e6) if self.mask_b1_s else math.nan,
            "step_b64_ms_p50": common.median(self.step_b64_s) * ms,
            "step_b64_ms_p90": common.percentile(self.step_b64_s, 90) * ms,
            "coverage": self.valid / n,
            "valid": self.valid,
            "invalid": self.invalid,
            "unknown": self.unknown,
            "no_output": self.no_output,
        }


def load_dataset(name: str, limit: int | None) -> list[tuple[str, Any]]:
    path = DATA / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(row["id"], row["schema"]) for row in rows[:limit]]


def run_schema(
    engine: Any, schema: Any, walker: Walker, hf_tokenizer: Any, seed: int, args: argparse.Namespace
) -> EngineStats:
    stats = EngineStats(schemas=1)
    start = time.perf_counter()
    try:
        compiled = engine.compile(schema)
    except CompileError as exc:
        stats.errors["compile"] = str(exc)[:300]
        return stats
    compiled_at = time.perf_counter()
    matcher = engine.matcher(compiled)
    bitmask = engine.bitmask(1)
    engine.fill_one(matcher, bitmask)
    stats.first_mask_s.append(time.perf_counter() - start)
    stats.compile_s.append(compiled_at - start)
    stats.compiled = 1
    engine.reset(matcher)
    walk = walk_one(engine, matcher, walker, seed, args.max_tokens)
    stats.mask_b1_s.extend(walk.mask_seconds)
    if walk.ended != "eos":
        stats.no_output = 1
        stats.errors["walk"] = walk.ended
    else:
        outcome = validate(schema, hf_tokenizer.decode(walk.tokens))
        setattr(stats, outcome, 1)
    if args.batch > 1 and args.batch_steps > 0:
        stats.step_b64_s.extend(
            batch_step_seconds(engine, compiled, walker, args.batch, args.batch_steps, seed, args.max_tokens)
        )
    return stats


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    available = sorted(p.stem for p in DATA.glob("*.jsonl"))
    parser.add_argument("--datasets", default="all", help=f"comma-separated among {','.join(available)} (default all)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many schemas per dataset")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated among llguidance,xgrammar")
    parser.add_argument("--tokenizer", default=None, help="a model folder (default: the default SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=512, help="a walk's cap; reaching it is no output")
    parser.add_argument("--batch", type=int, default=64, help="matchers per batched mask fill (default 64)")
    parser.add_argument("--batch-steps", type=int, default=16, help="batched steps timed per schema (0: none)")
    parser.add_argument("--threads", type=int, default=None, help="threads of both engines (default: usable cores)")
    parser.add_argument(
        "--lenient",
        action="store_true",
        help="llguidance ignores keywords it does not implement and reads oneOf as anyOf (xgrammar's behaviour)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    args = parser.parse_args(argv)
    args.dataset_list = available if args.datasets == "all" else [d.strip() for d in args.datasets.split(",")]
    unknown = [d for d in args.dataset_list if d not in available]
    if unknown:
        parser.error(f"unknown datasets {unknown}; choose among {available}")
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not args.engine_list or any(e not in ENGINES for e in args.engine_list):
        parser.error(f"--engines: choose among {','.join(ENGINES)}")
    return args


def _ratio(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    if ours is None or theirs is None:
        return None
    return common.ratio(ours, theirs) if higher_is_better else common.ratio(theirs, ours)


def print_tables(summaries: dict[str, dict[str, dict[str, Any]]], engines: Sequence[str]) -> None:
    """One table per metric: a row per dataset and overall, a column per engine, and the ratio."""
    both = len(engines) == 2
    metrics = [
        ("coverage (compiles and the output validates)", "coverage", True, "%"),
        ("compiled", "compile_rate", True, "%"),
        ("compile ms, median (cold)", "compile_ms_p50", False, ""),
        ("compile ms, p90 (cold)", "compile_ms_p90", False, ""),
        ("compile + first mask ms, median", "first_mask_ms_p50", False, ""),
        ("mask us per token, batch 1, median", "mask_b1_us_p50", False, ""),
        ("mask us per token, batch 1, mean", "mask_b1_us_mean", False, ""),
        ("mask ms per step, batch 64, median", "step_b64_ms_p50", False, ""),
    ]
    for title, key, higher, unit in metrics:
        headers = ["dataset", *(LABELS[e] for e in engines)]
        if both:
            headers.append("llg/xgr" if higher else "xgr/llg")
        rows = []
        for dataset, per_engine in summaries.items():
            values = [per_engine[e][key] for e in engines]
            cells: list[Any] = [dataset]
            for value in values:
                cells.append(None if value is None or math.isnan(value) else (100 * value if unit == "%" else value))
            if both:
                cells.append(_ratio(values[0], values[1], higher))
            rows.append(cells)
        print(f"## {title}" + (" (%)" if unit == "%" else ""))
        print(common.format_table(headers, rows))
        print()
    headers = ["dataset", *(f"{LABELS[e]} valid/invalid/unknown/no output/not compiled" for e in engines)]
    rows = []
    for dataset, per_engine in summaries.items():
        cells = [dataset]
        for e in engines:
            s = per_engine[e]
            cells.append(
                f"{s['valid']}/{s['invalid']}/{s['unknown']}/{s['no_output']}/"
                f"{s['schemas'] - round(s['compile_rate'] * s['schemas'])}"
            )
        rows.append(cells)
    print("## outcomes per schema")
    print(common.format_table(headers, rows))
    print()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import os

    import transformers

    threads = args.threads or len(os.sched_getaffinity(0))
    if args.tokenizer is None:
        from asyncllm.default_model import default_model_path

        tokenizer_path = default_model_path(progress=common.log)
    else:
        tokenizer_path = Path(args.tokenizer)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_path)
    vocab = common.vocab_size(tokenizer_path)
    if hf_tokenizer.eos_token_id is None:
        raise SystemExit(f"the tokenizer of {tokenizer_path} has no EOS token")
    walker = Walker(hf_tokenizer, vocab, hf_tokenizer.eos_token_id)

    engines: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in args.engine_list:
        try:
            engines[name] = (
                Llguidance(hf_tokenizer, vocab, threads, args.lenient)
                if name == "llguidance"
                else Xgrammar(hf_tokenizer, vocab, threads)
            )
        except ImportError as exc:
            skipped[name] = f"{name} is not importable ({exc}); skipped"
            common.log(skipped[name])
    if not engines:
        print("no engine to run: " + "; ".join(skipped.values()))
        return 1
    names = list(engines)

    info = common.machine_info()
    info.update({f"{n}_version": e.version for n, e in engines.items()})
    datasets = {d: load_dataset(d, args.limit) for d in args.dataset_list}
    common.print_header(
        "grammar_engines: llguidance against xgrammar on JSONSchemaBench",
        info,
        [
            "engines: "
            + ", ".join(f"{n} {e.version}" for n, e in engines.items())
            + "".join(f" ({s})" for s in skipped.values()),
            f"tokenizer: {tokenizer_path.name}, vocab {vocab}, EOS {walker.eos}; {threads} engine threads",
            f"schemas: {sum(len(v) for v in datasets.values())} from {len(datasets)} datasets "
            f"({DATA.relative_to(DATA.parents[2])}), limit {args.limit or 'none'}",
            f"walk: seeded, EOS when allowed, closers with p={CLOSE_PROBABILITY}, cap {args.max_tokens} tokens; "
            f"batch {args.batch}: {args.batch_steps} steps per schema",
            "JSON: no free whitespace, separators ', ' and ': '; llguidance "
            + ("lenient (unimplemented keywords ignored, oneOf as anyOf)" if args.lenient else "strict (its default)")
            + "; ratios > 1 mean llguidance is better",
        ],
    )

    summaries: dict[str, dict[str, dict[str, Any]]] = {}
    details: dict[str, list[dict[str, Any]]] = {}
    overall = {n: EngineStats() for n in names}
    for dataset, schemas in datasets.items():
        per_engine = {n: EngineStats() for n in names}
        with common.Progress(dataset, len(schemas)) as progress:
            for index, (schema_id, schema) in enumerate(schemas):
                order = names if index % 2 == 0 else names[::-1]
                seed = args.seed * 1_000_003 + index
                for name in order:
                    stats = run_schema(engines[name], schema, walker, hf_tokenizer, seed, args)
                    per_engine[name].add(stats)
                    details.setdefault(dataset, []).append(
                        {"id": schema_id, "engine": name, **stats.summary(), "errors": stats.errors}
                    )
                progress.update()
        for name in names:
            overall[name].add(per_engine[name])
        summaries[dataset] = {n: s.summary() for n, s in per_engine.items()}
    summaries["overall"] = {n: s.summary() for n, s in overall.items()}

    print_tables(summaries, names)
    for dataset, text in PAPER_COVERAGE.items():
        if dataset in summaries:
            print(f"paper (arXiv 2501.10868) coverage, {dataset}: {text}")
    common.write_json(
        args.json,
        {
            "machine": info,
            "args": {k: v for k, v in vars(args).items() if k != "json"} | {"json": str(args.json)},
            "summaries": summaries,
            "schemas": details,
            "skipped": skipped,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
