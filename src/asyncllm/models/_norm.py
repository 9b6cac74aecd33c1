"""RMSNorm, computed in float32 as HF transformers does, so greedy outputs match token for token.

``forward`` is the torch path (any device). The same norm as one kernel, with the residual add before
it fused in, is the attention backend's (``AttentionBackend.rms_norm``: the Triton kernel
``asyncllm.backends.triton._kernels.rms_norm``, the C kernel ``asyncllm.backends.cpu._elementwise.rms_norm``); the model
calls it with this module's weight and eps.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension.

    Args:
        size: The normalised dimension.
        eps: Added to the mean square before the square root.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            # One fused pass where the composite below makes five, each allocating a fresh tensor; in
            # float32 it is the same arithmetic, bit for bit.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from 1 (``x * (1 + weight)``), computed in float32 and
    rounded to the input's dtype once at the end, exactly as HF's ``Gemma2RMSNorm`` (so greedy outputs
    match token for token).

    Args:
        size: The normalised dimension.
        eps: Added to the mean square before the square root.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
