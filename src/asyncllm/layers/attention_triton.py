"""Attention against the paged KV cache: the ``triton`` backend (kernels in ``asyncllm.kernels``).

Same cache layout and the same call shapes as the ``torch`` backend (``asyncllm.layers.attention``):
``write_kv(k_cache, v_cache, k, v, slots)`` and ``paged_attention(q, k_cache, v_cache, meta, scale)``,
plus ``apply_rotary_`` (rotary in place on q and k, one kernel). What differs is the metadata: instead
of per-sequence masks and gathered slot lists, ``TritonAttentionMetadata`` is four small integer
tensors (query offsets, sequence lengths, block tables, slot mapping), built once per step by
``build_metadata`` and shared by every layer; the kernels derive causal and sliding-window masks and
key slots from them on the device.

Importing this module does not import triton (so ``models/`` can refer to it on a CPU-only
install); the kernels are imported on first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.input_batch import StepInputs

__all__ = ["TritonAttentionMetadata", "apply_rotary_", "build_metadata", "paged_attention", "write_kv"]


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
    max_blocks = max(1, -(-max_seq_len // block_size))
    # One int32 buffer: [query_start_loc | seq_lens | block_tables | slot_mapping].
    table_at = 2 * num_seqs + 1
    slots_at = table_at + num_seqs * max_blocks
    packed = np.empty(slots_at + step.num_tokens, dtype=np.int32)
    packed[: num_seqs + 1] = step.query_start_loc
    packed[num_seqs + 1 : table_at] = step.seq_lens
    packed[table_at:slots_at].reshape(num_seqs, max_blocks)[:] = step.tables(None, max_blocks)
    packed[slots_at:] = step.slot_mapping
    host = torch.from_numpy(packed)
    on_device = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    if num_kv_splits is None:
        num_kv_splits = 1
        if device.type == "cuda" and max_query_len == 1:
            from asyncllm.kernels.split_kv_decode import num_kv_splits as decide

            num_kv_splits = decide(num_seqs, num_kv_heads, max_seq_len, _num_sms(device))
    return TritonAttentionMetadata(
        slot_mapping=on_device[slots_at:],
        query_start_loc=on_device[: num_seqs + 1],
        seq_lens=on_device[num_seqs + 1 : table_at],
        block_tables=on_device[table_at:slots_at].view(num_seqs, max_blocks),
        block_size=block_size,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_kv_splits=num_kv_splits,
        sliding_window=sliding_window,
    )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store a step's new keys and values ([tokens, kv_heads, head_dim]) at their slots."""
    from asyncllm.kernels.reshape_and_cache import reshape_and_cache

    reshape_and_cache(k, v, k_cache, v_cache, slots)


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q and k ([tokens, heads, head_dim]) in place by cos/sin of [tokens, head_dim]."""
    from asyncllm.kernels.rotary import rotary_embedding_

    rotary_embedding_(q, k, cos, sin)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: TritonAttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention of every query in the flat batch against its sequence's cached K/V.

    Args:
        q: [tokens, heads, head_dim] queries (rotary already applied).
        k_cache: [slots, kv_heads, head_dim] the layer's key cache, this step's keys written.
        v_cache: Like ``k_cache``, for values.
        meta: The step's metadata.
        scale: Softmax scale.

    Returns:
        [tokens, heads, head_dim] attention outputs.
    """
    args = (q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables)
    if meta.num_kv_splits > 1:
        from asyncllm.kernels.split_kv_decode import split_kv_attention

        return split_kv_attention(
            *args,
            block_size=meta.block_size,
            max_query_len=meta.max_query_len,
            scale=scale,
            num_splits=meta.num_kv_splits,
            sliding_window=meta.sliding_window,
        )
    from asyncllm.kernels.paged_attention import paged_attention as kernel

    return kernel(
        *args,
        block_size=meta.block_size,
        max_query_len=meta.max_query_len,
        scale=scale,
        sliding_window=meta.sliding_window,
    )
