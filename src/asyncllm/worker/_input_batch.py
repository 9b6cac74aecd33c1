"""``InputBatch``: the model runner's per-request rows, kept across steps, and each step's input arrays.

Every step the runner turns the scheduler's sequences into a few integer arrays: token ids, their
positions, the cache slot of every new token, where each sequence starts in the flat batch, context
lengths, and zero-padded block tables (of the decodes, or of every sequence). Built from scratch,
that is Python work over every sequence and every block each step: a list-to-array conversion of
each block table, an ``arange`` and a slot computation per sequence, a padded table filled row by row.

Block tables hardly change from one step to the next: while a request runs, its table only grows,
by one block every ``block_size`` decode steps. So the tables live here across steps, one row per
request in a preallocated [rows, max_blocks] int64 array, and a step writes only the blocks a row
gained. The rest is derived from the step's scalars with a few vectorized numpy operations; the one
Python loop is over the step's sequences (reading their scalars), none is over tokens or blocks.

Rows are claimed on a request's first step and freed when it finishes (``remove``) or is absent
from a step. A table that was rebuilt rather than grown is rewritten whole. The engine rebuilds a
table only after a preemption, which leaves the request out of the step that preempted it (its row
is freed) and bumps its epoch (``SequenceInput.epoch``: a new epoch rewrites the row); either is
enough. A speculative trim that cuts a table's end bumps the epoch too. Sequences fed by hand get
O(1) checks besides: a table shorter than its row, or whose first or last known block changed, is
rewritten too. With a sliding window a table also loses leading
blocks (``SequenceInput.block_offset`` grows, once every ``block_size`` tokens at most): the row is
then rewritten too, zeros before the offset, which costs the blocks within the window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncllm.executor._runner import SequenceInput

__all__ = ["InputBatch", "StepInputs", "step_inputs"]

_Array = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True)
class StepInputs:
    """A step's flat batch as arrays, sequences in step order; int64 throughout.

    ``block_tables`` is the ``InputBatch``'s own table, not a copy: use these arrays before the
    batch's next ``prepare`` (the runner builds a step's device inputs before it prepares the next).
    """

    block_size: int
    input_ids: _Array
    """[tokens] the ids fed this step."""
    positions: _Array
    """[tokens] the position of every fed token."""
    slot_mapping: _Array
    """[tokens] the cache slot each new token's K/V is written to."""
    query_start_loc: _Array
    """[num_seqs + 1] where each sequence's tokens start in the flat batch (and the total)."""
    seq_lens: _Array
    """[num_seqs] context length once this step's tokens are written."""
    table_lens: _Array
    """[num_seqs] columns each sequence's table reaches (its ``block_offset`` plus its blocks)."""
    rows: _Array
    """[num_seqs] each sequence's row of ``block_tables``."""
    block_tables: _Array
    """[rows, max_blocks] the persistent tables, column = block index in the sequence; zero past each
    row's blocks and before its ``block_offset`` (blocks that left a sliding window: never read)."""
    sample_index: _Array
    """[samples] flat-batch rows whose logits are sampled (the last token of a sampling sequence)."""
    decode_index: _Array
    """Sequences that feed one token (attended as one batch)."""
    prefill_index: _Array
    """Sequences that feed more (attended one at a time)."""
    max_query_len: int
    max_seq_len: int
    long_rope: _Array | None = None
    """[tokens] bool: the token's sequence rotates by LongRoPE's long frequencies
    (``SequenceInput.long_rope``); None when no sequence of the step does."""

    @property
    def num_seqs(self) -> int:
        """Sequences in the step."""
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        """Tokens fed in the step."""
        return len(self.input_ids)

    def tables(self, index: _Array | None, width: int) -> _Array:
        """Block tables of some of the step's sequences (all: ``None``), ``width`` columns, zero-padded.

        Args:
            index: Positions in the step of the sequences wanted.
            width: Columns; at most ``max(1, ceil(max_seq_len / block_size))`` or the longest table.

        Returns:
            A new contiguous [len(index), width] int64 array (a gather, no per-row work).
        """
        rows = self.rows if index is None else self.rows[index]
        # The persistent rows are zero past their blocks, so a plain gather is already padded.
        return np.ascontiguousarray(self.block_tables[rows, :width])


