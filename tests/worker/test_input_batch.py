"""The persistent ``InputBatch``: every step's arrays equal the from-scratch construction it replaced.

The reference is the runner's code before the ``InputBatch`` (``legacy_*`` in benchmarks/input_prep.py,
kept verbatim there for the timing comparison). A hypothesis state machine plays a scheduler —
requests admitted, prefilled in chunks, decoding, finishing, preempted (with and without a step
out, their new tables starting with the old blocks as a prefix-cache hit would), sitting out steps,
rows reused — and after every step compares the ids, positions, slots, sample rows and the
metadata of the ``cpu``, ``torch`` and ``triton`` backends. The engine test checks real engine
traffic the same way and compares its outputs with a batch that keeps nothing across steps.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from asyncllm import Engine, SamplingParams
from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.torch._attention import build_metadata as _attention_metadata
from asyncllm.backends.triton import _launchers as attention_triton
from asyncllm.executor._runner import SequenceInput
from asyncllm.testing import import_path
from asyncllm.worker._input_batch import InputBatch, StepInputs, step_inputs
from asyncllm.worker._model_runner import TorchModelRunner

CPU = torch.device("cpu")
PARAMS = SamplingParams()


legacy = import_path(Path(__file__).resolve().parents[2] / "benchmarks" / "input_prep.py", "asyncllm_bench_input_prep")


def _same(got: Any, expected: Any) -> None:
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got, expected)
    np.testing.assert_array_equal(got, expected)


def _same_optional(got: torch.Tensor | None, expected: torch.Tensor | None) -> None:
    assert (got is None) == (expected is None)
    if got is not None and expected is not None:
        _same(got, expected)


def _attended(slots: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Per query, the slots it attends to in order: what the attention computes over, whatever the padding."""
    rows = mask.reshape(mask.shape[0], mask.shape[-1]) if mask.dim() == 4 else mask  # decodes: [n, 1, 1, kv]
    gathered = slots.expand(len(rows), -1) if slots.dim() == 1 else slots
    return [gathered[i][rows[i]].tolist() for i in range(len(rows))]


def _full_tables(sequences: Sequence[SequenceInput]) -> list[SequenceInput]:
    """The sequences with tables from block 0, zeros for the blocks before ``block_offset`` (the legacy
    code knows no offset; those zeros are what the persistent rows hold there)."""
    return [dataclasses.replace(s, block_table=[0] * s.block_offset + s.block_table, block_offset=0) for s in sequences]


