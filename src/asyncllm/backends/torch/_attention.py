"""Attention against the paged KV cache: the ``torch`` reference backend.

The KV cache of a layer is two tensors of shape [num_blocks * block_size, kv_heads, head_dim]
(flattened over blocks, so a slot index addresses one token). A step's flat batch mixes prefill
chunks and single decode tokens: decode tokens are attended together as one padded batch, prefill
chunks one sequence at a time. ``build_metadata`` makes a step's ``AttentionMetadata`` once per step;
every layer reuses it. The backend object over these functions is ``asyncllm.backends.torch._backend``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from asyncllm.worker._input_batch import StepInputs


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """A sequence that feeds more than one token this step."""

    query_start: int
    query_end: int
    kv_slots: torch.Tensor
    """[kv_len] slot of every cached token the chunk attends to, its own new tokens included."""
    mask: torch.Tensor
    """[query_len, kv_len] True where a query may attend (causal, sliding window)."""


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each query attends to."""

    slot_mapping: torch.Tensor
    """[tokens] the cache slot each new token's K/V is written to."""
    decode_token_index: torch.Tensor
    """[decodes] positions in the flat batch of single-token queries."""
    decode_kv_slots: torch.Tensor
    """[decodes, kv_len] slots each decode query attends to, padded: its whole context, or with a sliding
    window only the window (``kv_len`` at most the window), so positions before it are never read."""
    decode_mask: torch.Tensor
    """[decodes, 1, 1, kv_len] True on real (unpadded, in-window) slots."""
    prefills: tuple[PrefillChunk, ...]
    """Each chunk's slots start at the window of its first query (with a sliding window)."""
    global_decode_mask: torch.Tensor | None = None
    """``decode_mask`` without the sliding window, for a model's global layers; None: no window (the same)."""
    global_prefills: tuple[PrefillChunk, ...] | None = None
    """``prefills`` over the whole context with causal masks only, for a model's global layers; None: no
    window (the same)."""
    global_decode_kv_slots: torch.Tensor | None = None
    """``decode_kv_slots`` over the whole context, for a model's global layers; None: no window (the same)."""


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store a step's new keys and values ([tokens, kv_heads, head_dim]) at their slots.

    A cache narrower than the rows (bfloat16 beside float32 activations) gets them rounded, and ``k`` and ``v``
    are rounded in place too: attention then reads the same values from the cache and from the step's rows.
    """
    if k_cache.dtype != k.dtype:
        k_low, v_low = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k.copy_(k_low)
        v.copy_(v_low)
        k, v = k_low, v_low
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def sdpa(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` ([batch, heads, len, head_dim], grouped-query), or with ``softcap``
    the scores soft-capped before the softmax, as HF's eager attention computes them (SDPA has no soft-cap).

    Args:
        mask: [..., q_len, kv_len] True where a query may attend; None: causal (the queries are the last keys).
    """
    if softcap is None:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(queries, keys.transpose(-2, -1)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        q_len, kv_len = queries.shape[-2], keys.shape[-2]
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=queries.device).tril(kv_len - q_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(weights, values)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    sliding: bool = True,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of every query in the flat batch against its sequence's cached K/V.

    Args:
        q: [tokens, heads, head_dim] queries (rotary already applied).
        k_cache: [slots, kv_heads, head_dim] the layer's key cache, this step's keys written.
        v_cache: Like ``k_cache``, for values.
        meta: The step's attention metadata.
        scale: Softmax scale (usually head_dim ** -0.5).
        sliding: Apply the metadata's sliding window (False: a global layer of a model with one).
        softcap: Soft-cap the scores before the softmax (``sdpa``); None: not.

    Returns:
        [tokens, heads, head_dim] attention outputs.
    """
    out = torch.empty_like(q)
    decode_slots, decode_mask, prefills = meta.decode_kv_slots, meta.decode_mask, meta.prefills
    if not sliding and meta.global_decode_mask is not None and meta.global_decode_kv_slots is not None:
        decode_slots, decode_mask = meta.global_decode_kv_slots, meta.global_decode_mask
    if not sliding and meta.global_prefills is not None:
        prefills = meta.global_prefills
    if meta.decode_token_index.numel():
        queries = q[meta.decode_token_index].unsqueeze(2)  # [decodes, heads, 1, head_dim]
        keys = k_cache[decode_slots].transpose(1, 2)  # [decodes, kv_heads, kv_len, head_dim]
        values = v_cache[decode_slots].transpose(1, 2)
        attended = sdpa(queries, keys, values, decode_mask, scale, softcap)
        out[meta.decode_token_index] = attended.squeeze(2)
    for chunk in prefills:
        queries = q[chunk.query_start : chunk.query_end].transpose(0, 1).unsqueeze(0)
        keys = k_cache[chunk.kv_slots].transpose(0, 1).unsqueeze(0)
        values = v_cache[chunk.kv_slots].transpose(0, 1).unsqueeze(0)
        attended = sdpa(queries, keys, values, chunk.mask, scale, softcap)
        out[chunk.query_start : chunk.query_end] = attended.squeeze(0).transpose(0, 1)
    return out


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """A sequence that feeds more than one token this step."""

    query_start: int
    query_end: int
    start_position: int
    """Position of its first new token: the tokens cached before it."""
    block_table: np.ndarray[Any, Any]
    """int64 its blocks (possibly followed by zeros): a row of ``StepInputs.block_tables``."""

    @property
    def kv_len(self) -> int:
        """Tokens it attends to, its own new ones included."""
        return self.start_position + self.query_end - self.query_start


@dataclass(frozen=True, slots=True)
class StepSplit:
    """A step's sequences split the way every attention backend needs them: single-token queries
    (decodes, attended as one padded batch) and longer chunks (prefills, one at a time)."""

    decode_rows: np.ndarray[Any, Any]
    """[decodes] int64 flat-batch row of each decode query."""
    decode_lens: np.ndarray[Any, Any]
    """[decodes] int64 context length of each decode (its new token included)."""
    decode_tables: np.ndarray[Any, Any]
    """[decodes, max_blocks] int64 block tables, zero-padded (at least one column)."""
    max_decode_len: int
    prefills: list[PrefillSpan]


SHORT_CHUNK_TOKENS = 17
"""A chunk of at most this many tokens that continues a cached context (a speculative draft after its
request's newest token: at most 16 + 1) is attended as that many decode queries, each over the context up
to its own position: the decode kernels read the cache in place, where a chunk would gather its context."""


def split_step(step: StepInputs) -> StepSplit:
    """Split a step into decodes and prefill chunks, with padded decode block tables (gathered, no loop
    over decodes; the loop is over prefill chunks, a few per step). Short chunks after a cached context
    (``SHORT_CHUNK_TOKENS``) count as one decode per token."""
    decodes = step.decode_index
    starts, chunks = step.query_start_loc, step.prefill_index
    decode_rows, decode_lens = starts[decodes], step.seq_lens[decodes]
    if len(chunks):
        lengths = starts[chunks + 1] - starts[chunks]
        short = (step.positions[starts[chunks]] > 0) & (lengths <= SHORT_CHUNK_TOKENS)
        if short.any():
            # Each token of a short chunk: its row, its own context length, its sequence's table.
            rows = np.concatenate([np.arange(starts[c], starts[c + 1]) for c in chunks[short]])
            decode_rows = np.concatenate((decode_rows, rows))
            decode_lens = np.concatenate((decode_lens, step.positions[rows] + 1))
            decodes = np.concatenate((decodes, np.repeat(chunks[short], lengths[short])))
            chunks = chunks[~short]
    max_len = int(decode_lens.max(initial=0))
    tables = step.tables(decodes, max(1, -(-max_len // step.block_size)))
    prefills = [
        PrefillSpan(begin, end, position, step.block_tables[row])
        for begin, end, position, row in zip(
            starts[chunks].tolist(),
            starts[chunks + 1].tolist(),
            step.positions[starts[chunks]].tolist(),
            step.rows[chunks].tolist(),
        )
    ]
    return StepSplit(decode_rows, decode_lens, tables, max_len, prefills)


def build_metadata(step: StepInputs, sliding_window: int | None, device: torch.device) -> AttentionMetadata:
    """The ``torch`` backend's metadata for a step: explicit slots and masks, per prefill chunk and for the decodes.

    With a sliding window the sliding layers' slots start at the window of each sequence's first query
    of the step: the positions before it are never read (their blocks may have gone back to the pool,
    ``SequenceInput.block_offset``), and a decode gathers at most the window, not its whole context.
    The global layers' versions (a model with both kinds) cover the whole context.

    Args:
        step: The step's arrays (``InputBatch.prepare``).
        sliding_window: The model's sliding window, or None.
        device: Where the model runs (the tensors are copied there).
    """
    split = split_step(step)
    block_size = step.block_size
    prefills = [_prefill_chunk(span, block_size, sliding_window, device) for span in split.prefills]
    lens = split.decode_lens[:, None]
    kv_positions = np.arange(split.max_decode_len, dtype=np.int64)
    full_slots = split.decode_tables[:, kv_positions // block_size] * block_size + kv_positions % block_size
    unpadded = kv_positions[None, :] < lens
    if sliding_window is None:
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
            decode_token_index=torch.from_numpy(split.decode_rows).to(device),
            decode_kv_slots=torch.from_numpy(full_slots).to(device),
            decode_mask=torch.from_numpy(unpadded[:, None, None, :].copy()).to(device),
            prefills=tuple(prefills),
        )
    # Each decode's window: its last ``sliding_window`` positions (padded past its length).
    window = np.maximum(lens - sliding_window, 0) + np.arange(min(split.max_decode_len, sliding_window))
    window_slots = np.take_along_axis(split.decode_tables, window // block_size, axis=1) * block_size
    window_slots += window % block_size
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(step.slot_mapping).to(device),
        decode_token_index=torch.from_numpy(split.decode_rows).to(device),
        decode_kv_slots=torch.from_numpy(window_slots).to(device),
        decode_mask=torch.from_numpy((window < lens)[:, None, None, :].copy()).to(device),
        prefills=tuple(prefills),
        global_decode_mask=torch.from_numpy(unpadded[:, None, None, :].copy()).to(device),
        global_prefills=tuple(_prefill_chunk(span, block_size, None, device) for span in split.prefills),
        global_decode_kv_slots=torch.from_numpy(full_slots).to(device),
    )


def _prefill_chunk(
    span: PrefillSpan, block_size: int, sliding_window: int | None, device: torch.device
) -> PrefillChunk:
    """A chunk's slots and mask: from the window of its first query (with a window), else from position 0."""
    first = 0 if sliding_window is None else max(0, span.start_position - sliding_window + 1)
    kv_positions = np.arange(first, span.kv_len, dtype=np.int64)
    kv_slots = span.block_table[kv_positions // block_size] * block_size + kv_positions % block_size
    query_positions = np.arange(span.start_position, span.kv_len, dtype=np.int64)
    mask = kv_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        mask &= kv_positions[None, :] > query_positions[:, None] - sliding_window
    return PrefillChunk(
        span.query_start, span.query_end, torch.from_numpy(kv_slots).to(device), torch.from_numpy(mask).to(device)
    )
