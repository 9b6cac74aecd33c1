"""Split-KV (flash-decoding) paged attention: long contexts spread over several programs, then a reduce.

At decode time each sequence has one query row per head, so ``paged_attention``'s grid is only
``num_seqs * kv_heads`` programs; at batch 1 with a 4096-token context a GPU with 132 SMs would
sit mostly idle while a handful of programs walk the whole context. Here a third grid axis cuts each
sequence's key range into ``num_splits`` contiguous parts: each program folds its part into a partial
softmax state (running max and sum in base 2, unnormalised output), and a reduce kernel merges the
parts of every (token, head) with the usual log-sum-exp rescaling.

The metadata and the query tiling are ``paged_attention``'s, and so is a program's work: both kernels
call ``paged_attention.attend_query_block`` (query tile, online softmax over the key tiles), this
one for its split's share of the tiles, and differ only in what they store. The same launch also
serves a mixed batch (prefill rows just get split too); the runner only picks it for decode-heavy
steps with long contexts, where it pays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncllm.backends.triton._kernels.paged_attention import (
    _LOG2E,
    attend_query_block,
    check_shapes,
    check_softcap,
    dot_dtype,
    dot_precision,
    launch_config,
    locate_query_block,
)

__all__ = ["MAX_KV_SPLITS", "num_kv_splits", "split_kv_attention"]


# The split count and the batch's sizes are runtime values, not specialised on: one compiled
# variant serves every step of a model (see ``variants``).
@triton.jit(do_not_specialize=["num_seqs", "sliding_window", "num_splits"])
def _split_kv_kernel(
    acc_ptr,
    max_ptr,
    sum_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    scale_log2e,
    sliding_window,
    stride_acc_split,
    stride_acc_tok,
    stride_acc_head,
    stride_ms_split,
    stride_ms_tok,
    stride_q_tok,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    num_splits,
    softcap,  # last: amid the others, ptxas gave a variant without the cap 3 more registers
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq, q_block_local, q_len = locate_query_block(query_start_loc_ptr, num_seqs, BLOCK_Q)
    if q_block_local * BLOCK_Q >= q_len:
        return
    split = tl.program_id(2)
    # An empty split (trailing, of a short sequence) records max -inf and sum 0: the reduce weighs it by zero.
    m_i, l_i, acc, token, head, row_valid, offs_d, _d_mask = attend_query_block(
        q_ptr, k_cache_ptr, v_cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
        seq, q_block_local, tl.program_id(1), split, scale_log2e, sliding_window, softcap,
        stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_bt_seq,
        num_splits, QUERIES_PER_KV, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_Q, TILE_N, SLIDING,
        SOFTCAP, DOT_DTYPE, DOT_PRECISION,
    )  # fmt: skip
    token64 = token.to(tl.int64)
    tl.store(
        acc_ptr + split * stride_acc_split + token64[:, None] * stride_acc_tok + head[:, None] * stride_acc_head
        + offs_d[None, :],
        acc,
        mask=row_valid[:, None],
    )  # fmt: skip
    state = split * stride_ms_split + token64 * stride_ms_tok + head
    tl.store(max_ptr + state, m_i, mask=row_valid)
    tl.store(sum_ptr + state, l_i, mask=row_valid)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    out_ptr,
    acc_ptr,
    max_ptr,
    sum_ptr,
    stride_o_tok,
    stride_o_head,
    stride_acc_split,
    stride_acc_tok,
    stride_acc_head,
    stride_ms_split,
    stride_ms_tok,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    state = offs_s * stride_ms_split + token * stride_ms_tok + head
    m = tl.load(max_ptr + state, mask=s_mask, other=float("-inf"))
    l_s = tl.load(sum_ptr + state, mask=s_mask, other=0.0)
    m_all = tl.max(m, 0)
    # Every query attends at least to itself, so some split is non-empty and m_all is finite.
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))
    acc = tl.load(
        acc_ptr + offs_s[:, None] * stride_acc_split + token * stride_acc_tok + head * stride_acc_head
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # fmt: skip
    total = tl.sum(weight * l_s, 0)
    out = tl.sum(acc * weight[:, None], 0) / total
    out_row = out_ptr + token * stride_o_tok + head * stride_o_head
    tl.store(out_row + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


MAX_KV_SPLITS = 64
"""The most parts a context is split into."""


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *, min_tokens: int = 256) -> int:
    """How many parts to split each context into so that about two waves of programs fill the device.

    A power of two (the reduce kernel is compiled once per power, ``variants``), at most
    ``MAX_KV_SPLITS``. Returns 1 (do not split) when the batch alone fills the device or contexts
    are short.

    Args:
        num_seqs: Sequences in the (decode) batch.
        num_kv_heads: KV heads of the model; each is its own program.
        max_seq_len: The longest context of the batch.
        num_sms: Streaming multiprocessors of the device.
        min_tokens: The fewest keys a split should walk (smaller ones cost more than they save).
    """
    programs = num_seqs * num_kv_heads
    if programs >= num_sms or max_seq_len < 2 * min_tokens:
        return 1
    wanted = min(-(-2 * num_sms // programs), max_seq_len // min_tokens, MAX_KV_SPLITS)
    return 1 << (wanted.bit_length() - 1)  # rounded down: no split walks fewer than min_tokens keys


def split_kv_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    block_size: int,
    max_query_len: int,
    scale: float,
    num_splits: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """``paged_attention`` with every sequence's keys split over ``num_splits`` programs, then reduced.

    Args and Returns are those of ``asyncllm.backends.triton._kernels.paged_attention.paged_attention``, plus:

    Args:
        num_splits: Parts each sequence's key range is cut into (see ``num_kv_splits``).
    """
    num_heads, num_kv_heads, head_dim, queries_per_kv = check_shapes(q, k_cache, v_cache)
    check_softcap(softcap)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    if num_tokens == 0:
        return out
    config = launch_config(queries_per_kv, max_query_len, head_dim, k_cache.dtype, block_m=block_m, tile_n=tile_n)
    head_dim_pad = triton.next_power_of_2(head_dim)
    acc = torch.empty(num_splits, num_tokens, num_heads, head_dim_pad, dtype=torch.float32, device=q.device)
    # Heads padded to 16 columns: the strides stay multiples of 16 whatever the batch, so triton's
    # divisibility specialisation of them never changes (one compiled variant).
    maxes = torch.empty(num_splits, num_tokens, -(-num_heads // 16) * 16, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    grid = (num_tokens // config.block_q + num_seqs, num_kv_heads, num_splits)
    _split_kv_kernel[grid](
        acc, maxes, sums, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        num_seqs, scale * _LOG2E, sliding_window or 0,
        acc.stride(0), acc.stride(1), acc.stride(2), maxes.stride(0), maxes.stride(1),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0),
        num_splits, softcap or 0.0, QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_M=config.block_m, BLOCK_Q=config.block_q, TILE_N=config.tile_n,
        SLIDING=sliding_window is not None, SOFTCAP=softcap is not None, DOT_DTYPE=dot_dtype(k_cache.dtype),
        DOT_PRECISION=dot_precision(k_cache.dtype), num_warps=config.num_warps,
    )  # fmt: skip
    _reduce_kernel[(num_tokens, num_heads)](
        out, acc, maxes, sums, out.stride(0), out.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2), maxes.stride(0), maxes.stride(1),
        num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
    )  # fmt: skip
    return out
