"""Rotary position embedding applied in place to q and k, the half-split layout HF Llama uses.

For each head, with ``x1, x2`` the two halves of the head dimension and ``c, s`` the cosine and
sine of the token's angles: ``x1' = x1*c - x2*s`` and ``x2' = x2*c + x1*s``. That is
``asyncllm.models._rotary.apply_rotary`` (whose cos/sin repeat the same angles in both halves), in
one kernel over q and k instead of five element-wise ones each, without temporaries. The math is
float32; the result is rounded once to the tensors' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rotary_embedding_"]


@triton.jit
def _rotate_heads(
    x_ptr, token, stride_tok, stride_head, c, s, offs_d, d_mask, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    offs_h = tl.arange(0, HEADS_PAD)
    mask = (offs_h[:, None] < HEADS) & d_mask[None, :]
    first = x_ptr + token * stride_tok + offs_h[:, None] * stride_head + offs_d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * c[None, :] - x2 * s[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * c[None, :] + x1 * s[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cos_tok,
    stride_sin_tok,
    Q_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    c = tl.load(cos_ptr + token * stride_cos_tok + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + token * stride_sin_tok + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, token, stride_q_tok, stride_q_head, c, s, offs_d, d_mask, Q_HEADS, Q_HEADS_PAD, HALF)
    _rotate_heads(k_ptr, token, stride_k_tok, stride_k_head, c, s, offs_d, d_mask, K_HEADS, K_HEADS_PAD, HALF)


def rotary_embedding_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q`` [tokens, heads, head_dim] and ``k`` [tokens, kv_heads, head_dim] in place.

    Args:
        q: Queries; the head dimension contiguous.
        k: Keys; the head dimension contiguous.
        cos: [tokens, head_dim] (or [tokens, head_dim // 2]) cosines, as ``RotaryEmbedding.cos_sin``
            returns them; only the first half of each row is read.
        sin: Like ``cos``, sines.

    Raises:
        ValueError: The shapes do not agree or head_dim is odd.
    """
    tokens, q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share tokens and an even head_dim")
    half = head_dim // 2
    if cos.shape[0] != tokens or sin.shape != cos.shape or cos.shape[1] not in (half, head_dim):
        raise ValueError(f"cos/sin {tuple(cos.shape)} do not match {tokens} tokens of head_dim {head_dim}")
    if min(q.stride(2), k.stride(2), cos.stride(1), sin.stride(1)) != 1:
        raise ValueError("the last dimension of q, k, cos and sin must be contiguous")
    if tokens == 0:
        return
    k_heads = k.shape[1]
    _rotary_kernel[(tokens,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        Q_HEADS=q_heads, Q_HEADS_PAD=triton.next_power_of_2(q_heads),
        K_HEADS=k_heads, K_HEADS_PAD=triton.next_power_of_2(k_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
    )  # fmt: skip
