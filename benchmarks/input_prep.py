"""Input preparation per step: the persistent ``InputBatch`` against the from-scratch construction it replaced.

    python benchmarks/input_prep.py               # the table in docs/performance-log.md
    python benchmarks/input_prep.py --quick       # smoke run (small batches, few steps)

A step is what ``TorchModelRunner`` does before the model runs: token ids, positions, slot mapping,
sample rows, and the attention backend's metadata (``cpu``: decode block tables and lengths;
``torch``: explicit slots and masks; ``triton``: the packed int32 buffer, built for the CPU here).
"from scratch" is the code the runner used before the ``InputBatch`` (``legacy_*`` below, kept
verbatim): a Python loop over the sequences with a list-to-array conversion of every block table.
"persistent" is ``InputBatch.prepare`` plus the backends' ``build_metadata``.

Steps: decode-only batches of ``--batches`` sequences at contexts of about ``--context`` tokens,
block size 16, tables of shuffled blocks. Each step every sequence advances one token (contexts are
staggered, so every step a sixteenth of the rows gains a block), and each step's ``SequenceInput``s
are new objects with new table lists, as the engine makes them; making them is not timed. Both
paths see the same steps, alternating which goes first; the table shows the median microseconds
per step. Nothing here runs a model: the numbers are host-side Python and numpy only.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.torch._attention import SHORT_CHUNK_TOKENS, AttentionMetadata, PrefillChunk
from asyncllm.backends.torch._attention import build_metadata as torch_metadata
from asyncllm.backends.triton import _launchers as attention_triton
from asyncllm.executor._runner import SequenceInput
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker._input_batch import InputBatch, StepInputs

BLOCK_SIZE = 16
BACKENDS = ("cpu", "torch", "triton")
CPU = torch.device("cpu")

# -- the construction the InputBatch replaced (verbatim, but for names) ---------------------------------


def legacy_slots(block_table: np.ndarray[Any, Any], positions: np.ndarray[Any, Any], block_size: int) -> Any:
    return block_table[positions // block_size] * block_size + positions % block_size


def legacy_flatten(
    sequences: Sequence[SequenceInput], block_size: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any], list[int]]:
    """input_ids, positions, slot_mapping and sample rows (``model_runner._flatten``)."""
    ids: list[int] = []
    position_parts = []
    slot_parts = []
    sample_index: list[int] = []
    for seq in sequences:
        ids.extend(seq.token_ids)
        positions = np.arange(seq.start_position, seq.start_position + len(seq.token_ids), dtype=np.int64)
        position_parts.append(positions)
        slot_parts.append(legacy_slots(np.asarray(seq.block_table, dtype=np.int64), positions, block_size))
        if seq.sample:
            sample_index.append(len(ids) - 1)
    return (
        np.asarray(ids, dtype=np.int64),
        np.concatenate(position_parts),
        np.concatenate(slot_parts),
        sample_index,
    )


def legacy_split(
    sequences: Sequence[SequenceInput], block_size: int
) -> tuple[list[int], list[int], np.ndarray[Any, Any], int, list[tuple[int, SequenceInput]]]:
    """decode rows, decode lengths, padded decode tables, longest decode, prefills (``attention.split_step``)."""
    decode_rows: list[int] = []
    decode_lens: list[int] = []
    tables: list[list[int]] = []
    prefills: list[tuple[int, SequenceInput]] = []
    # A short chunk after a cached context (``SHORT_CHUNK_TOKENS``) is one decode per token, after the
    # single-token decodes.
    short_rows: list[int] = []
    short_lens: list[int] = []
    short_tables: list[list[int]] = []
    offset = 0
    for seq in sequences:
        num_new = len(seq.token_ids)
        if num_new == 1:
            decode_rows.append(offset)
            decode_lens.append(seq.start_position + 1)
            tables.append(seq.block_table)
        elif seq.start_position > 0 and num_new <= SHORT_CHUNK_TOKENS:
            for index in range(num_new):
                short_rows.append(offset + index)
                short_lens.append(seq.start_position + index + 1)
                short_tables.append(seq.block_table)
        else:
            prefills.append((offset, seq))
        offset += num_new
    decode_rows += short_rows
    decode_lens += short_lens
    tables += short_tables
    max_len = max(decode_lens, default=0)
    max_blocks = max(1, -(-max_len // block_size))
    padded = np.zeros((len(decode_rows), max_blocks), dtype=np.int64)
    for row, table in enumerate(tables):
        used = table[:max_blocks]
        padded[row, : len(used)] = used
    return decode_rows, decode_lens, padded, max_len, prefills


def legacy_cpu_metadata(
    sequences: Sequence[SequenceInput], slot_mapping: np.ndarray[Any, Any], block_size: int, sliding_window: int | None
) -> attention_cpu.CpuAttentionMetadata:
    """``attention_cpu.build_metadata``."""
    decode_rows, decode_lens, tables, _max_len, prefills = legacy_split(sequences, block_size)
    return attention_cpu.CpuAttentionMetadata(
        slot_mapping=torch.from_numpy(np.ascontiguousarray(slot_mapping, dtype=np.int64)),
        decode_rows=torch.tensor(decode_rows, dtype=torch.int64),
        decode_block_tables=torch.from_numpy(tables),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int64),
        block_size=block_size,
        sliding_window=sliding_window,
        prefills=tuple(_legacy_cpu_prefill(seq, offset, block_size, sliding_window) for offset, seq in prefills),
    )


def _legacy_cpu_prefill(
    seq: SequenceInput, offset: int, block_size: int, sliding_window: int | None
) -> attention_cpu.CpuPrefillChunk:
    num_new = len(seq.token_ids)
    kv_len = seq.start_position + num_new
    end = offset + num_new
    windowed = sliding_window is not None and kv_len > sliding_window
    if seq.start_position == 0 and not windowed:
        return attention_cpu.CpuPrefillChunk(offset, end, None, None)
    kv_positions = np.arange(kv_len, dtype=np.int64)
    query_positions = np.arange(seq.start_position, kv_len, dtype=np.int64)
    mask = kv_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        mask &= kv_positions[None, :] > query_positions[:, None] - sliding_window
    if seq.start_position == 0:
        return attention_cpu.CpuPrefillChunk(offset, end, None, torch.from_numpy(mask))
    table = np.asarray(seq.block_table, dtype=np.int64)
    slots = table[kv_positions // block_size] * block_size + kv_positions % block_size
    return attention_cpu.CpuPrefillChunk(offset, end, torch.from_numpy(slots), torch.from_numpy(mask))


def legacy_torch_metadata(
    sequences: Sequence[SequenceInput], slot_mapping: np.ndarray[Any, Any], block_size: int, sliding_window: int | None
) -> AttentionMetadata:
    """``backends.torch._attention.build_metadata`` (on the CPU)."""
    decode_rows, decode_lens, tables, max_len, split_prefills = legacy_split(sequences, block_size)
    prefills: list[PrefillChunk] = []
    for offset, seq in split_prefills:
        kv_len = seq.start_position + len(seq.token_ids)
        kv_positions = np.arange(kv_len, dtype=np.int64)
        kv_slots = legacy_slots(np.asarray(seq.block_table, dtype=np.int64), kv_positions, block_size)
        query_positions = np.arange(seq.start_position, kv_len, dtype=np.int64)
        mask = kv_positions[None, :] <= query_positions[:, None]
        if sliding_window is not None:
            mask &= kv_positions[None, :] > query_positions[:, None] - sliding_window
        chunk = PrefillChunk(
            offset, kv_len - seq.start_position + offset, torch.from_numpy(kv_slots), torch.from_numpy(mask)
        )
        prefills.append(chunk)
    kv_positions = np.arange(max_len, dtype=np.int64)
    decode_slots = tables[:, kv_positions // block_size] * block_size + kv_positions % block_size
    lens = np.asarray(decode_lens, dtype=np.int64)[:, None]
    decode_mask = kv_positions[None, :] < lens
    if sliding_window is not None:
        decode_mask &= kv_positions[None, :] > lens - 1 - sliding_window
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping),
        decode_token_index=torch.tensor(decode_rows, dtype=torch.int64),
        decode_kv_slots=torch.from_numpy(decode_slots),
        decode_mask=torch.from_numpy(decode_mask[:, None, None, :].copy()),
        prefills=tuple(prefills),
    )


def legacy_triton_buffer(
    sequences: Sequence[SequenceInput], slot_mapping: np.ndarray[Any, Any], block_size: int
) -> np.ndarray[Any, Any]:
    """The packed int32 host buffer of ``attention_triton.build_metadata``:
    [query_start_loc | seq_lens | block_tables | slot_mapping]."""
    num_seqs = len(sequences)
    query_lens = np.fromiter((len(s.token_ids) for s in sequences), dtype=np.int32, count=num_seqs)
    seq_lens = np.fromiter((s.start_position + len(s.token_ids) for s in sequences), dtype=np.int32, count=num_seqs)
    max_seq_len = int(seq_lens.max(initial=0))
    max_blocks = max(1, -(-max_seq_len // block_size))
    tokens = int(query_lens.sum())
    table_at = 2 * num_seqs + 1
    slots_at = table_at + num_seqs * max_blocks
    packed = np.zeros(slots_at + tokens, dtype=np.int32)
    np.cumsum(query_lens, out=packed[1 : num_seqs + 1])
    packed[num_seqs + 1 : table_at] = seq_lens
    tables = packed[table_at:slots_at].reshape(num_seqs, max_blocks)
    for row, seq in enumerate(sequences):
        used = min(len(seq.block_table), max_blocks)
        tables[row, :used] = seq.block_table[:used]
    packed[slots_at:] = slot_mapping
    return packed


def legacy_step(sequences: Sequence[SequenceInput], backend: str, block_size: int = BLOCK_SIZE) -> Any:
    """What the runner built before the model ran, from scratch, for one backend."""
    ids, positions, slots, sample_index = legacy_flatten(sequences, block_size)
    if backend == "cpu":
        meta: Any = legacy_cpu_metadata(sequences, slots, block_size, None)
    elif backend == "torch":
        meta = legacy_torch_metadata(sequences, slots, block_size, None)
    else:
        meta = torch.from_numpy(legacy_triton_buffer(sequences, slots, block_size))
    return ids, positions, sample_index, meta


def persistent_step(batch: InputBatch, sequences: Sequence[SequenceInput], backend: str) -> Any:
    """The same through the persistent ``InputBatch`` and the backends' ``build_metadata``."""
    step: StepInputs = batch.prepare(sequences)
    if backend == "cpu":
        meta: Any = attention_cpu.build_metadata(step, sliding_window=None)
    elif backend == "torch":
        meta = torch_metadata(step, None, CPU)
    else:
        meta = attention_triton.build_metadata(step, num_kv_heads=1, device=CPU)
    return step, meta


