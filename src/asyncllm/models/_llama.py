"""A Llama-shaped decoder covering the llama, mistral, qwen2, qwen3, gemma2, gemma3, phi3, granite,
olmo2, qwen3_moe and mixtral families.

Parameter names mirror HF transformers' (``model.layers.0.self_attn.q_proj.weight`` ...) so a
safetensors checkpoint loads with a plain ``load_state_dict``. The families differ in switches
(``DecoderSpec``): q/k/v biases (qwen2), per-head q/k RMSNorm (qwen3, gemma3), an explicit head_dim
(qwen3, gemma), a sliding window on every layer (mistral) or on some (gemma: ``layer_sliding``),
tied input/output embeddings, and Gemma's quirks: embeddings scaled by sqrt(hidden_size), RMSNorm
weights stored as offsets from 1, norms after attention and around the MLP (four per layer), GeGLU,
an attention scale from ``query_pre_attn_scalar``, soft-capped attention scores and logits, and
(gemma3) a rope base of its own for the sliding layers. Phi-3 checkpoints store q/k/v and gate/up
fused and may rotate part of each head; Granite scales embeddings, residual branches, attention and
logits by constants; OLMo 2 norms after attention and MLP instead of before, and norms q and k over
the whole projection. Qwen3-MoE and Mixtral replace the MLP of their sparse layers by a routed
Mixture of Experts (``asyncllm.models._moe``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.backends import AttentionBackend, TorchAttentionBackend
from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu import _greedy_head as greedy_head_cpu
from asyncllm.backends.cpu import _lean_forward as lean_cpu
from asyncllm.models._linear import Linear, PackedFormat, best_packed_format
from asyncllm.models._moe import MoeSpec, SparseMoeBlock
from asyncllm.models._norm import OffsetRMSNorm, RMSNorm
from asyncllm.models._parallel import (
    SINGLE,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    gather_logits,
    kv_head_range,
    shard_range,
)
from asyncllm.models._rotary import (
    RotaryEmbedding,
    RotarySpec,
    apply_partial_rotary,
    rope_parameters,
    rotary_spec,
)


@dataclass(frozen=True, slots=True)
class CheckpointSlice:
    """Where one checkpoint tensor goes (``DecoderForCausalLM.checkpoint_slices``).

    Attributes:
        target: The model parameter it fills.
        first_row: The parameter's row its first loaded row goes to (fused projections stack several
            checkpoint tensors; a MoE stack holds every expert's).
        rows: The checkpoint tensor's rows [start, stop) this rank loads; None: all.
        columns: The checkpoint tensor's columns [start, stop) this rank loads; None: all.
    """

    target: str
    first_row: int = 0
    rows: tuple[int, int] | None = None
    columns: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class CompiledParts:
    """A layer's dense parts as compiled callables (same signatures as the eager methods)."""

    pre_attention: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ]
    post_attention: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    layer_sliding: tuple[bool, ...] | None = None
    """Per layer, whether it applies ``sliding_window`` (gemma's alternating layers); None: every layer does."""
    local_rope: dict[str, Any] | None = None
    """The rope settings of the sliding layers where they differ from ``rope`` (gemma3); None: ``rope``."""
    norm_offset: bool = False
    """RMSNorm weights are offsets from 1 (gemma: ``x * (1 + weight)``)."""
    sandwich_norms: bool = False
    """A norm after attention and two around the MLP (gemma: four norms per layer, not two)."""
    embed_scale: float | None = None
    """Embeddings are multiplied by this (gemma: sqrt(hidden_size), rounded to the model's dtype); None: not."""
    query_pre_attn_scalar: float | None = None
    """The attention scale is this to the power -1/2 (gemma); None: head_dim ** -0.5."""
    attn_softcap: float | None = None
    """Attention scores become ``cap * tanh(scores / cap)`` before the softmax (gemma2); None: not."""
    final_softcap: float | None = None
    """Logits become ``cap * tanh(logits / cap)`` (gemma2, some gemma3); None: not."""

    # ---- phi3 / granite / olmo2 quirks and rope scaling (defaults: a Llama layer): begin ----
    rotary: RotarySpec | None = None
    """Resolved rotary settings (scaling, partial rotary); None: plain RoPE from ``rope`` over whole heads."""
    fused_checkpoint: bool = False
    """The checkpoint stores ``qkv_proj`` and ``gate_up_proj`` (Phi-3): split at load."""
    embedding_multiplier: float = 1.0
    """Granite: the embeddings are multiplied by this."""
    residual_multiplier: float = 1.0
    """Granite: each attention and MLP output is multiplied by this before its residual add."""
    attention_multiplier: float | None = None
    """Granite: the attention scale (instead of ``head_dim ** -0.5``)."""
    logits_scaling: float = 1.0
    """Granite: the logits are divided by this."""
    post_norms: bool = False
    """OLMo 2: RMSNorm the attention and MLP outputs before their residual adds; no input norms."""
    whole_qk_norm: bool = False
    """OLMo 2: the q and k norms span the whole projection (all heads), not each head."""
    # ---- phi3 / granite / olmo2 quirks and rope scaling: end ----
    moe: MoeSpec | None = None
    """Qwen3-MoE, Mixtral: the sparse layers' MLP is a routed Mixture of Experts (``models._moe``); None: dense."""

    @property
    def rotary_dim(self) -> int:
        """The leading part of each head that rotates."""
        return self.head_dim if self.rotary is None else self.rotary.rotary_dim

    @property
    def llama_layer(self) -> bool:
        """The layer is exactly Llama's (two plain pre-norms, plain residual adds, a silu MLP, one rope over
        whole heads, per-head q/k norms, plain scaled-dot attention, unscaled logits): what the CPU fast
        paths assume (the lean forward, the fused residual-add norms, the greedy head). False for gemma,
        granite, olmo2, partial-rotary phi3 and MoE: their layers run the modules (eager or compiled)."""
        gemma = (self.norm_offset or self.sandwich_norms or self.embed_scale is not None) or (
            self.attn_softcap is not None or self.final_softcap is not None or self.local_rope is not None
        )
        return (
            not gemma
            and self.hidden_act == "silu"
            and self.residual_multiplier == 1.0
            and self.embedding_multiplier == 1.0
            and self.logits_scaling == 1.0
            and self.attention_multiplier is None
            and not self.post_norms
            and not self.whole_qk_norm
            and self.rotary_dim == self.head_dim
            and self.moe is None
        )

    @property
    def uniform_sliding_window(self) -> int | None:
        """The sliding window when every layer applies it (mistral; a gemma config without global layers):
        positions that leave it are never attended again, so their KV blocks can be freed. None when
        some layer attends to the whole context (gemma's global layers, or no window)."""
        if self.sliding_window is None or not all(self.layer_is_sliding(i) for i in range(self.num_layers)):
            return None
        return self.sliding_window

    def layer_is_sliding(self, index: int) -> bool:
        """Whether layer ``index`` attends within ``sliding_window`` (False where the model has none)."""
        if self.sliding_window is None:
            return False
        return True if self.layer_sliding is None else self.layer_sliding[index]

    @classmethod
    def from_hf_config(cls, config: Any, architecture: str) -> DecoderSpec:
        """Read a spec off a transformers config object of one of the supported families.

        Raises:
            NotImplementedError: The config asks for something the family's implementation lacks
                (gemma's bidirectional attention).
        """
        if architecture in GEMMA_ARCHITECTURES:
            return cls._from_gemma_config(config, architecture)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = True if architecture == "Qwen2ForCausalLM" else bool(getattr(config, "attention_bias", False))
        sliding_window = getattr(config, "sliding_window", None)
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not getattr(
            config, "use_sliding_window", False
        ):
            sliding_window = None
        layer_sliding = _layer_sliding(config, sliding_window)
        if layer_sliding is not None and not any(layer_sliding):
            sliding_window, layer_sliding = None, None
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
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=sliding_window,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            hidden_act=getattr(config, "hidden_act", "silu"),
            layer_sliding=layer_sliding,
            **_quirks(config, architecture, head_dim),
        )

    @classmethod
    def _from_gemma_config(cls, config: Any, architecture: str) -> DecoderSpec:
        # Gemma 2 and Gemma 3 (text): the same layer, gemma3 adds q/k norms and a local rope base.
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError(f"{architecture} with use_bidirectional_attention is not supported")
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_layers = config.num_hidden_layers
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:  # older configs: a pattern (gemma2: every other layer; gemma3: 5 local : 1 global)
            pattern = int(getattr(config, "sliding_window_pattern", 2 if architecture == "Gemma2ForCausalLM" else 6))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        sliding = tuple(t == "sliding_attention" for t in layer_types[:num_layers])
        sliding_window = getattr(config, "sliding_window", None)
        rope, local_rope = rope_parameters(config), None
        if architecture == "Gemma3ForCausalLM":
            rope, local_rope = _gemma3_rope(config)
        return cls(
            architecture=architecture,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope=rope,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm=architecture == "Gemma3ForCausalLM",
            sliding_window=sliding_window if any(sliding) else None,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            hidden_act=str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu")),
            layer_sliding=sliding,
            local_rope=local_rope,
            norm_offset=True,
            sandwich_norms=True,
            embed_scale=float(config.hidden_size) ** 0.5,
            query_pre_attn_scalar=float(getattr(config, "query_pre_attn_scalar", head_dim)),
            attn_softcap=getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
        )


GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def _layer_sliding(config: Any, sliding_window: int | None) -> tuple[bool, ...] | None:
    """Which layers apply the window, where the config says (``layer_types``: qwen2 and qwen3 slide only
    from ``max_window_layers`` on); None: every layer does, or there is no window."""
    layer_types = getattr(config, "layer_types", None)
    if sliding_window is None or layer_types is None:
        return None
    sliding = tuple(t == "sliding_attention" for t in layer_types[: config.num_hidden_layers])
    return None if all(sliding) else sliding


def _gemma3_rope(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) rope settings of a gemma3 config: transformers 5 nests them per layer type;
    4.x had ``rope_theta`` (+ ``rope_scaling``) for the global layers and ``rope_local_base_freq``."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:
        full = dict(params["full_attention"] or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", 1_000_000.0)
        local.setdefault("rope_theta", 10_000.0)
    else:
        full = rope_parameters(config)
        local = {"rope_theta": float(getattr(config, "rope_local_base_freq", 10_000.0))}
    full["rope_type"] = full.pop("type", full.get("rope_type", "default"))
    local["rope_type"] = local.pop("type", local.get("rope_type", "default"))
    return full, local


# ---- phi3 / granite / olmo2 quirks and rope scaling: begin ----


def _quirks(config: Any, architecture: str, head_dim: int) -> dict[str, Any]:
    """The ``DecoderSpec`` fields past Llama's that ``config`` sets (rope scaling for every family)."""
    quirks: dict[str, Any] = {"rotary": rotary_spec(config, head_dim)}
    if architecture == "Phi3ForCausalLM":
        quirks["fused_checkpoint"] = True
    elif architecture == "GraniteForCausalLM":
        quirks["embedding_multiplier"] = float(config.embedding_multiplier)
        quirks["residual_multiplier"] = float(config.residual_multiplier)
        quirks["attention_multiplier"] = float(config.attention_multiplier)
        quirks["logits_scaling"] = float(config.logits_scaling)
    elif architecture == "Olmo2ForCausalLM":
        quirks["post_norms"] = True
        quirks["whole_qk_norm"] = True
    elif architecture in MOE_ARCHITECTURES:
        quirks["moe"] = _moe_spec(config, architecture)
    return quirks


MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


def _moe_spec(config: Any, architecture: str) -> MoeSpec:
    """The expert layout of a Qwen3-MoE or Mixtral config (which layers are sparse: as transformers decides)."""
    num_layers = int(config.num_hidden_layers)
    if architecture == "MixtralForCausalLM":
        return MoeSpec(
            num_experts=int(config.num_local_experts),
            top_k=int(config.num_experts_per_tok),
            intermediate_size=int(config.intermediate_size),
            norm_topk_prob=True,
            sparse_layers=(True,) * num_layers,
            weights_in_router_dtype=False,
            checkpoint_style="mixtral",
        )
    num_experts = int(config.num_experts)
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    return MoeSpec(
        num_experts=num_experts,
        top_k=int(config.num_experts_per_tok),
        intermediate_size=int(config.moe_intermediate_size),
        norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        sparse_layers=tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)),
        weights_in_router_dtype=True,
        checkpoint_style="qwen3_moe",
    )


