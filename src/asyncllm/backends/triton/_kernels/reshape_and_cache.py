"""Write a step's new keys and values into the paged KV cache through the slot mapping.

The cache of a layer is ``[num_blocks * block_size, kv_heads, head_dim]``: a slot is one token's
place, ``block * block_size + offset`` (see ``asyncllm.backends.torch._attention``). One program copies one
token's keys and values (every KV head at once). A negative slot marks a padding row (a CUDA graph
runs a batch padded up to its captured size); nothing is written for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["reshape_and_cache"]


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_slot,
    stride_vc_head,
    KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + slot * stride_kc_slot + offs_h[:, None] * stride_kc_head + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc_slot + offs_h[:, None] * stride_vc_head + offs_d[None, :], v, mask=mask)


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``k`` and ``v`` ([tokens, kv_heads, head_dim]) at their cache slots, in place.

    Args:
        k: This step's keys (rotary applied); the head dimension contiguous.
        v: This step's values, same shape.
        k_cache: [slots, kv_heads, head_dim] the layer's key cache.
        v_cache: Like ``k_cache``, for values.
        slot_mapping: [tokens] int32/int64 slot of each token; negative for a padding row (skipped).

    Raises:
        ValueError: The shapes or dtypes do not agree.
    """
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit the cache {tuple(k_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"k/v are {k.dtype}, the cache is {k_cache.dtype}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} does not match {k.shape[0]} tokens")
    if min(k.stride(2), v.stride(2), k_cache.stride(2), v_cache.stride(2)) != 1:
        raise ValueError("the head dimension of k, v and the caches must be contiguous")
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
