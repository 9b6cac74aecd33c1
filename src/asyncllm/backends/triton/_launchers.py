"""Attention against the paged KV cache: the ``triton`` backend (kernels in ``asyncllm.backends.triton._kernels``).

Same cache layout and the same call shapes as the ``torch`` backend (``asyncllm.backends.torch._attention``):
``write_kv(k_cache, v_cache, k, v, slots)`` and ``paged_attention(q, k_cache, v_cache, meta, scale)``,
plus ``apply_rotary_`` (rotary in place on q and k, one kernel). What differs is the metadata: instead
of per-sequence masks and gathered slot lists, ``TritonAttentionMetadata`` is four small integer
tensors (query offsets, sequence lengths, block tables, slot mapping), built once per step by
``build_metadata`` and shared by every layer; the kernels derive causal and sliding-window masks and
key slots from them on the device. ``StaticDecodeMetadata`` holds the same integers in static buffers
for the CUDA graphs (``asyncllm.worker._graphs``). The backend object over these functions is
``asyncllm.backends.triton._backend``.

Importing this module does not import triton (so the backends can refer to it on a CPU-only
install); the kernels are imported on first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.worker._input_batch import StepInputs

__all__ = [
    "PackedLayout",
    "StaticDecodeMetadata",
    "TritonAttentionMetadata",
    "apply_rotary_",
    "build_metadata",
    "decode_kv_splits",
    "paged_attention",
    "write_kv",
]


@dataclass(frozen=True, slots=True)
class TritonAttentionMetadata:
    """What the triton kernels need to know about a step's flat batch (see ``kernels.paged_attention``)."""

    slot_mapping: torch.Tensor
    """[tokens] int32 the cache slot each new token's K/V is written to."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32 where each sequence's tokens start in the flat batch."""
    seq_lens: torch.Tensor
    """[num_seqs] int32 tokens cached per sequence once this step's are written."""
    block_tables: torch.Tensor
    """[num_seqs, max_blocks] int32 each sequence's physical blocks (zero-padded)."""
    block_size: int
    max_query_len: int
    """Host copy of the longest query (picks the kernel's tile shape; no device read)."""
    max_seq_len: int
    """Host copy of the longest context."""
    num_kv_splits: int
    """1: one program walks a sequence's whole context; more: the split-KV (flash-decoding) kernels."""
    sliding_window: int | None = None


