"""Re-draw the JSONSchemaBench sample in this folder from a local clone of guidance-ai/jsonschemabench.

    python benchmarks/data/jsonschemabench/sample.py /path/to/jsonschemabench [--per-dataset 40]

For each dataset folder under the clone's ``data/`` (sorted by name), the schema files are sorted by
name and shuffled by a generator seeded with ``"<seed>:<dataset>"``; the first ``--per-dataset``
files of that order whose size is at most ``--max-bytes`` are kept, in that order. Each dataset is
written as ``<dataset>.jsonl``: one ``{"id": <file name without .json>, "schema": {...}}`` per line,
compact JSON. The same clone and arguments give the same files byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def draw(data: Path, dataset: str, per_dataset: int, max_bytes: int, seed: int) -> list[tuple[str, object]]:
    """The ``(id, schema)`` pairs kept for one dataset folder."""
    files = sorted(p for p in (data / dataset).iterdir() if p.suffix == ".json")
    random.Random(f"{seed}:{dataset}").shuffle(files)
    kept: list[tuple[str, object]] = []
    for path in files:
        if len(kept) == per_dataset:
            break
        if path.stat().st_size > max_bytes:
            continue
        kept.append((path.stem, json.loads(path.read_text(encoding="utf-8"))))
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("clone", type=Path, help="a checkout of guidance-ai/jsonschemabench (with its data/ folder)")
    parser.add_argument("--per-dataset", type=int, default=40, help="schemas kept per dataset (default 40)")
    parser.add_argument("--max-bytes", type=int, default=200_000, help="skip schema files larger than this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE, help="where the .jsonl files go (default: this folder)")
    args = parser.parse_args(argv)
    data = args.clone / "data"
    if not data.is_dir():
        print(f"{data} is not a folder: pass a checkout of guidance-ai/jsonschemabench", file=sys.stderr)
        return 2
    for dataset in sorted(p.name for p in data.iterdir() if p.is_dir()):
        kept = draw(data, dataset, args.per_dataset, args.max_bytes, args.seed)
        lines = [json.dumps({"id": i, "schema": s}, separators=(",", ":"), ensure_ascii=False) for i, s in kept]
        (args.out / f"{dataset}.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        print(f"{dataset}: {len(kept)} schemas")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