class InputBatch:
    """Block tables kept across steps, one row per request, and the step arrays built from them.

    Args:
        block_size: Tokens per KV block.
        max_num_seqs: Rows allocated up front (the most sequences in a step; more grow the array).
        max_blocks_per_seq: Columns allocated up front (a longer table grows the array).
    """

    def __init__(self, block_size: int, *, max_num_seqs: int = 256, max_blocks_per_seq: int = 128) -> None:
        if block_size < 1 or max_num_seqs < 1 or max_blocks_per_seq < 1:
            raise ValueError("block_size, max_num_seqs and max_blocks_per_seq must be positive")
        self.block_size = block_size
        self.block_tables: _Array = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int64)
        """[rows, max_blocks] int64; a row holds zeros before its request's ``block_offset``, its
        blocks, then zeros (a free row: zeros)."""
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out the lowest row
        # Per-row mirrors as Python lists: the per-sequence loop reads them without numpy scalars.
        self._num_blocks = [0] * max_num_seqs
        self._last_block = [0] * max_num_seqs
        self._epoch = [0] * max_num_seqs
        self._offset = [0] * max_num_seqs
        self.num_blocks_written = 0
        """Blocks written into rows so far (a grown row adds its new blocks, a rewritten row all of them)."""

    @property
    def num_rows_in_use(self) -> int:
        """Requests holding a row."""
        return len(self._row_of)

    def row_of(self, request_id: int) -> int | None:
        """The request's row of ``block_tables``, or None when it holds none."""
        return self._row_of.get(request_id)

    def remove(self, request_ids: Iterable[int]) -> None:
        """Free the rows of requests that ended (unknown ids are ignored)."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._clear(row)
                self._free_rows.append(row)

    def prepare(self, sequences: Sequence[SequenceInput]) -> StepInputs:
        """Bring the rows up to date with a step's sequences and build the step's arrays.

        Requests absent from the step lose their rows; the others get a row on their first step,
        their new blocks appended, or (a rebuilt table) their row rewritten.

        Raises:
            ValueError: A request appears twice, or a table does not cover its sequence's tokens.
        """
        n = len(sequences)
        present = {seq.request_id for seq in sequences}
        if len(present) != n:
            raise ValueError("a request appears more than once in one step")
        self.remove(self._row_of.keys() - present)
        if n > len(self.block_tables):
            self._grow(rows=n, width=self.block_tables.shape[1])
        return self._arrays(sequences, *self._update_rows(sequences))

    def _update_rows(self, sequences: Sequence[SequenceInput]) -> tuple[list[Any], ...]:
        """Bring each sequence's row up to date and read its scalars: the one loop over sequences."""
        row_of, num_blocks, last_block, epochs = self._row_of, self._num_blocks, self._last_block, self._epoch
        offsets = self._offset
        rows: list[int] = []
        table_lens: list[int] = []
        starts: list[int] = []
        query_lens: list[int] = []
        sampling: list[int] = []
        longs: list[bool] = []
        ids: list[int] = []
        # New blocks are gathered here and written with one fancy assignment after the loop.
        write_rows: list[int] = []
        write_cols: list[int] = []
        write_blocks: list[int] = []
        for seq in sequences:
            table = seq.block_table
            offset = seq.block_offset
            have = offset + len(table)  # columns the table reaches: its blocks start at column offset
            row = row_of.get(seq.request_id)
            if (
                row is None
                or have != num_blocks[row]
                or seq.epoch != epochs[row]
                or offset != offsets[row]
                or (table and table[-1] != last_block[row])
            ):
                row = self._row_for(seq, row)
                known = max(num_blocks[row], offset)
                if have > known:  # appended blocks (on a row just claimed or cleared: the whole table)
                    write_rows += [row] * (have - known)
                    write_cols += range(known, have)
                    write_blocks += table[known - offset :]
                    num_blocks[row] = have
                    last_block[row] = table[-1]
            rows.append(row)
            table_lens.append(have)
            starts.append(seq.start_position)
            query_lens.append(len(seq.token_ids))
            sampling.append(seq.sample)
            longs.append(seq.long_rope)
            ids += seq.token_ids
        if write_rows:
            if max(table_lens) > self.block_tables.shape[1]:
                self._grow(rows=len(self.block_tables), width=max(max(table_lens), 2 * self.block_tables.shape[1]))
            self.block_tables[write_rows, write_cols] = write_blocks
            self.num_blocks_written += len(write_blocks)
        return rows, table_lens, starts, query_lens, sampling, ids, longs

    def _row_for(self, seq: SequenceInput, row: int | None) -> int:
        """The sequence's row, claimed if it has none, cleared if its table was rebuilt (not grown)."""
        if row is None:
            row = self._row_of[seq.request_id] = self._free_rows.pop()
        else:
            known = self._num_blocks[row]
            table, offset = seq.block_table, seq.block_offset
            grown = (
                seq.epoch == self._epoch[row]
                and offset == self._offset[row]
                and offset + len(table) >= known
                and (
                    known == 0
                    or (
                        table[known - 1 - offset] == self._last_block[row]
                        and table[0] == self.block_tables[row, offset]
                    )
                )
            )
            if grown:
                return row
            self._clear(row)
        self._epoch[row] = seq.epoch
        self._offset[row] = seq.block_offset
        return row

    def _arrays(
        self,
        sequences: Sequence[SequenceInput],
        row_list: list[int],
        len_list: list[int],
        start_list: list[int],
        query_len_list: list[int],
        sampling_list: list[int],
        id_list: list[int],
        long_list: list[bool],
    ) -> StepInputs:
        n = len(sequences)
        block_size = self.block_size
        rows = np.array(row_list, dtype=np.int64)
        table_lens = np.array(len_list, dtype=np.int64)
        starts = np.array(start_list, dtype=np.int64)
        query_lens = np.array(query_len_list, dtype=np.int64)
        seq_lens = starts + query_lens
        if (seq_lens > table_lens * block_size).any():
            raise ValueError("a sequence's block table does not cover its tokens")
        num_tokens = len(id_list)
        max_query_len = max(query_len_list, default=0)
        if max_query_len == 1 and num_tokens == n:  # one token per sequence: decode only (the common step)
            query_start_loc = np.arange(n + 1, dtype=np.int64)
            positions, token_rows = starts, rows
            decode_index, prefill_index = np.arange(n, dtype=np.int64), np.zeros(0, dtype=np.int64)
        else:
            query_start_loc = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(query_lens, out=query_start_loc[1:])
            # Each token's position: its index in the flat batch, shifted by its sequence's offset.
            shift = np.repeat(starts - query_start_loc[:-1], query_lens)
            positions = np.arange(num_tokens, dtype=np.int64) + shift
            token_rows = np.repeat(rows, query_lens)
            decoding = query_lens == 1
            decode_index, prefill_index = np.flatnonzero(decoding), np.flatnonzero(~decoding)
        slot_mapping = self.block_tables[token_rows, positions // block_size] * block_size + positions % block_size
        long_rope = np.repeat(np.array(long_list, dtype=bool), query_lens) if any(long_list) else None
        return StepInputs(
            block_size=block_size,
            input_ids=np.array(id_list, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            table_lens=table_lens,
            rows=rows,
            block_tables=self.block_tables,
            sample_index=query_start_loc[1:][np.array(sampling_list, dtype=bool)] - 1,
            decode_index=decode_index,
            prefill_index=prefill_index,
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max(initial=0)),
            long_rope=long_rope,
        )

    def _clear(self, row: int) -> None:
        self.block_tables[row, : self._num_blocks[row]] = 0
        self._num_blocks[row] = 0
        self._offset[row] = 0

    def _grow(self, *, rows: int, width: int) -> None:
        # Rare (more sequences or longer tables than sized for): copy into a larger zeroed array.
        old_rows, old_width = self.block_tables.shape
        rows = max(rows, old_rows)
        grown = np.zeros((rows, max(width, old_width)), dtype=np.int64)
        grown[:old_rows, :old_width] = self.block_tables
        self.block_tables = grown
        added = rows - old_rows
        self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)  # below the old free rows: used last
        self._num_blocks += [0] * added
        self._last_block += [0] * added
        self._epoch += [0] * added
        self._offset += [0] * added


def step_inputs(sequences: Sequence[SequenceInput], block_size: int) -> StepInputs:
    """A step's arrays built from scratch (a fresh ``InputBatch``): for tests, benchmarks, one-off steps."""
    longest = max((s.block_offset + len(s.block_table) for s in sequences), default=1)
    batch = InputBatch(block_size, max_num_seqs=max(1, len(sequences)), max_blocks_per_seq=max(1, longest))
    return batch.prepare(sequences)