def assert_matches_legacy(
    step: StepInputs, sequences: Sequence[SequenceInput], block_size: int, sliding_window: int | None = None
) -> None:
    """The step's arrays and every backend's metadata equal the from-scratch construction's.

    With a sliding window the sliding layers' slots start at each sequence's window, where the legacy code
    gathered the whole context and masked it: there each query must attend to the same slots in the same
    order, and the global layers' metadata must equal the legacy code's without a window."""
    sequences = _full_tables(sequences)
    ids, positions, slots, sample_index = legacy.legacy_flatten(sequences, block_size)
    _same(step.input_ids, ids)
    _same(step.positions, positions)
    _same(step.slot_mapping, slots)
    _same(step.sample_index, np.asarray(sample_index, dtype=np.int64))
    _same(step.query_start_loc[:-1], np.cumsum([0] + [len(s.token_ids) for s in sequences[:-1]]))

    cpu = attention_cpu.build_metadata(step, sliding_window=sliding_window)
    cpu_ref = legacy.legacy_cpu_metadata(sequences, slots, block_size, sliding_window)
    for name in ("slot_mapping", "decode_rows", "decode_block_tables", "decode_seq_lens"):
        _same(getattr(cpu, name), getattr(cpu_ref, name))
        assert getattr(cpu, name).is_contiguous()  # the C kernel reads them by pointer
    assert (cpu.block_size, cpu.sliding_window) == (cpu_ref.block_size, cpu_ref.sliding_window)
    assert len(cpu.prefills) == len(cpu_ref.prefills)
    for chunk, ref in zip(cpu.prefills, cpu_ref.prefills):
        assert (chunk.query_start, chunk.query_end) == (ref.query_start, ref.query_end)
        if sliding_window is not None and chunk.kv_slots is not None and ref.kv_slots is not None:
            assert chunk.mask is not None and ref.mask is not None
            assert _attended(chunk.kv_slots, chunk.mask) == _attended(ref.kv_slots, ref.mask)
            assert len(chunk.kv_slots) <= len(ref.kv_slots)
            continue
        _same_optional(chunk.kv_slots, ref.kv_slots)
        _same_optional(chunk.mask, ref.mask)

    meta = _attention_metadata(step, sliding_window, CPU)
    ref_meta = legacy.legacy_torch_metadata(sequences, slots, block_size, sliding_window)
    for name in ("slot_mapping", "decode_token_index"):
        _same(getattr(meta, name), getattr(ref_meta, name))
    assert len(meta.prefills) == len(ref_meta.prefills)
    if sliding_window is None:
        _same(meta.decode_kv_slots, ref_meta.decode_kv_slots)
        _same(meta.decode_mask, ref_meta.decode_mask)
        assert meta.global_decode_kv_slots is meta.global_decode_mask is meta.global_prefills is None
    else:
        assert meta.decode_kv_slots.shape[1] <= sliding_window  # a decode gathers its window only
        attended = _attended(meta.decode_kv_slots, meta.decode_mask)
        assert attended == _attended(ref_meta.decode_kv_slots, ref_meta.decode_mask)
        causal = legacy.legacy_torch_metadata(sequences, slots, block_size, None)
        _same(meta.global_decode_kv_slots, causal.decode_kv_slots)
        _same(meta.global_decode_mask, causal.decode_mask)
        assert meta.global_prefills is not None
        for prefill, ref_prefill in zip(meta.global_prefills, causal.prefills):
            _same(prefill.kv_slots, ref_prefill.kv_slots)
            _same(prefill.mask, ref_prefill.mask)
    for prefill, ref_prefill in zip(meta.prefills, ref_meta.prefills):
        assert (prefill.query_start, prefill.query_end) == (ref_prefill.query_start, ref_prefill.query_end)
        if sliding_window is None:
            _same(prefill.kv_slots, ref_prefill.kv_slots)
            _same(prefill.mask, ref_prefill.mask)
        else:
            assert _attended(prefill.kv_slots, prefill.mask) == _attended(ref_prefill.kv_slots, ref_prefill.mask)

    triton = attention_triton.build_metadata(step, num_kv_heads=2, device=CPU, sliding_window=sliding_window)
    # Tables are padded to a multiple of 16 columns (constant kernel specialisation); the padding is zero.
    width = max(1, -(-triton.max_seq_len // block_size))
    assert not triton.block_tables[:, width:].any()
    packed = torch.cat(
        [triton.query_start_loc, triton.seq_lens, triton.block_tables[:, :width].flatten(), triton.slot_mapping]
    ).numpy()
    _same(packed, legacy.legacy_triton_buffer(sequences, slots, block_size))
    seq_lens = [s.start_position + len(s.token_ids) for s in sequences]
    assert triton.max_seq_len == max(seq_lens, default=0)
    assert triton.max_query_len == max((len(s.token_ids) for s in sequences), default=0)


def assert_rows_hold_tables(batch: InputBatch, sequences: Sequence[SequenceInput]) -> None:
    """Each request's row is zeros up to its block offset, its table, then zeros; every other row is all zeros."""
    used = set()
    for seq in sequences:
        row = batch.row_of(seq.request_id)
        assert row is not None
        used.add(row)
        expected = np.zeros(batch.block_tables.shape[1], dtype=np.int64)
        expected[seq.block_offset : seq.block_offset + len(seq.block_table)] = seq.block_table
        _same(batch.block_tables[row], expected)
    assert batch.num_rows_in_use == len(sequences) == len(used)
    free = [r for r in range(len(batch.block_tables)) if r not in used]
    assert not batch.block_tables[free].any()


# -- a scheduler played by hypothesis --------------------------------------------------------------------


@dataclass
class _Request:
    request_id: int
    num_tokens: int
    """Prompt plus sampled tokens so far."""
    computed: int = 0
    table: list[int] = field(default_factory=list)
    epoch: int = 0
    sits_out: bool = False
    offset: int = 0
    """Leading blocks dropped from the table (they left a sliding window)."""


class InputBatchMachine(RuleBasedStateMachine):
    """Steps of a small engine's life; after each, the batch's arrays equal the from-scratch ones."""

    BLOCK_SIZE = 4

    @initialize(
        rows=st.integers(1, 6),
        width=st.integers(1, 8),
        seed=st.integers(0, 2**16),
        prompts=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    )
    def start(self, rows: int, width: int, seed: int, prompts: list[int]) -> None:
        # Small initial sizes, so that steps outgrow them (rows and columns grow on demand).
        self.batch = InputBatch(self.BLOCK_SIZE, max_num_seqs=rows, max_blocks_per_seq=width)
        self.rng = random.Random(seed)
        self.free = list(range(300))
        self.rng.shuffle(self.free)
        self.running: list[_Request] = []
        self.finished: list[int] = []
        self.next_id = 0
        self.last_step: list[SequenceInput] = []
        self.blocks_fed = 0
        """Blocks in the tables of every step so far: what a from-scratch build converts."""
        self.admit(prompts)

    def _pick(self, index: int) -> _Request | None:
        return self.running[index % len(self.running)] if self.running else None

    @rule(prompts=st.lists(st.integers(1, 40), min_size=1, max_size=3))
    def admit(self, prompts: list[int]) -> None:
        for prompt in prompts:
            self.running.append(_Request(self.next_id, prompt))
            self.next_id += 1

    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        request = self._pick(index)
        if request is None:
            return
        self.running.remove(request)
        self.free += request.table
        self.finished.append(request.request_id)

    @rule(index=st.integers(0, 100), sit_out=st.booleans())
    def preempt(self, index: int, sit_out: bool) -> None:
        # Its blocks go back first in line, so its new table starts with the same blocks (as a
        # prefix-cache hit gives them back). The engine's scheduler always leaves a preempted request
        # out of the next step; without that, only the new epoch tells the batch.
        request = self._pick(index)
        if request is None:
            return
        self.free[:0] = reversed(request.table)
        request.table, request.computed, request.offset = [], 0, 0
        request.epoch += 1
        request.sits_out = sit_out

    @rule(index=st.integers(0, 100))
    def sit_out(self, index: int) -> None:
        request = self._pick(index)
        if request is not None:
            request.sits_out = True

    @rule(index=st.integers(0, 100))
    def leave_window(self, index: int) -> None:
        # Blocks wholly before the window (of the smallest window the steps use) of the request's next
        # token go back to the pool, and its table starts further on: what the KV manager does.
        request = self._pick(index)
        if request is None:
            return
        drop = min(max(0, request.computed - 3 + 1) // self.BLOCK_SIZE - request.offset, len(request.table))
        if drop > 0:
            self.free += request.table[:drop]
            del request.table[:drop]
            request.offset += drop

    @rule(index=st.integers(0, 100))
    def replace_last_block(self, index: int) -> None:
        # A hand-fed table rebuilt without a new epoch: caught by its changed last block.
        request = self._pick(index)
        if request is not None and request.table:
            self.free.append(request.table[-1])
            request.table[-1] = self.free.pop(0)

    @rule(budget=st.integers(1, 48), sliding_window=st.sampled_from([None, 3, 9]))
    def step(self, budget: int, sliding_window: int | None) -> None:
        sequences = []
        for request in self.running:
            if request.sits_out:
                request.sits_out = False
                continue
            num_new = min(request.num_tokens - request.computed, budget)
            needed = -(-(request.computed + num_new) // self.BLOCK_SIZE) - request.offset - len(request.table)
            if num_new == 0 or needed > len(self.free):
                continue
            request.table += [self.free.pop(0) for _ in range(needed)]
            tokens = [self.rng.randrange(1000) for _ in range(num_new)]
            sample = request.computed + num_new == request.num_tokens
            table = list(request.table)
            sequence = SequenceInput(
                request.request_id, tokens, request.computed, table, sample, PARAMS,
                epoch=request.epoch, block_offset=request.offset,
            )  # fmt: skip
            sequences.append(sequence)
            request.computed += num_new
            request.num_tokens += sample
            budget -= num_new
        self.batch.remove(self.finished)
        self.finished = []
        step = self.batch.prepare(sequences)
        self.blocks_fed += sum(len(s.block_table) for s in sequences)
        if sequences:  # the runner never prepares an empty step; the legacy code cannot
            assert_matches_legacy(step, sequences, self.BLOCK_SIZE, sliding_window)
        self.last_step = sequences

    @invariant()
    def rows_hold_tables(self) -> None:
        if hasattr(self, "batch") and self.last_step and not self.finished:
            assert_rows_hold_tables(self.batch, self.last_step)


InputBatchMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
test_input_batch_matches_legacy = InputBatchMachine.TestCase


@pytest.mark.parametrize("seed", range(3))
def test_long_random_runs_match_legacy(seed: int) -> None:
    # Hypothesis keeps its runs short; these drive the same machine through 300 busy steps each
    # (a dozen requests at a time, every event many times over).
    rng = random.Random(seed)
    machine = InputBatchMachine()
    machine.start(rows=4, width=4, seed=seed, prompts=[rng.randint(1, 40) for _ in range(8)])
    for _ in range(300):
        event = rng.random()
        index = rng.randrange(100)
        if event < 0.08 or len(machine.running) < 4:
            machine.admit([rng.randint(1, 40) for _ in range(rng.randint(1, 3))])
        elif event < 0.14:
            machine.finish(index)
        elif event < 0.18:
            machine.preempt(index, sit_out=rng.random() < 0.5)
        elif event < 0.22:
            machine.sit_out(index)
        elif event < 0.24:
            machine.replace_last_block(index)
        elif event < 0.30:
            machine.leave_window(index)
        machine.step(budget=rng.randint(4, 64), sliding_window=rng.choice([None, 5]))
        machine.rows_hold_tables()
    # Only new blocks and rebuilt tables were written, a small part of what the steps carried.
    assert machine.batch.num_blocks_written < machine.blocks_fed / 4


# -- particular cases ------------------------------------------------------------------------------------


def _decode(request_id: int, context: int, table: list[int], epoch: int = 0) -> SequenceInput:
    return SequenceInput(request_id, [7], context - 1, table, True, PARAMS, epoch=epoch)


def test_a_decode_step_writes_only_new_blocks() -> None:
    batch = InputBatch(4, max_num_seqs=2, max_blocks_per_seq=4)
    batch.prepare([_decode(0, 8, [5, 9]), _decode(1, 3, [2])])
    assert batch.num_blocks_written == 3
    batch.prepare([_decode(0, 9, [5, 9, 4]), _decode(1, 4, [2])])  # request 0 opens a block
    assert batch.num_blocks_written == 4
    step = batch.prepare([_decode(0, 10, [5, 9, 4]), _decode(1, 5, [2, 7])])
    assert batch.num_blocks_written == 5
    assert step.slot_mapping.tolist() == [4 * 4 + 1, 7 * 4 + 0]
    assert step.tables(None, 3).tolist() == [[5, 9, 4], [2, 7, 0]]


def test_rows_are_freed_and_reused() -> None:
    batch = InputBatch(4, max_num_seqs=2, max_blocks_per_seq=2)
    batch.prepare([_decode(0, 4, [1]), _decode(1, 4, [2])])
    assert (batch.row_of(0), batch.row_of(1)) == (0, 1)
    batch.remove([0])
    assert batch.row_of(0) is None and not batch.block_tables[0].any()
    batch.prepare([_decode(1, 5, [2, 3]), _decode(2, 1, [6])])  # request 2 takes the freed row
    assert batch.row_of(2) == 0
    batch.prepare([_decode(2, 2, [6])])  # request 1 left the step: its row is freed
    assert batch.row_of(1) is None and batch.num_rows_in_use == 1 and not batch.block_tables[1].any()


def test_a_new_epoch_rewrites_the_row() -> None:
    # Preempted and rebuilt with the same first blocks (a prefix-cache hit) and the same length:
    # only the epoch tells the rebuilt table from the old one.
    batch = InputBatch(4)
    batch.prepare([_decode(0, 12, [3, 4, 5])])
    step = batch.prepare([_decode(0, 12, [3, 4, 8], epoch=1)])
    assert step.tables(None, 3).tolist() == [[3, 4, 8]]
    assert step.slot_mapping.tolist() == [8 * 4 + 3]


@pytest.mark.parametrize(
    ("old", "new"), [([3, 4, 5], [3, 4]), ([3, 4, 5], [3, 4, 9]), ([3, 4], [3, 7, 1]), ([3, 4], [6, 4, 1])]
)
def test_a_table_that_did_not_grow_is_rewritten(old: list[int], new: list[int]) -> None:
    # Fed by hand, with no epoch: a shorter table, a changed last block, a changed last or first known block.
    batch = InputBatch(4)
    batch.prepare([_decode(0, 4 * len(old), old)])
    step = batch.prepare([_decode(0, 4 * len(new), new)])
    assert step.tables(None, len(new)).tolist() == [new]
    assert_rows_hold_tables(batch, [_decode(0, 4 * len(new), new)])


def test_rows_and_columns_grow_on_demand() -> None:
    batch = InputBatch(2, max_num_seqs=1, max_blocks_per_seq=1)
    sequences = [_decode(i, 2 * (i + 3), list(range(10 * i, 10 * i + i + 3))) for i in range(5)]
    step = batch.prepare(sequences)
    assert batch.block_tables.shape[0] >= 5 and batch.block_tables.shape[1] >= 7
    assert_matches_legacy(step, sequences, 2)
    assert_rows_hold_tables(batch, sequences)


def test_invalid_steps_are_refused() -> None:
    batch = InputBatch(4)
    with pytest.raises(ValueError, match="more than once"):
        batch.prepare([_decode(0, 4, [1]), _decode(0, 4, [1])])
    with pytest.raises(ValueError, match="does not cover"):
        batch.prepare([_decode(1, 5, [1])])
    with pytest.raises(ValueError, match="positive"):
        InputBatch(0)


def test_empty_and_mixed_steps() -> None:
    empty = step_inputs([], 4)
    assert empty.num_seqs == empty.num_tokens == 0 and empty.max_seq_len == 0
    mixed = [
        SequenceInput(0, [1, 2, 3], 0, [0], False, PARAMS),
        _decode(1, 6, [3, 1]),
        SequenceInput(2, [4, 5], 5, [2, 6], True, PARAMS),
    ]
    step = step_inputs(mixed, 4)
    assert step.positions.tolist() == [0, 1, 2, 5, 5, 6]
    assert step.sample_index.tolist() == [3, 5]
    assert step.decode_index.tolist() == [1] and step.prefill_index.tolist() == [0, 2]
    assert_matches_legacy(step, mixed, 4, sliding_window=2)


def test_benchmark_quick_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert legacy.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert all(f"| 16 | {backend} |" in out for backend in ("cpu", "torch", "triton"))


# -- the engine: real traffic, unchanged outputs ------------------------------------------------------------


class _CheckingInputBatch(InputBatch):
    """Checks every step against the from-scratch construction; with ``scratch``, keeps nothing across steps."""

    def __init__(self, *args: Any, scratch: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scratch = scratch
        self.num_steps = 0

    def prepare(self, sequences: Sequence[SequenceInput]) -> StepInputs:
        if self.scratch:
            self.remove([s.request_id for s in sequences])
        step = super().prepare(sequences)
        assert_matches_legacy(step, sequences, self.block_size)
        self.num_steps += 1
        return step


class _CheckedRunner(TorchModelRunner):
    def __init__(self, *args: Any, scratch: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scratch = scratch

    def load(self) -> Any:
        info = super().load()
        self.input_batch = _CheckingInputBatch(self.block_size, max_num_seqs=4, scratch=self.scratch)
        return info


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_engine_outputs_unchanged(tiny_llama: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rng = random.Random(7)
    shared = [rng.randrange(3, 200) for _ in range(9)]
    # Shared prefixes (prefix-cache hits), prompts longer than the token budget (chunked prefill),
    # more KV than the cache holds (preemption), n=2 (forked tables), more requests than rows.
    prompts = [shared + [rng.randrange(3, 200) for _ in range(rng.randint(1, 30))] for _ in range(8)]
    outputs: dict[bool, list[list[tuple[int, ...]]]] = {}
    for scratch in (False, True):
        runner = _CheckedRunner(
            tiny_llama, device="cpu", block_size=4, kv_cache_blocks=40, max_num_seqs=6, scratch=scratch
        )
        async with Engine.open(
            runner=runner, tokenizer=tokenizer, max_num_batched_tokens=24, max_num_seqs=6
        ) as engine:  # fmt: skip
            results: list[list[tuple[int, ...]]] = [[] for _ in prompts]

            async def one(index: int, engine: Engine = engine, results: list[Any] = results) -> None:
                params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=1 + index % 2)
                result = await engine.generate(prompts[index], params)
                results[index] = [tuple(s.token_ids) for s in result.samples]

            async with anyio.create_task_group() as tg:
                for index in range(len(prompts)):
                    tg.start_soon(one, index)
            stats = engine.statistics()
        assert stats.num_preemptions > 0
        assert isinstance(runner.input_batch, _CheckingInputBatch) and runner.input_batch.num_steps > 10
        outputs[scratch] = results
    assert outputs[False] == outputs[True]
