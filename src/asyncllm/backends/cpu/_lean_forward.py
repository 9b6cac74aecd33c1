"""The CPU's lean forward: a decoder's layer stack as direct kernel calls, same bits as the modules.

On the CPU in float32 every heavy part of a layer is already a foreign call that releases the GIL:
the packed GEMMs (``backends.cpu._gemm``'s panels, MKL's packed layout), the fused norms and rotary
(``backends.cpu._elementwise``) and the attention kernels (``backends.cpu._attention``). Between them the
module forward spends Python: module calls, attribute lookups, argument checks, views, and a fresh
tensor for every intermediate result. At a decode step's few rows that Python is a large share of a
layer's time (measurements: docs/performance-log.md, "Seventh round").

``LeanCpuForward`` makes those calls itself. Built once per model after its weights are packed, it
holds each layer's packed-weight addresses and norm weights; a step then runs, per layer: the input
norm (with the previous layer's residual add), the q/k/v matmul (its bias and the per-head q/k norms
where the family has them: qwen2, qwen3), rotary in place, the KV write, the
attention, o_proj, the post-attention norm (with its residual add), the gate/up matmul, SiLU times
up in place (one pass, ``backends.cpu._activation``, where it gives torch's bits), and the down matmul,
into six scratch tensors carved from one buffer kept between steps and reused by every layer (they stay in
the cache where fresh tensors would not, and no step maps and unmaps memory). The operations and their
order are the module path's (``DecoderLayer.forward_fused_norms``), so the results are identical, which
the tests check bit for bit.

Steps of up to ``POOL_MAX_TOKENS`` tokens run their matmuls, decode attention and SiLU on the runner's kernel
pool (``pool``, ``backends.cpu._pool``) where it has one, same bits.

It applies to every family the decoder covers (llama, mistral, qwen2, qwen3) once the projections
are fused and every layer is packed, on the cpu attention backend (whose metadata it reads: the
backend says so, ``runs_lean_forward``) with the fused norms on; anything else runs the modules
(``DecoderForCausalLM.forward`` decides per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from asyncllm.backends.cpu import _activation as activation_cpu
from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.cpu import _elementwise as elementwise_cpu
from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu import _pool as kernel_pool
from asyncllm.backends.cpu._attention import CpuAttentionMetadata
from asyncllm.models._linear import Linear, on_panels, packed_matmul_into
from asyncllm.worker._memory import mapped_tensor

if TYPE_CHECKING:
    from asyncllm.models._llama import DecoderForCausalLM
__all__ = ["POOL_MAX_TOKENS", "LeanCpuForward"]

POOL_MAX_TOKENS = 64
"""Steps of at most this many tokens run on the kernel pool where there is one: decode-sized steps, whose
element-wise kernels run on the calling thread alone (under ``PARALLEL_FLOATS``), so OpenMP's threads stay
asleep; larger steps run on OpenMP throughout (two pools at once would spin against each other)."""


@dataclass(frozen=True, slots=True)
class _Matmul:
    """One packed linear layer (no bias) as addresses: ``x @ weight.T`` into a given output."""

    panels: int
    """Address of the column panels, or 0."""
    packed: int
    """Address of MKL's packed copy, or 0."""
    out_features: int
    in_features: int
    bfloat16: bool
    """The panels hold bfloat16 (``gemm_cpu.PanelWeight(..., bfloat16=True)``)."""

    @classmethod
    def of(cls, linear: Linear, *, bias_allowed: bool = False) -> _Matmul | None:
        """``linear``'s packed weight; None when it is unpacked, or has a bias and ``bias_allowed`` is False
        (the caller adds an allowed bias itself)."""
        if (linear.bias is not None and not bias_allowed) or not linear.packed:
            return None
        panels, packed = linear.panel_weight, linear.packed_weight
        return cls(
            0 if panels is None else panels.data_ptr(),
            0 if packed is None else packed.data_ptr(),
            linear.out_features,
            linear.in_features,
            panels is not None and panels.dtype == torch.bfloat16,
        )

    def __call__(
        self, x: int, x_stride: int, rows: int, out: int, out_stride: int, pool: kernel_pool.KernelPool | None
    ) -> None:
        shape = (self.out_features, self.in_features)
        on_panels_here = self.bfloat16 or on_panels(bool(self.panels), bool(self.packed), rows)
        if pool is not None and on_panels_here:
            args = (x, x_stride, rows, self.panels, out, out_stride, *shape)
            if gemm_cpu.pooled_matmul_into(pool, *args, bfloat16=self.bfloat16):
                return
        if self.bfloat16:
            gemm_cpu.bfloat16_panel_matmul_into(x, x_stride, rows, self.panels, out, out_stride, *shape)
        elif on_panels(bool(self.panels), bool(self.packed), rows):  # the choice ``packed_linear`` makes
            gemm_cpu.panel_matmul_into(x, x_stride, rows, self.panels, out, out_stride, *shape)
        else:
            packed_matmul_into(x, x_stride, rows, self.packed, out, out_stride, *shape)


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: _Matmul
    qkv_bias: torch.Tensor | None  # qwen2
    q_norm: torch.Tensor | None  # qwen3: per-head RMSNorm weights of q and k
    k_norm: torch.Tensor | None
    o: _Matmul
    post_norm: torch.Tensor
    gate_up: _Matmul
    down: _Matmul
    sliding: bool  # False: a global layer of a model whose other layers slide (qwen2's max_window_layers)


