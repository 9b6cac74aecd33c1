"""RMSNorm, computed in float32 as HF transformers does, so greedy outputs match token for token.

``forward`` is the torch path (any device). ``forward_fused`` runs the same norm as one kernel,
optionally with the residual add before it fused in: the Triton kernel ``asyncllm.kernels.rms_norm``
on a GPU, the C kernel ``asyncllm.layers.elementwise_cpu.rms_norm`` on the CPU (float32). The model
calls it on the triton and cpu attention backends. Importing this module does not import triton.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncllm.layers import elementwise_cpu


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

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, triton: bool) -> torch.Tensor:
        """The norm as one kernel (Triton, or C on the CPU); with ``residual``, of ``x + residual``.

        Args:
            x: [tokens, size] input.
            residual: [tokens, size] the running residual stream (x's dtype). Overwritten with
                ``x + residual`` (rounded to the dtype, as ``residual + x`` would be), and that sum
                is what gets normalised: the add and the norm read and write each tensor once.
            triton: The Triton kernel (any device triton runs on, its interpreter included);
                False: the C kernel (float32 on the CPU).

        Returns:
            ``weight * rmsnorm(x)`` (or of the sum), shaped and typed like ``x``.
        """
        if not triton:
            return elementwise_cpu.rms_norm(x, self.weight, self.eps, residual=residual)
        from asyncllm.kernels import rms_norm  # triton: imported on first use

        return rms_norm.rms_norm(x, self.weight, self.eps, residual=residual)