def _split_fused(state_dict: dict[str, Any], fused: str, parts: tuple[str, ...], sizes: tuple[int, ...]) -> None:
    # A fused checkpoint tensor (Phi-3's qkv_proj / gate_up_proj) as the separate ones our modules
    # load; ``fuse_projections`` stacks them back in the same order (the same bits).
    weight = state_dict.pop(fused, None)
    if weight is None:
        return
    for name, piece in zip(parts, weight.split(sizes, dim=0), strict=True):
        state_dict[name] = piece


# ---- phi3 / granite / olmo2 quirks and rope scaling: end ----


class Attention(nn.Module):
    """Grouped-query self-attention against one layer's paged KV cache.

    Split over ranks (``parallel``), it holds its rank's query heads and KV heads (``models._parallel``):
    q/k/v are column-parallel, o_proj row-parallel (an all-reduce completes its output).
    """

    def __init__(self, spec: DecoderSpec, index: int = 0, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        if parallel.sharded and spec.whole_qk_norm:  # a norm over every head needs every head
            raise NotImplementedError("q/k norms over the whole projection (OLMo 2) cannot be split over ranks")
        self.head_range = shard_range(spec.num_heads, parallel)
        """This rank's query heads [first, stop) of the model's."""
        self.kv_head_range = kv_head_range(spec.num_kv_heads, parallel)
        """This rank's KV heads [first, stop) of the model's (one replicated head with fewer KV heads than ranks)."""
        self.num_heads = self.head_range[1] - self.head_range[0]
        self.num_kv_heads = self.kv_head_range[1] - self.kv_head_range[0]
        self.head_dim = spec.head_dim
        scalar = spec.query_pre_attn_scalar
        if spec.attention_multiplier is not None:  # granite
            self.scale = spec.attention_multiplier
        else:
            self.scale = spec.head_dim**-0.5 if scalar is None else scalar**-0.5
        self.sliding = spec.layer_is_sliding(index)
        """This layer attends within the model's sliding window (the backend's), not to the whole context."""
        self.global_in_windowed = spec.sliding_window is not None and not self.sliding
        """A global layer of a model with sliding layers: the backend is told to ignore its window."""
        self.softcap = spec.attn_softcap
        self.rotates_itself = spec.rotary_dim != spec.head_dim
        """Partial rotary: q and k rotate here (torch), never in a backend's whole-head kernel."""
        bias = spec.attention_bias
        q_size, kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        self.q_proj = Linear(spec.hidden_size, q_size, bias=bias)
        self.k_proj = Linear(spec.hidden_size, kv_size, bias=bias)
        self.v_proj = Linear(spec.hidden_size, kv_size, bias=bias)
        self.o_proj = RowParallelLinear(q_size, spec.hidden_size, bias=False, parallel=parallel)
        self.q_norm = _norm(spec, spec.head_dim) if spec.qk_norm else None
        self.k_norm = _norm(spec, spec.head_dim) if spec.qk_norm else None
        if spec.whole_qk_norm:
            self.q_norm = _norm(spec, spec.num_heads * spec.head_dim)
            self.k_norm = _norm(spec, spec.num_kv_heads * spec.head_dim)
        self.whole_qk_norm = spec.whole_qk_norm
        self.qkv_proj: Linear | None = None
        """q, k and v projections as one matmul, once ``fuse`` ran (the three are then gone)."""
        if spec.fused_checkpoint:
            sizes = (
                spec.num_heads * spec.head_dim,
                spec.num_kv_heads * spec.head_dim,
                spec.num_kv_heads * spec.head_dim,
            )

            def split(state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
                if self.qkv_proj is None:
                    names = tuple(f"{prefix}{n}_proj.weight" for n in "qkv")
                    _split_fused(state_dict, f"{prefix}qkv_proj.weight", names, sizes)

            self._register_load_state_dict_pre_hook(split)

    def fuse(self) -> None:
        """Replace q_proj, k_proj and v_proj by one ``qkv_proj`` with their weights stacked (after loading)."""
        if self.qkv_proj is not None:
            return
        parts = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_proj = _stacked(parts)
        del self.q_proj, self.k_proj, self.v_proj

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ([tokens, heads, head_dim]) of normed hidden states; rotated if ``rotate``."""
        tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_proj is not None:
            q_flat, k_flat, v_flat = self.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)
        else:
            q_flat, k_flat, v_flat = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.whole_qk_norm and self.q_norm is not None and self.k_norm is not None:
            q_flat, k_flat = self.q_norm(q_flat), self.k_norm(k_flat)
        q = q_flat.reshape(tokens, self.num_heads, self.head_dim)
        k = k_flat.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v_flat.view(tokens, self.num_kv_heads, self.head_dim)
        if not self.whole_qk_norm and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotate or self.rotates_itself:
            q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        return q, k, v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: Any,
        backend: AttentionBackend[Any],
        rotated: bool,
    ) -> torch.Tensor:
        """Write this step's K/V to the cache and attend through ``backend`` (rotating q and k in place
        first unless ``rotated``); [tokens, heads * head_dim] (before o_proj)."""
        if not rotated and not self.rotates_itself:
            backend.rotary_(q, k, *cos_sin)
        backend.write_kv(kv_cache, k, v, meta)
        if not self.global_in_windowed and self.softcap is None:
            out = backend.attend(q, k, v, kv_cache, meta, self.scale)
        else:
            sliding = not self.global_in_windowed
            out = backend.attend(q, k, v, kv_cache, meta, self.scale, sliding=sliding, softcap=self.softcap)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


class MLP(nn.Module):
    """The gated feed-forward block: down(act(gate(x)) * up(x)); act is silu (SwiGLU) or tanh-GELU (GeGLU).

    Split over ranks, gate/up are column-parallel (the rank's slice of the intermediate width) and down
    row-parallel (an all-reduce completes its output).
    """

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        if spec.hidden_act != "silu" and spec.hidden_act not in _GELU_TANH:
            raise NotImplementedError(
                f"hidden_act {spec.hidden_act!r} is not supported (only silu and gelu_pytorch_tanh)"
            )
        self.gelu = spec.hidden_act in _GELU_TANH
        self.intermediate_range = shard_range(spec.intermediate_size, parallel)
        """This rank's columns [first, stop) of the intermediate activations."""
        self.intermediate_size = size = self.intermediate_range[1] - self.intermediate_range[0]
        self.gate_proj = Linear(spec.hidden_size, size, bias=False)
        self.up_proj = Linear(spec.hidden_size, size, bias=False)
        self.down_proj = RowParallelLinear(size, spec.hidden_size, bias=False, parallel=parallel)
        self.gate_up_proj: Linear | None = None
        """gate and up projections as one matmul, once ``fuse`` ran (the two are then gone)."""
        if spec.fused_checkpoint:
            sizes = (spec.intermediate_size, spec.intermediate_size)

            def split(state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
                if self.gate_up_proj is None:
                    names = (f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight")
                    _split_fused(state_dict, f"{prefix}gate_up_proj.weight", names, sizes)

            self._register_load_state_dict_pre_hook(split)

    def fuse(self) -> None:
        """Replace gate_proj and up_proj by one ``gate_up_proj`` with their weights stacked (after loading)."""
        if self.gate_up_proj is not None:
            return
        self.gate_up_proj = _stacked((self.gate_proj, self.up_proj))
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split((self.intermediate_size, self.intermediate_size), dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        activated = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        activated.mul_(up)  # in place: one [tokens, intermediate] tensor less to allocate and fault in
        result: torch.Tensor = self.down_proj(activated)
        return result


def _stacked(parts: tuple[Linear, ...]) -> Linear:
    # One Linear whose output is the parts' outputs side by side: same dtype and device, and each
    # output column computed from the same weights (greedy outputs stay token for token).
    first = parts[0]
    fused = Linear(
        first.in_features,
        sum(p.out_features for p in parts),
        bias=first.bias is not None,
        device=first.weight.device,
        dtype=first.weight.dtype,
    )
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts if p.bias is not None]))
    return fused


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual connections.

    The forward is three parts: ``pre_attention`` and ``post_attention`` are dense (norms, matmuls,
    rotary, activations: what ``torch.compile`` fuses well, see ``asyncllm.worker._compile``), and the
    attention between them reads and writes the paged KV cache through the model's attention backend
    (``asyncllm.backends``). On a backend with fused norms (triton, and cpu where its C kernels could
    be built) an eager layer runs ``forward_fused_norms`` instead when ``DecoderForCausalLM.fused_norm``
    is on.
    """

    def __init__(self, spec: DecoderSpec, index: int = 0, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(spec, index, parallel)
        self.mlp: MLP | SparseMoeBlock
        if spec.moe is not None and spec.moe.sparse_layers[index]:
            if parallel.sharded:
                raise NotImplementedError("Mixture-of-Experts layers cannot be split over ranks yet")
            self.mlp = SparseMoeBlock(spec.moe, spec.hidden_size, spec.hidden_act)
        else:
            self.mlp = MLP(spec, parallel)
        self.input_layernorm = _norm(spec, spec.hidden_size)
        self.post_attention_layernorm = _norm(spec, spec.hidden_size)
        self.sandwich = spec.sandwich_norms
        self.residual_multiplier = spec.residual_multiplier
        self.post_norms = spec.post_norms
        self.post_feedforward_layernorm: RMSNorm | OffsetRMSNorm | None = None
        """The norm of the MLP output (gemma, olmo2); ``post_attention_layernorm`` norms the attention output."""
        if self.sandwich:
            # Gemma: post_attention_layernorm norms the attention output; these two wrap the MLP.
            self.pre_feedforward_layernorm = _norm(spec, spec.hidden_size)
            self.post_feedforward_layernorm = _norm(spec, spec.hidden_size)
        if spec.post_norms:
            del self.input_layernorm  # OLMo 2 has none: the checkpoint has no such weight
            self.post_feedforward_layernorm = _norm(spec, spec.hidden_size)
        self.compiled: CompiledParts | None = None
        """Compiled twins of ``pre_attention``/``post_attention`` (``asyncllm.worker._compile``), or None: eager."""

    def pre_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm and q/k/v projections (rotary applied if ``rotate``)."""
        if self.post_norms:
            return self.self_attn.project(x, cos, sin, rotate)
        return self.self_attn.project(self.input_layernorm(x), cos, sin, rotate)

    def post_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """o_proj and residual, then the post-attention norm, the MLP and residual (gemma: the attention
        output normed before its residual add, the MLP between two norms; olmo2: both outputs normed
        before their residual adds; granite: both scaled)."""
        if self.sandwich and self.post_feedforward_layernorm is not None:
            x = x + self.post_attention_layernorm(self.self_attn.o_proj(attended))
            mlp_out = self.mlp(self.pre_feedforward_layernorm(x))
            sandwiched: torch.Tensor = x + self.post_feedforward_layernorm(mlp_out)
            return sandwiched
        if self.post_norms and self.post_feedforward_layernorm is not None:  # OLMo 2
            x = x + self.post_attention_layernorm(self.self_attn.o_proj(attended))
            olmo: torch.Tensor = x + self.post_feedforward_layernorm(self.mlp(x))
            return olmo
        if self.residual_multiplier != 1.0:  # Granite
            x = x + self.self_attn.o_proj(attended) * self.residual_multiplier
            granite: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier
            return granite
        x = x + self.self_attn.o_proj(attended)
        result: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return result

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: Any,
        backend: AttentionBackend[Any],
    ) -> torch.Tensor:
        """The layer on the flat batch; ``cos_sin`` is this layer's rotation (gemma3's sliding layers have
        their own)."""
        compiled = self.compiled
        # A backend may rotate q and k in place in its own kernel, unless a compiled pre_attention
        # already fused the rotation into its kernels.
        rotate = compiled is not None or not backend.rotates_in_kernel or self.self_attn.rotates_itself
        pre = compiled.pre_attention if compiled is not None else self.pre_attention
        post = compiled.post_attention if compiled is not None else self.post_attention
        q, k, v = pre(x, cos_sin[0], cos_sin[1], rotate)
        attended = self.self_attn.attend(q, k, v, cos_sin, kv_cache, meta, backend, rotated=rotate)
        return post(x, attended)

    def forward_fused_norms(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: Any,
        backend: AttentionBackend[Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` (eager) on a backend that ``fuses_norms``, each residual add fused into the norm after it.

        vLLM's layout: a layer passes on its MLP output and the residual stream separately, and the
        next norm adds them (``backend.rms_norm``, one kernel that updates ``residual`` in place).
        The sums are the unfused ones, rounded the same way; only the norms' reductions run in
        another order. Rotary runs in place in one kernel too (``backend.rotary_``, in ``Attention.attend``).

        Args:
            x: The previous layer's MLP output, or the embeddings for the first layer.
            residual: The residual stream before ``x`` is added; None for the first layer (then
                the embeddings are the stream, and are updated in place from here on).

        Returns:
            (this layer's MLP output, the residual stream up to its attention output).
        """
        input_norm, post_norm = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, normed = x, backend.rms_norm(x, input_norm.weight, input_norm.eps, None)
        else:
            normed = backend.rms_norm(x, input_norm.weight, input_norm.eps, residual)
        q, k, v = self.self_attn.project(normed, cos_sin[0], cos_sin[1], False)  # attend rotates, in place
        attended = self.self_attn.attend(q, k, v, cos_sin, kv_cache, meta, backend, rotated=False)
        attended = self.self_attn.o_proj(attended)
        normed = backend.rms_norm(attended, post_norm.weight, post_norm.eps, residual)
        result: torch.Tensor = self.mlp(normed)
        return result, residual


def _norm(spec: DecoderSpec, size: int) -> RMSNorm | OffsetRMSNorm:
    return OffsetRMSNorm(size, spec.rms_norm_eps) if spec.norm_offset else RMSNorm(size, spec.rms_norm_eps)


def _greedy_head(lm_head: Linear) -> greedy_head_cpu.GreedyHead | None:
    """The greedy head over ``lm_head``'s weight (on panels); None where the weights are out of its range."""
    if lm_head.panel_weight is None or lm_head.bias is not None:  # the head computes x @ weight.T alone
        return None
    try:
        return greedy_head_cpu.GreedyHead(lm_head.weight)
    except ValueError:  # non-finite or huge weights: the logits decide
        return None


class DecoderModel(nn.Module):
    """Embeddings, the layer stack and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, parallel=parallel)
        self.layers = nn.ModuleList(DecoderLayer(spec, index, parallel) for index in range(spec.num_layers))
        self.norm = _norm(spec, spec.hidden_size)


class DecoderForCausalLM(nn.Module):
    """The whole model: a flat batch of tokens in, final hidden states out, logits on request.

    Args:
        spec: The model's shape and switches.
        parallel: This rank's place in a tensor-parallel model (``models._parallel``): its layers then
            hold its shard of every weight and all-reduce between them. Default: one rank, whole.
    """

    def __init__(self, spec: DecoderSpec, parallel: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        self.model = DecoderModel(spec, parallel)
        self.rotary = RotaryEmbedding.of(spec)
        self.local_rotary = None if spec.local_rope is None else RotaryEmbedding(spec.head_dim, spec.local_rope)
        """The sliding layers' rotation where it differs from ``rotary`` (gemma3's local rope base); None: the same."""
        # Vocabulary-parallel like the embedding: the rank's rows of the vocabulary.
        self.lm_head = Linear(spec.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._backend: AttentionBackend[Any] = TorchAttentionBackend(sliding_window=spec.sliding_window)
        self.fused_norm = True
        """On a backend that ``fuses_norms`` (triton; cpu) with eager (not compiled) layers, fuse every
        residual add into the RMSNorm after it (``DecoderLayer.forward_fused_norms``): per layer two
        kernels (Triton on a GPU, C on the CPU, ``backend.rms_norm``) where the unfused path runs two
        adds and two norms of several element-wise ops each; rotary is then one in-place kernel
        too. False runs the unfused torch ops there too, for A/B comparisons (``benchmarks/gpu.py``,
        ``benchmarks/forward.py``). The torch backend and compiled layers never fuse. Read on every
        forward, so a CUDA graph keeps the path it was captured with (the runner sets this from its
        own ``fused_norm`` option before it captures)."""
        self.lean: lean_cpu.LeanCpuForward | None = None
        """The layer stack as direct kernel calls (``backends.cpu._lean_forward``), built by ``pack_weights``
        where it applies; None: the modules."""
        self.lean_forward = True
        """With fused norms on a backend that ``runs_lean_forward`` (cpu), run ``lean`` (when built)
        instead of the modules: the same bits, less Python per layer. False runs the modules (for A/B
        comparisons and tests)."""
        self.greedy_head: greedy_head_cpu.GreedyHead | gemm_cpu.PanelArgmaxHead | None = None
        """Greedy tokens without the full logits, built by ``pack_weights`` where it applies: float32's bounded
        head (``backends.cpu._greedy_head``), or beside bfloat16 panels the argmax fused into the output
        projection (``gemm_cpu.PanelArgmaxHead``); the same tokens as the argmax of ``logits``. None: the logits
        decide."""

    @property
    def backend(self) -> AttentionBackend[Any]:
        """The attention backend every layer calls (``asyncllm.backends``); the forward's metadata is
        what its ``build_metadata`` made. The runner sets the one it picks at load; the torch
        reference until then. Setting it also picks the MoE blocks' expert computation: the fused
        Triton kernels where the backend ``runs_fused_moe`` (triton), the torch grouped path elsewhere."""
        return self._backend

    @backend.setter
    def backend(self, backend: AttentionBackend[Any]) -> None:
        self._backend = backend
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                module.fused = backend.runs_fused_moe

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: Any,
        long_rope: torch.Tensor | None = None,
        sliding_meta: Any = None,
    ) -> torch.Tensor:
        """Run the flat batch ([tokens] ids and positions); return normed hidden states [tokens, hidden].

        ``meta`` is the step's attention metadata, built by ``self.backend.build_metadata``. ``long_rope``
        ([tokens] bool, or None: none) marks the tokens of sequences longer than LongRoPE's original
        context, which rotate by its long frequencies (``RotaryEmbedding.cos_sin``). ``sliding_meta``, where
        a hybrid model's sliding layers have KV blocks of their own (``RunnerInfo.sliding_group``), is the
        metadata of their tables, which those layers use instead of ``meta``.
        """
        backend = self.backend
        spec = self.spec
        x = self.model.embed_tokens(input_ids)
        if spec.embed_scale is not None:
            # As HF: the scale rounded to the model's dtype first (bfloat16 rounds sqrt(hidden) itself).
            x.mul_(torch.tensor(spec.embed_scale, dtype=torch.float32).to(x.dtype))
        if spec.embedding_multiplier != 1.0:  # Granite
            x = x * spec.embedding_multiplier
        cos_sin = self.rotary.cos_sin(positions, x.dtype, long_rope)
        layers = cast("Sequence[DecoderLayer]", self.model.layers)
        if not spec.llama_layer:
            local = cos_sin if self.local_rotary is None else self.local_rotary.cos_sin(positions, x.dtype)
            for layer, kv_cache in zip(layers, kv_caches):
                sliding = layer.self_attn.sliding
                layer_meta = sliding_meta if sliding and sliding_meta is not None else meta
                x = layer(x, local if sliding else cos_sin, kv_cache, layer_meta, backend)
            normed: torch.Tensor = self.model.norm(x)
            return normed
        if self.fused_norm and backend.fuses_norms and all(layer.compiled is None for layer in layers):
            if self.lean is not None and self.runs_lean(backend) and sliding_meta is None:  # one metadata for all
                return self.lean(x, cos_sin, kv_caches, meta)
            residual = None
            for layer, kv_cache in zip(layers, kv_caches):
                layer_meta = sliding_meta if layer.self_attn.sliding and sliding_meta is not None else meta
                x, residual = layer.forward_fused_norms(x, residual, cos_sin, kv_cache, layer_meta, backend)
            final = self.model.norm
            return backend.rms_norm(x, final.weight, final.eps, residual)  # the last add, fused too
        for layer, kv_cache in zip(layers, kv_caches):
            layer_meta = sliding_meta if layer.self_attn.sliding and sliding_meta is not None else meta
            x = layer(x, cos_sin, kv_cache, layer_meta, backend)
        result: torch.Tensor = self.model.norm(x)
        return result

    @property
    def local_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) this rank computes and caches: the model's, or its shard's."""
        attention = cast("DecoderLayer", self.model.layers[0]).self_attn
        return attention.num_heads, attention.num_kv_heads

    def reset_rotary(self, device: torch.device) -> None:
        """Recompute the rotary tables on ``device`` (after ``to_empty``, which leaves buffers uninitialised)."""
        self.rotary = RotaryEmbedding.of(self.spec).to(device)
        if self.spec.local_rope is not None:
            self.local_rotary = RotaryEmbedding(self.spec.head_dim, self.spec.local_rope).to(device)

    def fuse_projections(self) -> None:
        """Stack q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` in every layer.

        Call it after ``load_state_dict`` (the checkpoint has HF's separate names; afterwards the
        state dict has the fused ones), or on the meta device before loading, which then writes each
        checkpoint tensor into its rows (``checkpoint_rows``). Fewer, larger matmuls: the same
        numbers, faster.
        """
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def checkpoint_rows(self) -> dict[str, tuple[str, int]]:
        """Where each fused projection's checkpoint tensors go: HF name -> (our parameter's name, first row).

        After ``fuse_projections`` the checkpoint's ``q_proj``/``k_proj``/``v_proj`` (weights and biases)
        are row ranges of ``qkv_proj``, and ``gate_proj``/``up_proj`` of ``gate_up_proj``, stacked in
        that order. A loader writes each checkpoint tensor straight into its range, so the separate
        copies never exist (``asyncllm.worker._weights.load_weights``). Names not listed here map to
        themselves at row 0. Before fusing, only the per-expert tensors of a MoE checkpoint are listed.
        """
        rows: dict[str, tuple[str, int]] = {}
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            prefix = f"model.layers.{index}"
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(mlp, SparseMoeBlock) and self.spec.moe is not None:
                rows.update(mlp.checkpoint_rows(f"{prefix}.mlp", self.spec.moe.checkpoint_style))
            if attn.qkv_proj is not None:
                q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
                for part, start in (("q_proj", 0), ("k_proj", q_size), ("v_proj", q_size + kv_size)):
                    for kind in ("weight", "bias"):
                        rows[f"{prefix}.self_attn.{part}.{kind}"] = (f"{prefix}.self_attn.qkv_proj.{kind}", start)
            if isinstance(mlp, MLP) and mlp.gate_up_proj is not None:
                for part, start in (("gate_proj", 0), ("up_proj", mlp.intermediate_size)):
                    rows[f"{prefix}.mlp.{part}.weight"] = (f"{prefix}.mlp.gate_up_proj.weight", start)
        return rows

    def checkpoint_slices(self) -> dict[str, CheckpointSlice]:
        """Where each checkpoint tensor goes, and which part of it this rank holds (the loader's plan).

        Extends ``checkpoint_rows`` (fused projections, stacked experts) with the rank's shard: the rows
        of column-parallel weights and biases (its heads, its intermediate slice, its vocabulary
        rows), the columns of row-parallel ones. Names not listed load whole into the parameter of
        the same name.
        """
        slices = {name: CheckpointSlice(target, first) for name, (target, first) in self.checkpoint_rows().items()}
        if not self.parallel.sharded:
            return slices

        def shard(name: str, rows: tuple[int, int] | None = None, columns: tuple[int, int] | None = None) -> None:
            slices[name] = dataclasses.replace(slices.get(name, CheckpointSlice(name)), rows=rows, columns=columns)

        vocab = self.model.embed_tokens
        vocab_rows = (vocab.first_row, vocab.first_row + vocab.valid_rows)
        shard("model.embed_tokens.weight", rows=vocab_rows)
        if not self.spec.tie_word_embeddings:
            shard("lm_head.weight", rows=vocab_rows)
        dim = self.spec.head_dim
        for index, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp, MLP)
            prefix = f"model.layers.{index}"
            attn, mlp = layer.self_attn, layer.mlp
            heads = (attn.head_range[0] * dim, attn.head_range[1] * dim)
            kv_heads = (attn.kv_head_range[0] * dim, attn.kv_head_range[1] * dim)
            for part, rows in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
                for kind in ("weight", "bias"):
                    shard(f"{prefix}.self_attn.{part}.{kind}", rows=rows)
            shard(f"{prefix}.self_attn.o_proj.weight", columns=heads)
            for part in ("gate_proj", "up_proj"):
                shard(f"{prefix}.mlp.{part}.weight", rows=mlp.intermediate_range)
            shard(f"{prefix}.mlp.down_proj.weight", columns=mlp.intermediate_range)
        return slices

    def padded_rows(self) -> dict[str, int]:
        """Parameters whose trailing rows no checkpoint row fills (the last rank's vocabulary padding):
        name -> the rows that are filled. The loader zeroes the rest."""
        vocab = self.model.embed_tokens
        if vocab.valid_rows == vocab.num_embeddings:
            return {}
        padded = {"model.embed_tokens.weight": vocab.valid_rows}
        if not self.spec.tie_word_embeddings:
            padded["lm_head.weight"] = vocab.valid_rows
        return padded

    def pack_weights(
        self, packed_format: PackedFormat | None = None, *, greedy_head: bool = True, bfloat16: bool = False
    ) -> int:
        """Pack every linear layer's weight for a packed GEMM (float32 on the CPU; see ``models._linear``).

        ``packed_format`` is "both", "panels" or "mkl"; None takes ``best_packed_format`` for all
        the layers' weights together (both copies only while the second fits comfortably in memory).
        Call it after ``fuse_projections`` and before ``torch.compile`` (the compiled graphs then
        call the packed weights); never with CUDA graphs. The unpacked weights are released
        (except the tied output embedding, which the input embedding still reads), and ``lean`` is
        built where it applies. With ``greedy_head`` and panels in the format, ``greedy_head`` is
        built where AMX or AVX512-BF16 runs (``backends.cpu._greedy_head``), elsewhere the argmax fused into the
        output projection's panels (``gemm_cpu.PanelArgmaxHead``); the output projection then keeps the
        panels alone, so its logits come from the arithmetic the head reproduces at every row count
        (and, for the bounded head, its float32 weight, which the head reads). A rank's shard of a tensor-parallel model
        packs its linear layers but builds neither ``lean`` nor ``greedy_head``.
        With ``bfloat16`` (a model loaded in bfloat16 or float32) every layer, the output projection included,
        goes to bfloat16 panels (``Linear.pack``; ``packed_format`` must be None or "panels"), every other
        parameter to float32 (the model then computes in float32 but for its matmuls' products), and with
        ``greedy_head`` the greedy rows' argmax is fused into the output projection's panels
        (``gemm_cpu.PanelArgmaxHead``; float32's bounded head would save little over products this cheap,
        but the [rows, vocab] logits' writing and reading is saved).
        Returns the number of layers packed (0 where unavailable).
        """
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        self.greedy_head = None
        # The lean forward and the greedy head assume a whole Llama layer and a whole output projection:
        # neither runs on a rank's shard (the lean forward has no all-reduce, the head no gather). Elsewhere no
        # head is built, nor is the output projection packed for one (panels alone, a float32 copy kept).
        whole = self.spec.llama_layer and not self.parallel.sharded
        greedy_head = greedy_head and whole
        packed = 0
        if bfloat16:
            for linear in linears:
                shared = linear is self.lm_head and self.spec.tie_word_embeddings
                packed += linear.pack(release=not shared, packed_format=packed_format, bfloat16=True)
            self._rest_to_float32()
            self.greedy_head = self._panel_argmax_head() if greedy_head else None
        else:
            packed = self._pack_float32(linears, packed_format, greedy_head)
        self.lean = lean_cpu.LeanCpuForward.for_model(self) if packed and whole else None
        return packed

    def _logits_are_the_head_outputs(self) -> bool:
        """Whether ``logits`` are the output projection's outputs alone: no bias, soft-cap or scaling between
        them (a monotonic map can still round distinct logits to one value, whose first column the logits'
        argmax would then take)."""
        spec = self.spec
        return self.lm_head.bias is None and spec.final_softcap is None and spec.logits_scaling == 1.0

    def _panel_argmax_head(self) -> gemm_cpu.PanelArgmaxHead | None:
        """Greedy rows' argmax fused into the output projection's panels, where its logits are those outputs."""
        head = self.lm_head
        if head.panel_weight is None or not self._logits_are_the_head_outputs():
            return None
        valid = min(self.spec.vocab_size, head.out_features)
        return gemm_cpu.PanelArgmaxHead(head.panel_weight, head.out_features, valid, head.in_features)

    def _rest_to_float32(self) -> None:
        """Make every bfloat16 parameter left (norms, biases, embeddings, beside bfloat16 panels) float32: the
        model computes in float32 from then on. A tied embedding stays one tensor."""
        converted: dict[int, nn.Parameter] = {}
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                if param.dtype == torch.bfloat16:
                    if id(param) not in converted:
                        converted[id(param)] = nn.Parameter(param.detach().float(), requires_grad=False)
                    setattr(module, name, converted[id(param)])

    def _pack_float32(self, linears: list[Linear], packed_format: PackedFormat | None, greedy_head: bool) -> int:
        """``pack_weights`` in float32: the layers in ``packed_format`` (None: the best here), the greedy head
        where it runs. Returns the number of layers packed."""
        if packed_format is None:
            weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
            packed_format = best_packed_format(weight_bytes)
            if packed_format is None:
                return 0
        # Not under a final soft-cap: monotonic, but tanh's saturation can round distinct logits to one
        # value, and the argmax of the capped logits (HF's) then takes the first of them.
        on_panels = greedy_head and packed_format in ("both", "panels")
        with_head = on_panels and greedy_head_cpu.available() and self.spec.final_softcap is None
        # Where the bound cannot run (AVX-512 without AVX512-BF16 or AMX): the argmax fused into the panels.
        fused = on_panels and not greedy_head_cpu.available() and self._logits_are_the_head_outputs()
        packed = 0
        for module in linears:
            shared = module is self.lm_head and self.spec.tie_word_embeddings
            if module is self.lm_head and with_head:
                # The head reads the float32 weight for its exact logits: kept, even when not shared.
                packed += module.pack(release=False, packed_format="panels")
                self.greedy_head = _greedy_head(module)
                if self.greedy_head is None and not shared and module.packed:
                    module.release()
            elif module is self.lm_head and fused:
                # Panels alone: every row's logits then come from the arithmetic the fused argmax runs.
                packed += module.pack(release=not shared, packed_format="panels")
                self.greedy_head = self._panel_argmax_head()
            else:
                packed += module.pack(release=not shared, packed_format=packed_format)
        return packed

    def runs_lean(self, backend: AttentionBackend[Any]) -> bool:
        """Whether a step on ``backend`` runs the layer stack as ``lean`` (a step without a sliding group's
        metadata): built, switched on, fused norms on a backend that runs it, no layer compiled."""
        layers = cast("Sequence[DecoderLayer]", self.model.layers)
        return (
            self.lean is not None
            and self.lean_forward
            and self.fused_norm
            and backend.fuses_norms
            and backend.runs_lean_forward
            and all(layer.compiled is None for layer in layers)
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to float32 vocabulary logits: soft-capped where the model says (gemma, in its
        dtype as HF does), divided by ``logits_scaling`` (granite, after the projection as HF does).

        Split over ranks, every rank must call it on the same rows: rank 0 gathers the vocabulary
        slices into the whole logits; another rank gets its own slice back (it only contributes).
        """
        logits: torch.Tensor = gather_logits(self.lm_head(hidden), self.spec.vocab_size, self.parallel)
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        result = logits.float()
        if self.spec.logits_scaling != 1.0:
            result = result / self.spec.logits_scaling
        return result
