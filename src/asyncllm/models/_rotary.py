"""Rotary position embeddings with the scaling variants HF configs name (default, linear, llama3)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rotary settings of an HF config, across transformers' old and new spellings.

    transformers 5 keeps them in ``config.rope_parameters``; 4.x used ``rope_theta`` plus an
    optional ``rope_scaling`` dict.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        merged = dict(params)
    else:
        merged = dict(getattr(config, "rope_scaling", None) or {})
        merged.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    merged.setdefault("rope_type", merged.pop("type", "default"))
    return merged


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1 keeps high frequencies, divides low ones by `factor`, and blends in between.
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """The per-pair rotation frequencies for ``head_dim``, scaled as ``params`` says.

    Raises:
        NotImplementedError: The scaling type is not supported yet.
    """
    rope_type = params.get("rope_type", "default")
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings (the half-split layout HF Llama uses) at given positions.

    Args:
        head_dim: The rotated head dimension.
        params: The config's rope settings (see ``rope_parameters``).
    """

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, params), persistent=False)
        self.inv_freq: torch.Tensor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [tokens, head_dim] for the given positions; shared by every layer."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [tokens, heads, head_dim] by precomputed cos/sin of [tokens, head_dim]."""
    half = x.shape[-1] // 2
    # x * cos + cat(-x2, x1) * sin, with two fresh tensors instead of five (fewer passes over memory;
    # the same roundings, so the result is bit for bit transformers').
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    rotated[..., :half].neg_()
    rotated.mul_(sin[:, None, :])
    result = x * cos[:, None, :]
    return result.add_(rotated)
