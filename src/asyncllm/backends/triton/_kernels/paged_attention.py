"""Paged attention for one flat mixed batch (prefill chunks and decode tokens together).

The batch is described by the metadata the runner builds once per step:

- ``query_start_loc`` [num_seqs + 1] int32: sequence ``s`` owns query rows
  ``query_start_loc[s] : query_start_loc[s + 1]`` of ``q`` (a decode token is a 1-row sequence).
- ``seq_lens`` [num_seqs] int32: tokens in the cache for ``s`` once this step's K/V is written
  (its cached context plus its new tokens). Query ``i`` of ``s`` sits at position
  ``seq_lens[s] - query_len + i`` and attends to every cached position up to and including its own
  (and, with a sliding window ``w``, only to the last ``w`` of them).
- ``block_tables`` [num_seqs, max_blocks] int32: the physical KV blocks of ``s``; position ``p`` is
  at cache slot ``block_tables[s, p // block_size] * block_size + p % block_size``.

The cache of a layer is ``[num_blocks * block_size, kv_heads, head_dim]`` (one slot per token), as
in ``asyncllm.backends.torch._attention``.

How the work is cut (the layout of vLLM's unified Triton attention): a program handles one KV head
and ``BLOCK_Q`` consecutive queries of one sequence, with the ``queries_per_kv`` query heads that
share the KV head packed into the same tile of ``BLOCK_M = BLOCK_Q * queries_per_kv`` rows, so each
KV tile is loaded once for all of them (GQA and MQA cost no extra KV traffic). Sequence ``s`` owns
the query blocks from ``query_start_loc[s] // BLOCK_Q + s`` on; a program finds its sequence by a
binary search over ``query_start_loc``, so the grid (``num_tokens // BLOCK_Q + num_seqs`` by
``kv_heads``) is known on the host without reading anything back from the device, which also
keeps the launch capturable in a CUDA graph. Keys are visited in tiles of ``TILE_N`` positions that
need not line up with the cache's blocks (each key's slot is looked up through the block table),
with an online softmax in base 2. Head sizes that are not powers of two (80, 96) are padded to the
next one and masked. A model that soft-caps its scores (gemma2) runs the ``SOFTCAP`` variant, the cap a
runtime argument; the others run kernels compiled without it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from asyncllm.backends.triton._kernels import interpreting

__all__ = [
    "SUPPORTED_HEAD_SIZES",
    "LaunchConfig",
    "check_softcap",
    "dot_dtype",
    "dot_precision",
    "launch_config",
    "paged_attention",
]

SUPPORTED_HEAD_SIZES = (64, 80, 96, 128, 256)
_LOG2E = 1.4426950408889634


@triton.jit
def find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query block ``q_block``: the last ``s`` with ``qsl[s] // BLOCK_Q + s <= q_block``."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def attend_tiles(
    q,
    q_pos,
    row_valid,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    tile_lo,
    tile_hi,
    kv_begin,
    kv_end,
    scale_log2e,
    sliding_window,
    softcap,
    offs_d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold the key tiles ``tile_lo .. tile_hi`` into the running softmax state (m_i, l_i, acc).

    Positions before ``kv_begin`` (a sliding window's start, in the first tile) are not loaded: their
    blocks may have gone back to the pool, their block-table entries zeroed. With ``SOFTCAP`` every
    score ``x`` becomes ``softcap * tanh(x / softcap)`` before the mask (gemma2)."""
    offs_n = tl.arange(0, TILE_N)
    # The scores are in base 2 (x * log2e): capped, they are cap_log2e * tanh(x / cap), and triton has no
    # tanh: tanh(y) = 1 - 2 / (e^(2y) + 1), where e^(2 x / cap) = 2^(s * 2 / cap) for s = x * log2e. An
    # overflowing power gives 1 (the cap), an underflowing one -1: no NaN.
    if SOFTCAP:
        cap_log2e = softcap * 1.4426950408889634
        two_over_cap = 2.0 / softcap
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * TILE_N + offs_n
        kv_valid = kv_pos < kv_end
        if SLIDING:
            kv_valid = kv_valid & (kv_pos >= kv_begin)
        block = tl.load(block_table_ptr + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + kv_pos % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + slot[None, :] * stride_k_slot + kv_head * stride_k_head + offs_d[:, None],
            mask=kv_valid[None, :] & d_mask[:, None],
            other=0.0,
        )
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * scale_log2e
        if SOFTCAP:
            s = cap_log2e * (1.0 - 2.0 / (tl.exp2(s * two_over_cap) + 1.0))
        allowed = row_valid[:, None] & kv_valid[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if SLIDING:
            allowed = allowed & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no allowed key yet keeps m = -inf; shift by 0 there instead of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + slot[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
            mask=kv_valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def query_tile(
    q_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    seq,
    q_block_local,
    kv_head,
    stride_q_tok,
    stride_q_head,
    sliding_window,
    offs_d,
    d_mask,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Load a program's query tile; return it with its rows' token index, head, position, the key tile range
    and the first and past-the-last key positions any row may attend to."""
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    context_len = tl.load(seq_lens_ptr + seq) - q_len
    offs_m = tl.arange(0, BLOCK_M)
    q_index = q_block_local * BLOCK_Q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_index < q_len)
    token = q_start + q_index
    q_pos = context_len + q_index
    q = tl.load(
        q_ptr + token[:, None].to(tl.int64) * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    # Causal: the block's last query sees up to its own position; nothing later is ever loaded.
    kv_end = context_len + tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len)
    kv_begin = 0
    if SLIDING:
        kv_begin = tl.maximum(context_len + q_block_local * BLOCK_Q - sliding_window + 1, 0)
    return q, token, head, row_valid, q_pos, kv_begin // TILE_N, tl.cdiv(kv_end, TILE_N), kv_begin, kv_end


@triton.jit
def locate_query_block(query_start_loc_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    """This program's sequence, its query block within that sequence, and the sequence's query count."""
    q_block = tl.program_id(0)
    seq = find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    return seq, q_block_local, q_len


@triton.jit
def attend_query_block(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    seq,
    q_block_local,
    kv_head,
    split,
    scale_log2e,
    sliding_window,
    softcap,
    stride_q_tok,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    num_splits,
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
    """One program's work, shared by both attention kernels: its query tile against part ``split`` of
    ``num_splits`` of the key tiles it may see (all of them for 1; a runtime value, so one compiled
    split kernel serves every split count). Returns the unnormalised softmax
    state (m_i, l_i, acc) and what the caller needs to store it: the rows' token, head and validity,
    and the head-dimension offsets and mask."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q, token, head, row_valid, q_pos, tile_lo, tile_hi, kv_begin, kv_end = query_tile(
        q_ptr, query_start_loc_ptr, seq_lens_ptr, seq, q_block_local, kv_head, stride_q_tok, stride_q_head,
        sliding_window, offs_d, d_mask, QUERIES_PER_KV, BLOCK_M, BLOCK_Q, TILE_N, SLIDING, DOT_DTYPE,
    )  # fmt: skip
    # This split's share of the key tiles; trailing splits of a short sequence get none and keep an
    # empty state (max -inf, sum 0). With one split the share is every tile.
    per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
    my_lo = tile_lo + split * per_split
    my_hi = tl.minimum(my_lo + per_split, tile_hi)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    m_i, l_i, acc = attend_tiles(
        q, q_pos, row_valid, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt_seq,
        kv_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, my_lo, my_hi, kv_begin, kv_end,
        scale_log2e, sliding_window, softcap, offs_d, d_mask, BLOCK_SIZE, TILE_N, SLIDING, SOFTCAP, DOT_DTYPE,
        DOT_PRECISION,
    )  # fmt: skip
    return m_i, l_i, acc, token, head, row_valid, offs_d, d_mask


# Sizes that change from step to step are not specialised on (triton would compile a variant for a
# value of 1 and one for multiples of 16), so a model's shapes alone decide which variants exist.
@triton.jit(do_not_specialize=["num_seqs", "sliding_window"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    scale_log2e,
    sliding_window,
    stride_o_tok,
    stride_o_head,
    stride_q_tok,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
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
    _m_i, l_i, acc, token, head, row_valid, offs_d, d_mask = attend_query_block(
        q_ptr, k_cache_ptr, v_cache_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
        seq, q_block_local, tl.program_id(1), 0, scale_log2e, sliding_window, softcap,
        stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_bt_seq,
        1, QUERIES_PER_KV, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_Q, TILE_N, SLIDING, SOFTCAP,
        DOT_DTYPE, DOT_PRECISION,
    )  # fmt: skip
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None].to(tl.int64) * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype the kernels feed ``tl.dot``: the cache's, except bf16 under the interpreter.

    The interpreter multiplies with numpy, which has no bfloat16 (it would multiply the raw bits),
    so there bf16 tiles are widened to float32 first.
    """
    if dtype == torch.float32:
        return tl.float32
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16:
        return tl.float32 if interpreting() else tl.bfloat16
    raise TypeError(f"the attention kernels take float32, float16 or bfloat16, not {dtype}")


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: exact float32 products for float32 (the tests' reference dtype;
    TF32 would cost accuracy there), the default for half types, where it does not apply."""
    return "ieee" if dtype == torch.float32 else "tf32"


class LaunchConfig(NamedTuple):
    """A paged-attention launch's tile shape and warps."""

    block_m: int
    """Query-tile rows: ``block_q`` queries times the query heads sharing a KV head."""
    block_q: int
    tile_n: int
    """Keys per tile of the inner loop."""
    num_warps: int


def launch_config(
    queries_per_kv: int,
    max_query_len: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    block_m: int | None = None,
    tile_n: int | None = None,
) -> LaunchConfig:
    """The tile shape and warps for a batch: small query tiles when every query is a decode token.

    Sized so that no configuration spills registers on sm_80 and sm_90a in float16 and bfloat16
    (tests/backends/triton/test_aot_compile.py compiles each ahead of time; docs/gpu.md has the table):
    key tiles 32 wide for decode and float32, 8 warps once the query tile reaches 16 KB (not for
    head size 256 in half precision), and half as many query rows in float32.

    Args:
        queries_per_kv: Query heads per KV head (they share the query tile).
        max_query_len: The batch's longest query (1: decode only).
        head_dim: The head size (padded to a power of two inside the kernels).
        dtype: The cache's dtype.
        block_m: Override of the query tile height (tests).
        tile_n: Override of the key tile width (tests).
    """
    head_dim_pad = triton.next_power_of_2(head_dim)
    wide = dtype == torch.float32
    if block_m is None:
        if max_query_len <= 1:
            rows = 16
        elif wide:
            rows = 32 if head_dim_pad <= 128 else 16
        else:
            rows = 64 if head_dim_pad <= 128 else 32
        block_m = max(rows, triton.next_power_of_2(queries_per_kv))
    if tile_n is None:
        tile_n = 64 if max_query_len > 1 and not wide and head_dim_pad <= 128 else 32
    # 8 warps once the query tile reaches 16 KB; but head size 256 in half precision spills on sm_80
    # with 8 warps (ptxas caps registers lower) and not with 4.
    tile_bytes = block_m * head_dim_pad * (4 if wide else 2)
    num_warps = 8 if tile_bytes >= 16384 and (wide or head_dim_pad <= 128) else 4
    return LaunchConfig(block_m, max(1, block_m // queries_per_kv), tile_n, num_warps)


def check_softcap(softcap: float | None) -> None:
    """Raise ``ValueError`` unless ``softcap`` is None or a positive finite float (the kernels divide by it)."""
    if softcap is not None and not (0.0 < softcap < float("inf")):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap}")


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_dim, queries_per_kv), after checking q and the caches agree."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [tokens, heads, head_dim] and caches [slots, kv_heads, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")  # fmt: skip
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads of size {head_dim} do not fit a cache of "
                         f"{num_kv_heads} kv heads of size {k_cache.shape[2]}")  # fmt: skip
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("the head dimension of q and the caches must be contiguous")
    return num_heads, num_kv_heads, head_dim, num_heads // num_kv_heads


def paged_attention(
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
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """Attention of every query of a flat mixed batch against its sequence's paged K/V.

    Args:
        q: [tokens, heads, head_dim] queries (rotary applied); the head dimension contiguous.
        k_cache: [slots, kv_heads, head_dim] a layer's key cache with this step's keys written.
        v_cache: Like ``k_cache``, for values.
        query_start_loc: [num_seqs + 1] int32 offsets of each sequence's queries in ``q``.
        seq_lens: [num_seqs] int32 cached tokens of each sequence, this step's included.
        block_tables: [num_seqs, max_blocks] int32 physical block ids.
        block_size: Tokens per cache block.
        max_query_len: The longest query of the batch (host int; picks the tile shape only).
        scale: Softmax scale.
        sliding_window: Attend to at most this many most recent positions (None: all).
        softcap: Soft-cap the scores, ``softcap * tanh(scores / softcap)`` before the mask and softmax
            (gemma2); None: not (a variant compiled without it, so other models pay nothing).
        out: Where to write the result (same shape as ``q``); allocated when None.
        block_m: Override of the query tile height (tests).
        tile_n: Override of the key tile width (tests).

    Returns:
        [tokens, heads, head_dim] attention outputs.
    """
    _num_heads, num_kv_heads, head_dim, queries_per_kv = check_shapes(q, k_cache, v_cache)
    check_softcap(softcap)
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    if num_tokens == 0:
        return out
    config = launch_config(queries_per_kv, max_query_len, head_dim, k_cache.dtype, block_m=block_m, tile_n=tile_n)
    grid = (num_tokens // config.block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        num_seqs, scale * _LOG2E, sliding_window or 0,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
        softcap or 0.0,
        QUERIES_PER_KV=queries_per_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=config.block_m, BLOCK_Q=config.block_q, TILE_N=config.tile_n,
        SLIDING=sliding_window is not None, SOFTCAP=softcap is not None, DOT_DTYPE=dot_dtype(k_cache.dtype),
        DOT_PRECISION=dot_precision(k_cache.dtype), num_warps=config.num_warps,
    )  # fmt: skip
    return out