@functools.cache
def _num_sms(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def decode_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """The split-KV parts for a decode-only batch: more than 1 only on CUDA, where the batch alone
    would leave the GPU idle (``kernels.split_kv_decode.num_kv_splits``)."""
    if device.type != "cuda":
        return 1
    from asyncllm.backends.triton._kernels.split_kv_decode import num_kv_splits as decide
    return decide(num_seqs, num_kv_heads, max_seq_len, _num_sms(device))


_ALIGN = 16
"""Elements every section of the packed buffer starts on, and block-table widths are rounded up to."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def table_width(max_seq_len: int, block_size: int) -> int:
    """Block-table columns for contexts up to ``max_seq_len``: the blocks, rounded up to 16.

    Rounded so that the tables' row stride, which the kernels take as an argument, is a multiple of
    16 at every length: triton specialises an integer argument on divisibility by 16, and a width
    that follows the context would compile a second variant of each kernel mid-serving.
    """
    return _aligned(max(1, -(-max_seq_len // block_size)))


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Where the metadata's integers lie in one int32 buffer (one copy to the device moves them all):
    ``[query_start_loc (capacity + 1) | seq_lens (capacity) | block_tables (capacity * max_blocks) |
    slot_mapping (tokens)]``, each section starting on a multiple of 16 elements. A step's own buffer
    has ``capacity`` its sequences; the CUDA graphs' static one the largest batch, and a smaller batch
    uses its first rows.

    Sections are aligned because triton specialises a pointer argument on 16-byte alignment: slices
    at offsets that follow the batch size would compile a variant per alignment.
    """

    capacity: int
    max_blocks: int
    tokens: int

    @property
    def seq_lens_at(self) -> int:
        return _aligned(self.capacity + 1)

    @property
    def tables_at(self) -> int:
        return self.seq_lens_at + _aligned(self.capacity)

    @property
    def slots_at(self) -> int:
        return self.tables_at + self.capacity * self.max_blocks

    @property
    def size(self) -> int:
        return self.slots_at + _aligned(self.tokens)

    def metadata(
        self,
        buffer: torch.Tensor,
        num_seqs: int,
        num_tokens: int,
        *,
        block_size: int,
        max_query_len: int,
        max_seq_len: int,
        num_kv_splits: int,
        sliding_window: int | None,
    ) -> TritonAttentionMetadata:
        """The metadata of the first ``num_seqs`` sequences and ``num_tokens`` tokens, as views into ``buffer``."""
        slots_at, tables_at, seq_lens_at = self.slots_at, self.tables_at, self.seq_lens_at
        return TritonAttentionMetadata(
            slot_mapping=buffer[slots_at : slots_at + num_tokens],
            query_start_loc=buffer[: num_seqs + 1],
            seq_lens=buffer[seq_lens_at : seq_lens_at + num_seqs],
            block_tables=buffer[tables_at:slots_at].view(self.capacity, self.max_blocks)[:num_seqs],
            block_size=block_size,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_kv_splits=num_kv_splits,
            sliding_window=sliding_window,
        )


def build_metadata(
    step: StepInputs,
    *,
    num_kv_heads: int,
    device: torch.device,
    sliding_window: int | None = None,
    num_kv_splits: int | None = None,
) -> TritonAttentionMetadata:
    """Build a step's metadata on the host and move it to the device in one copy.

    On CUDA the integers are packed into one pinned host buffer and copied with ``non_blocking=True``,
    so building the metadata never waits for the device.

    Args:
        step: The step's arrays (``InputBatch.prepare``).
        num_kv_heads: The model's KV heads (sizes the split-KV decision).
        device: Where the kernels run.
        sliding_window: The model's sliding window, if any.
        num_kv_splits: Force the number of KV splits; None decides: split only decode-only steps
            whose batch is too small to fill the GPU (never on the CPU).
    """
    num_seqs = step.num_seqs
    block_size = step.block_size
    max_query_len, max_seq_len = step.max_query_len, step.max_seq_len
    used = max(1, -(-max_seq_len // block_size))
    max_blocks = table_width(max_seq_len, block_size)
    layout = PackedLayout(num_seqs, max_blocks, step.num_tokens)
    seq_lens_at, table_at, slots_at = layout.seq_lens_at, layout.tables_at, layout.slots_at
    packed = np.zeros(layout.size, dtype=np.int32)
    packed[: num_seqs + 1] = step.query_start_loc
    packed[seq_lens_at : seq_lens_at + num_seqs] = step.seq_lens
    packed[table_at:slots_at].reshape(num_seqs, max_blocks)[:, :used] = step.tables(None, used)
    packed[slots_at : slots_at + step.num_tokens] = step.slot_mapping
    host = torch.from_numpy(packed)
    on_device = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    if num_kv_splits is None:
        decode_only = max_query_len == 1
        num_kv_splits = decode_kv_splits(num_seqs, num_kv_heads, max_seq_len, device) if decode_only else 1
    return layout.metadata(
        on_device,
        num_seqs,
        step.num_tokens,
        block_size=block_size,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_kv_splits=num_kv_splits,
        sliding_window=sliding_window,
    )


class StaticDecodeMetadata:
    """A decode batch's metadata in static device buffers, refilled before each CUDA-graph replay.

    A graph replays fixed addresses, so its metadata are views into one int32 device buffer in
    ``PackedLayout`` for ``max_batch`` sequences of one token. Rows past a step's sequences are
    padding: one-token sequences at position 0 with slot -1, which the KV-write kernel skips; they
    attend to one (finite) cache slot. Block tables are ``max_blocks`` wide, rounded up to 16
    (``table_width``).

    A step sends only what it uses: the sequence lengths and slots of every row (padding included,
    ``2 * max_batch`` ints) and, of the block tables, its rows by the blocks its longest context
    uses, staged compactly and scattered into the wide tables on the device. Entries past that prefix
    keep what an earlier step wrote (or 0): block ids of this cache. A real row reads only the blocks
    its length covers, all in the prefix; a padding row reads its first entry, some block of the cache,
    whose slots hold finite values, and its output is dropped.

    Args:
        max_batch: The largest batch (the buffers' rows).
        max_blocks: The block-table width: the longest sequence's blocks.
        block_size: Tokens per KV block.
        device: Where the graphs run.
        sliding_window: The model's sliding window, if any.
    """

    def __init__(
        self, *, max_batch: int, max_blocks: int, block_size: int, device: torch.device, sliding_window: int | None
    ) -> None:
        self.layout = PackedLayout(max_batch, _aligned(max_blocks), max_batch)
        self.block_size = block_size
        self.sliding_window = sliding_window
        layout, b = self.layout, max_batch
        initial = np.zeros(layout.size, dtype=np.int32)
        initial[: b + 1] = np.arange(b + 1, dtype=np.int32)  # decode rows: one query each (never changes)
        initial[layout.seq_lens_at : layout.tables_at] = 1
        initial[layout.slots_at :] = -1
        self._device = torch.from_numpy(initial).to(device)
        self._staged = np.zeros(0, dtype=np.int32)
        self._rows = 0
        self._width = 0
        self.table_entries_uploaded = 0
        """Block-table entries the last ``upload`` copied: the step's rows times the blocks it uses."""

    def fill(self, step: StepInputs) -> None:
        """Stage a decode-only step (at most ``max_batch`` sequences), padded, for the next ``upload``.

        The staging array is the step's own: the previous ``upload``'s copy need not have read its own.
        """
        n, b = step.num_seqs, self.layout.capacity
        width = max(1, -(-step.max_seq_len // self.block_size))
        staged = np.empty(2 * b + n * width, dtype=np.int32)
        staged[:n] = step.seq_lens
        staged[n:b] = 1
        staged[b : b + n] = step.slot_mapping
        staged[b + n : 2 * b] = -1
        staged[2 * b :].reshape(n, width)[:] = step.tables(None, width)
        self._staged, self._rows, self._width = staged, n, width

    def upload(self, non_blocking: bool) -> None:
        """Copy the staged step to the buffers the graphs read: one host-to-device copy of the staged
        ints, then three copies on the device (lengths, slots, the tables' used prefix)."""
        layout, b = self.layout, self.layout.capacity
        n, width = self._rows, self._width
        host = torch.from_numpy(self._staged)
        staged = host.pin_memory().to(self._device.device, non_blocking=True) if non_blocking else host.to(
            self._device.device
        )
        self._device[layout.seq_lens_at : layout.seq_lens_at + b].copy_(staged[:b])
        self._device[layout.slots_at : layout.slots_at + b].copy_(staged[b : 2 * b])
        tables = self._device[layout.tables_at : layout.slots_at].view(b, layout.max_blocks)
        tables[:n, :width].copy_(staged[2 * b :].view(n, width))
        self.table_entries_uploaded = n * width

    def metadata(self, size: int, splits: int) -> TritonAttentionMetadata:
        """The metadata of a graph for ``size`` sequences with ``splits`` KV splits (views: stable addresses)."""
        layout = self.layout
        return layout.metadata(
            self._device,
            size,
            size,
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=layout.max_blocks * self.block_size,
            num_kv_splits=splits,
            sliding_window=self.sliding_window,
        )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store a step's new keys and values ([tokens, kv_heads, head_dim]) at their slots."""
    from asyncllm.backends.triton._kernels.reshape_and_cache import reshape_and_cache
    reshape_and_cache(k, v, k_cache, v_cache, slots)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q and k ([tokens, heads, head_dim]) in place by cos/sin of [tokens, head_dim]."""
    from asyncllm.backends.triton._kernels.rotary import rotary_embedding_
    rotary_embedding_(q, k, cos, sin)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TritonAttentionMetadata,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of every query in the flat batch against its sequence's cached K/V.

    Args:
        q: [tokens, heads, head_dim] queries (rotary already applied).
        k_cache: [slots, kv_heads, head_dim] the layer's key cache, this step's keys written.
        v_cache: Like ``k_cache``, for values.
        meta: The step's metadata.
        scale: Softmax scale.
        softcap: Soft-cap the scores before the softmax (gemma2); None: not.

    Returns:
        [tokens, heads, head_dim] attention outputs.
    """
    args = (q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    if meta.num_kv_splits > 1:
        from asyncllm.backends.triton._kernels.split_kv_decode import split_kv_attention
        return split_kv_attention(
            *args,
            block_size=meta.block_size,
            max_query_len=meta.max_query_len,
            scale=scale,
            num_splits=meta.num_kv_splits,
            sliding_window=meta.sliding_window,
            softcap=softcap,
        )
    from asyncllm.backends.triton._kernels.paged_attention import paged_attention as kernel
    return kernel(
        *args,
        block_size=meta.block_size,
        max_query_len=meta.max_query_len,
        scale=scale,
        sliding_window=meta.sliding_window,
        softcap=softcap,
    )
