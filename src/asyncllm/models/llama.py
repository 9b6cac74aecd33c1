"""A Llama-shaped decoder covering the llama, mistral, qwen2 and qwen3 families.

Parameter names mirror HF transformers' (``model.layers.0.self_attn.q_proj.weight`` ...) so a
safetensors checkpoint loads with a plain ``load_state_dict``. The families differ in switches:
q/k/v biases (qwen2), per-head q/k RMSNorm (qwen3), an explicit head_dim (qwen3), a sliding
window (mistral), and tied input/output embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.layers import attention_triton
from asyncllm.layers.attention import AttentionMetadata, paged_attention, write_kv
from asyncllm.layers.attention_triton import TritonAttentionMetadata
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """The shape and switches of a decoder, read off an HF config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict[str, Any]
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    tie_word_embeddings: bool
    hidden_act: str

    @classmethod
    def from_hf_config(cls, config: Any, architecture: str) -> DecoderSpec:
        """Read a spec off a transformers config object of one of the supported families."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = True if architecture == "Qwen2ForCausalLM" else bool(getattr(config, "attention_bias", False))
        sliding_window = getattr(config, "sliding_window", None)
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not getattr(
            config, "use_sliding_window", False
        ):
            sliding_window = None
        return cls(
            architecture=architecture,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope=rope_parameters(config),
            attention_bias=attention_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            hidden_act=getattr(config, "hidden_act", "silu"),
        )


class Attention(nn.Module):
    """Grouped-query self-attention against one layer's paged KV cache."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        bias = spec.attention_bias
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=bias)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata | TritonAttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        k_cache, v_cache = kv_cache
        if isinstance(meta, TritonAttentionMetadata):
            attention_triton.apply_rotary_(q, k, cos, sin)
            attention_triton.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            out = attention_triton.paged_attention(q, k_cache, v_cache, meta, self.scale)
        else:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        result: torch.Tensor = self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
        return result


class MLP(nn.Module):
    """The gated feed-forward block: down(act(gate(x)) * up(x))."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        if spec.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {spec.hidden_act!r} is not supported (only silu)")
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return result


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual connections."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.self_attn = Attention(spec)
        self.mlp = MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata | TritonAttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        result: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result


class DecoderModel(nn.Module):
    """Embeddings, the layer stack and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """The whole model: a flat batch of tokens in, final hidden states out, logits on request."""

    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.rope)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata | TritonAttentionMetadata,
    ) -> torch.Tensor:
        """Run the flat batch ([tokens] ids and positions); return normed hidden states [tokens, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos_sin, kv_cache, meta)
        result: torch.Tensor = self.model.norm(x)
        return result

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to float32 vocabulary logits."""
        result: torch.Tensor = self.lm_head(hidden).float()
        return result
