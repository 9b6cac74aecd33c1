"""Rotary position embeddings with the scaling variants HF configs name.

Plain RoPE is computed here; every scaled variant (linear, llama3, yarn, longrope, dynamic's
initial frequencies) is computed by transformers' own ``ROPE_INIT_FUNCTIONS`` from the config, so
the frequencies and YaRN's/LongRoPE's attention scaling are the reference's to the bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


# ---- rope scaling through transformers (llama3, yarn, longrope) and partial rotary: begin ----


@dataclass(frozen=True, slots=True)
class RotarySpec:
    """The resolved rotary settings of a model: frequencies, scaling and how much of a head rotates.

    Attributes:
        rotary_dim: The leading part of each head that rotates (``partial_rotary_factor`` times
            ``head_dim``: Phi-4-mini rotates 3/4); the rest passes through unrotated.
        inv_freq: The per-pair frequencies (``rotary_dim // 2`` of them), as float32 values.
        attention_scaling: The factor cos and sin are multiplied by (YaRN's mscale, LongRoPE's
            attention factor; 1.0 otherwise), as transformers applies it.
        long_inv_freq: LongRoPE's long-context frequencies, or None for every other type.
        long_from_position: With ``long_inv_freq``: the checkpoint's ``original_max_position_embeddings``.
            Every position of a sequence longer than this rotates by the long frequencies, as
            transformers rotates a forward whose largest position reaches it.
    """

    rotary_dim: int
    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    long_inv_freq: tuple[float, ...] | None = None
    long_from_position: int = 0


def rotary_spec(config: Any, head_dim: int) -> RotarySpec:
    """Resolve the rotary settings of an HF config for heads of ``head_dim`` (see ``_rotary_spec``)."""
    with torch.device("cpu"):  # real values even while the model is built on the meta device
        return _rotary_spec(config, head_dim)


def _rotary_spec(config: Any, head_dim: int) -> RotarySpec:
    """Resolve the rotary settings of an HF config for heads of ``head_dim``.

    The scaled types go through ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` with the
    config itself (the reference implementation, so our frequencies equal transformers' bit for
    bit); plain RoPE uses transformers' default formula here.

    Raises:
        NotImplementedError: The scaling type is not one transformers computes, or is ``dynamic``
            (its frequencies depend on each forward's length; not supported yet).
    """
    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise NotImplementedError(
            f"a rotary dimension of {rotary_dim} (head_dim {head_dim} * {partial}) is not supported"
        )
    if rope_type == "default":
        return RotarySpec(rotary_dim, tuple(inverse_frequencies(rotary_dim, params).tolist()))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")
    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init(config, None)
    if rope_type != "longrope":
        return RotarySpec(rotary_dim, tuple(inv_freq.tolist()), float(scaling))
    original = int(params.get("original_max_position_embeddings") or config.original_max_position_embeddings)
    # transformers picks the long factors when the forward's length (largest position + 1) passes
    # the original context: asking for one past it gives them.
    long_inv_freq, _ = init(config, None, seq_len=original + 1)
    return RotarySpec(
        rotary_dim,
        tuple(inv_freq.tolist()),
        float(scaling),
        long_inv_freq=tuple(long_inv_freq.tolist()),
        long_from_position=original,
    )


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings (the half-split layout HF Llama uses) at given positions.

    LongRoPE chooses its frequencies per sequence, as transformers does per forward of its
    generation: every position of a sequence longer than the original context
    (``RotarySpec.long_from_position``) rotates by the long ones, every position of a shorter one
    by the short ones. The caller says which tokens belong to long sequences; the scheduler
    recomputes a sequence that grows past the original context (transformers drops its cache then).

    Args:
        head_dim: The head dimension (the rotated part is ``rotary.rotary_dim`` of it).
        params: The config's rope settings (see ``rope_parameters``); used only without ``rotary``.
        rotary: The resolved settings (``rotary_spec``); None computes plain or scaled
            frequencies from ``params`` over the whole head.
    """

    def __init__(self, head_dim: int, params: dict[str, Any], rotary: RotarySpec | None = None) -> None:
        super().__init__()
        if rotary is None:
            with torch.device("cpu"):  # host arithmetic, also while the model is built on the meta device
                rotary = RotarySpec(head_dim, tuple(inverse_frequencies(head_dim, params).tolist()))
        self.settings = rotary
        self.register_buffer("inv_freq", torch.tensor(rotary.inv_freq, dtype=torch.float32), persistent=False)
        self.inv_freq: torch.Tensor
        long = rotary.long_inv_freq
        self.register_buffer(
            "long_inv_freq", None if long is None else torch.tensor(long, dtype=torch.float32), persistent=False
        )
        self.long_inv_freq: torch.Tensor | None

    @classmethod
    def of(cls, spec: Any) -> RotaryEmbedding:
        """The rotary embedding a ``DecoderSpec`` describes."""
        return cls(spec.head_dim, spec.rope, spec.rotary)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, long: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [tokens, rotary_dim] for the given positions; shared by every layer.

        Args:
            positions: [tokens] positions.
            dtype: The dtype of the result.
            long: [tokens] bool, True where the token's sequence is longer than LongRoPE's original
                context (its long frequencies); None: no token is. Ignored without LongRoPE.
        """
        inv_freq = self.inv_freq[None, :]
        if self.long_inv_freq is not None and long is not None:
            inv_freq = torch.where(long[:, None], self.long_inv_freq[None, :], inv_freq)
        freqs = positions.to(torch.float32)[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        scaling = self.settings.attention_scaling
        if scaling != 1.0:  # as transformers: the float32 cos/sin times the factor, then the cast
            cos, sin = cos * scaling, sin * scaling
        return cos.to(dtype), sin.to(dtype)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` on the leading ``cos.shape[-1]`` of each head; the rest passes through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


# ---- rope scaling through transformers and partial rotary: end ----


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