# -- the steps -----------------------------------------------------------------------------------------


class DecodeSteps:
    """``batch`` sequences decoding from about ``context`` tokens, one token a step, blocks shuffled."""

    def __init__(self, batch: int, context: int, steps: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        longest = context + steps + BLOCK_SIZE
        self._free = list(range(batch * -(-longest // BLOCK_SIZE)))
        rng.shuffle(self._free)
        self.params = SamplingParams(temperature=0.0)
        # Staggered: each step one sequence in BLOCK_SIZE opens a new block.
        self.lengths = [context - i % BLOCK_SIZE for i in range(batch)]
        self.tables = [[self._free.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in self.lengths]

    def next(self) -> list[SequenceInput]:
        """The next step: every sequence feeds its next token."""
        sequences = []
        for index, length in enumerate(self.lengths):
            table = self.tables[index]
            if length + 1 > len(table) * BLOCK_SIZE:
                table.append(self._free.pop())
            sequences.append(SequenceInput(index, [7], length, list(table), True, self.params))
            self.lengths[index] = length + 1
        return sequences


def measure(batch: int, context: int, steps: int, warmup: int = 20) -> dict[str, dict[str, tuple[float, float]]]:
    """Per backend: median (wall, thread CPU) microseconds per step, for "scratch" and "persistent"."""
    results = {}
    for backend in BACKENDS:
        source = DecodeSteps(batch, context, steps + warmup)
        persistent = InputBatch(BLOCK_SIZE, max_num_seqs=batch, max_blocks_per_seq=-(-2 * context // BLOCK_SIZE))
        wall: dict[str, list[float]] = {"scratch": [], "persistent": []}
        cpu: dict[str, list[float]] = {"scratch": [], "persistent": []}
        for index in range(steps + warmup):
            sequences = source.next()
            for name in ("scratch", "persistent") if index % 2 else ("persistent", "scratch"):
                start, cpu_start = time.perf_counter_ns(), time.thread_time_ns()
                if name == "scratch":
                    legacy_step(sequences, backend)
                else:
                    persistent_step(persistent, sequences, backend)
                if index >= warmup:
                    wall[name].append((time.perf_counter_ns() - start) / 1e3)
                    cpu[name].append((time.thread_time_ns() - cpu_start) / 1e3)
        results[backend] = {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in wall}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="decode sequences per step")
    parser.add_argument("--context", type=int, default=512, help="tokens of context at the first step")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per batch and backend")
    parser.add_argument("--quick", action="store_true", help="small batches and few steps (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.context, args.steps = [4, 16], 64, 20
    print(f"input preparation per decode step: block size {BLOCK_SIZE}, contexts from {args.context} tokens,")
    print(f"median µs per step over {args.steps} steps, wall and thread CPU time")
    print(f"(python {sys.version.split()[0]}, numpy {np.__version__}, torch {torch.__version__})")
    print()
    print("| batch | backend | from scratch µs | persistent µs | ratio | from scratch CPU µs | persistent CPU µs |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        for backend, times in measure(batch, args.context, args.steps).items():
            (scratch, scratch_cpu), (persistent, persistent_cpu) = times["scratch"], times["persistent"]
            print(
                f"| {batch} | {backend} | {scratch:.0f} | {persistent:.0f} | {scratch / persistent:.1f}x "
                f"| {scratch_cpu:.0f} | {persistent_cpu:.0f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
