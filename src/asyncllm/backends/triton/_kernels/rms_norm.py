"""RMSNorm over the last dimension, with an optional fused residual add.

Numerically it is ``asyncllm.models._norm.RMSNorm``: the mean square and the scaling in float32,
the normalised row rounded to the input dtype, then multiplied by the weight (HF's order, which
keeps greedy tokens identical). With ``residual`` the kernel first forms ``x + residual`` (rounded
to the dtype, as the unfused ``x = x + ...`` would), writes it back into ``residual`` and
normalises it: one read of each input and one write of each output instead of three kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    stride_out,
    stride_x,
    stride_res,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_res + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / N + eps)
    normed = (x32 * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * rmsnorm(x)`` over the last dimension; with ``residual``, of ``x + residual``.

    Args:
        x: [..., hidden] input (any leading shape whose rows are evenly strided).
        weight: [hidden] scale, in x's dtype (or float32).
        eps: Added to the mean square.
        residual: Same shape and dtype as ``x``; overwritten with ``x + residual``.

    Returns:
        The normalised tensor, shaped and typed like ``x``.

    Raises:
        ValueError: The shapes do not agree.
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        got = f"{tuple(residual.shape)}/{residual.dtype}"
        raise ValueError(f"residual {got} does not match x {tuple(x.shape)}/{x.dtype}")
    x2 = x.reshape(-1, hidden)
    res2 = residual.view(-1, hidden) if residual is not None else x2
    if x2.stride(-1) != 1 or res2.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            out, x2, res2, weight, out.stride(0), x2.stride(0), res2.stride(0), eps,
            N=hidden, BLOCK_N=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, triton.next_power_of_2(hidden) // 256)),
        )  # fmt: skip
    return out.view(x.shape)