class LeanCpuForward:
    """A packed float32 decoder's layer stack on the CPU as direct kernel calls (see the module docstring).

    Build it with ``for_model``; call it as the model's layer stack: flat batch in, final normed
    hidden states out. It keeps references to the model's weights, so they outlive it.
    """

    def __init__(self, model: DecoderForCausalLM, layers: list[_Layer]) -> None:
        spec = model.spec
        self._layers = layers
        self._final_norm = model.model.norm.weight
        self._eps = spec.rms_norm_eps
        self._hidden = spec.hidden_size
        self._heads, self._kv_heads, self._head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self._intermediate = spec.intermediate_size
        self._scale = spec.head_dim**-0.5
        self._norm = elementwise_cpu.kernel("asyncllm_rms_norm_f32")
        self._rotate = elementwise_cpu.kernel("asyncllm_rotary_f32")
        self._write_kv = {
            torch.float32: elementwise_cpu.kernel("asyncllm_write_kv_f32"),
            torch.bfloat16: elementwise_cpu.kernel("asyncllm_write_kv_bf16"),
        }
        self._buffer = torch.empty(0)  # the layers' scratch (``_scratch``)
        self.pool: kernel_pool.KernelPool | None = None
        """The kernel pool the decode-sized steps' matmuls and attention run on (``backends.cpu._pool``; the
        runner's, which it closes), or None for OpenMP's threads throughout."""
        self.pool_max_tokens = POOL_MAX_TOKENS
        # SiLU times up in one pass where it gives torch's bits (activation_cpu.available), else torch's two.
        self._silu_mul = activation_cpu.silu_mul_into if activation_cpu.available() else None

    def _scratch(self, tokens: int, floats_per_token: int) -> torch.Tensor:
        """A flat float32 buffer of at least ``tokens * floats_per_token`` floats, kept between steps.

        Fresh tensors per intermediate and step would make glibc map and unmap a prefill step's scratch
        (tens of MB) every step, page faults and zeroing included. The buffer only grows, to the largest
        step seen.
        """
        needed = tokens * floats_per_token
        if self._buffer.numel() < needed:
            if self.pool is not None:  # a late helper may still read the old buffer (the SiLU's rows)
                self.pool.quiesce()
            self._buffer = mapped_tensor(needed, torch.float32)
        return self._buffer[:needed]

    @classmethod
    def for_model(cls, model: DecoderForCausalLM) -> LeanCpuForward | None:
        """The lean forward of ``model``, or None where it does not apply.

        It applies to a model whose projections are fused and whose layers' weights are all packed
        (no bias but the q/k/v one), where the element-wise and attention C kernels are built. Build
        it after ``pack_weights``.
        """
        from asyncllm.models._llama import MLP, DecoderLayer

        spec = model.spec
        if spec.head_dim % 2 or not elementwise_cpu.available():
            return None
        if not attention_cpu.native_decode_available(spec.head_dim):
            return None
        layers = []
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)
            attention, mlp = layer.self_attn, layer.mlp
            if attention.qkv_proj is None or not isinstance(mlp, MLP) or mlp.gate_up_proj is None:
                return None  # unfused, or a MoE block (never lean: ``DecoderSpec.llama_layer``)
            qkv = _Matmul.of(attention.qkv_proj, bias_allowed=True)
            o, gate_up, down = (_Matmul.of(m) for m in (attention.o_proj, mlp.gate_up_proj, mlp.down_proj))
            if qkv is None or o is None or gate_up is None or down is None:
                return None
            q_norm, k_norm = attention.q_norm, attention.k_norm
            layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv=qkv,
                    qkv_bias=attention.qkv_proj.bias,
                    q_norm=None if q_norm is None else q_norm.weight,
                    k_norm=None if k_norm is None else k_norm.weight,
                    o=o,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=gate_up,
                    down=down,
                    sliding=not attention.global_in_windowed,
                )
            )
        return cls(model, layers)

    def __call__(
        self,
        embeddings: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: CpuAttentionMetadata,
    ) -> torch.Tensor:
        """Run the layer stack and the final norm; return normed hidden states [tokens, hidden].

        Args:
            embeddings: [tokens, hidden] the flat batch's input embeddings, contiguous; used as the
                residual stream (overwritten).
            cos_sin: The rotary cosines and sines of the tokens' positions, [tokens, head_dim] each
                (``RotaryEmbedding.cos_sin``).
            kv_caches: Each layer's (key cache, value cache).
            meta: The step's cpu attention metadata.

        Raises:
            ValueError: A KV cache is not a contiguous float32 or bfloat16 CPU tensor, or the slot mapping is not one
                int64 slot per token inside the cache.
            RuntimeError: An attention kernel could not allocate its scratch memory.
        """
        tokens, hidden = embeddings.shape[0], self._hidden
        heads, kv_heads, head_dim = self._heads, self._kv_heads, self._head_dim
        q_size, kv_size, intermediate = heads * head_dim, kv_heads * head_dim, self._intermediate
        qkv_size = q_size + 2 * kv_size
        eps, norm = self._eps, self._norm
        residual = embeddings
        if not residual.is_contiguous():
            raise ValueError("the lean forward needs contiguous embeddings")
        cos, sin = cos_sin
        elementwise_cpu.check_slots(meta.slot_mapping, tokens)
        slots_at, kv_dtype = meta.slot_mapping.data_ptr(), kv_caches[0][0].dtype
        write_kv = self._write_kv.get(kv_dtype)
        cache_rows, cache_shape = (kv_heads, head_dim), f"[slots, {kv_heads}, {head_dim}]"
        if write_kv is None:
            raise ValueError(f"the lean forward needs float32 or bfloat16 KV caches, not {kv_dtype}")
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            raise ValueError("the lean forward needs cos and sin rows of one layout, contiguous")
        # Scratch for every layer (rows contiguous), carved from one buffer kept between steps.
        widths = (hidden, qkv_size, q_size, hidden, 2 * intermediate, hidden)
        pieces = self._scratch(tokens, sum(widths)).split([tokens * width for width in widths])
        normed, qkv, attended, projected, gate_up, mlp_out = (
            piece.view(tokens, width) for piece, width in zip(pieces, widths, strict=True)
        )
        attended = attended.view(tokens, heads, head_dim)
        q = qkv[:, :q_size].view(tokens, heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        addresses = (normed.data_ptr(), qkv.data_ptr(), attended.data_ptr(), projected.data_ptr())
        normed_at, qkv_at, attended_at, projected_at = addresses
        gate_up_at, mlp_out_at, residual_at = gate_up.data_ptr(), mlp_out.data_ptr(), residual.data_ptr()
        up_at = up.data_ptr()
        pool = self.pool if tokens <= self.pool_max_tokens else None
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(self._layers, kv_caches, strict=True)):
            fits = k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            fits = fits and k_cache.shape[1:] == cache_rows and k_cache.dtype == v_cache.dtype == kv_dtype
            if not fits:
                raise ValueError(f"the lean forward needs contiguous KV caches of {cache_shape}, of one dtype")
            if index == 0:  # the embeddings are the residual stream: nothing to add yet
                norm(normed_at, residual_at, None, layer.input_norm.data_ptr(), tokens, hidden, hidden, hidden, 0, eps)
            else:
                norm(
                    normed_at, mlp_out_at, residual_at, layer.input_norm.data_ptr(),
                    tokens, hidden, hidden, hidden, hidden, eps,
                )  # fmt: skip
            layer.qkv(normed_at, hidden, tokens, qkv_at, qkv_size, pool)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            queries, keys = q, k
            if layer.q_norm is not None and layer.k_norm is not None:  # as ``RMSNorm.forward``: fresh tensors
                queries = torch.rms_norm(q, (head_dim,), layer.q_norm, eps)
                keys = torch.rms_norm(k, (head_dim,), layer.k_norm, eps)
            self._rotate(
                queries.data_ptr(), keys.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, kv_heads,
                head_dim // 2, queries.stride(0), queries.stride(1), keys.stride(0), keys.stride(1), cos.stride(0),
            )  # fmt: skip
            if write_kv(
                k_cache.data_ptr(), v_cache.data_ptr(), keys.data_ptr(), v.data_ptr(), slots_at,
                tokens, kv_size, keys.stride(0), qkv_size, k_cache.shape[0],
            ):  # fmt: skip
                raise ValueError(f"a KV slot lies outside the cache's {k_cache.shape[0]} slots")
            attention_cpu.attend_into(
                queries, keys, v, k_cache, v_cache, meta, self._scale, attended, sliding=layer.sliding, pool=pool
            )
            layer.o(attended_at, q_size, tokens, projected_at, hidden, pool)
            norm(
                normed_at, projected_at, residual_at, layer.post_norm.data_ptr(),
                tokens, hidden, hidden, hidden, hidden, eps,
            )  # fmt: skip
            layer.gate_up(normed_at, hidden, tokens, gate_up_at, 2 * intermediate, pool)
            if self._silu_mul is not None:
                self._silu_mul(gate_up_at, up_at, tokens, intermediate, 2 * intermediate, pool)
            else:
                F.silu(gate, inplace=True)
                gate.mul_(up)
            layer.down(gate_up_at, 2 * intermediate, tokens, mlp_out_at, hidden, pool)
        out = torch.empty(tokens, hidden)
        final_norm = self._final_norm.data_ptr()
        norm(out.data_ptr(), mlp_out_at, residual_at, final_norm, tokens, hidden, hidden, hidden, hidden, eps)
        return out
