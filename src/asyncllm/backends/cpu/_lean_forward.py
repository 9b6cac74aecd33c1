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

Where every part of a layer is one of those C kernels (no q/k/v bias or q/k norms, which are torch ops; every
projection on its panels at the step's rows; prompt chunks the prefill kernel takes whole), the stack is a
single C call, ``asyncllm_lean_layers`` (``_DRIVER_SOURCE``): the same kernels in the same order, called through
their addresses, so that no Python runs between them (about twelve kernel calls a layer, whose Python is a
large share of a decode step at its few rows). Otherwise the same sequence runs from Python.

Steps of up to ``POOL_MAX_TOKENS`` tokens run their matmuls, decode attention and SiLU on the runner's kernel
pool (``pool``, ``backends.cpu._pool``) where it has one, same bits.

It applies to every family the decoder covers (llama, mistral, qwen2, qwen3) once the projections
are fused and every layer is packed, on the cpu attention backend (whose metadata it reads: the
backend says so, ``runs_lean_forward``) with the fused norms on; anything else runs the modules
(``DecoderForCausalLM.forward`` decides per step).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from asyncllm.backends.cpu import _activation as activation_cpu
from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.cpu import _elementwise as elementwise_cpu
from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu import _native as native
from asyncllm.backends.cpu import _pool as kernel_pool
from asyncllm.backends.cpu._attention import CpuAttentionMetadata
from asyncllm.backends.cpu._native import I32, PTR
from asyncllm.models._linear import PANEL_MAX_ROWS, Linear, on_panels, packed_matmul_into
from asyncllm.worker._memory import mapped_tensor

if TYPE_CHECKING:
    from asyncllm.models._llama import DecoderForCausalLM
__all__ = ["POOL_MAX_TOKENS", "LeanCpuForward"]

POOL_MAX_TOKENS = 64
"""Steps of at most this many tokens run on the kernel pool where there is one: decode-sized steps, whose
element-wise kernels run on the calling thread alone (under ``PARALLEL_FLOATS``), so OpenMP's threads stay
asleep; larger steps run on OpenMP throughout (two pools at once would spin against each other)."""


# The layer stack in C: it calls the kernels of the other cpu modules through the addresses ``_Kernels`` holds
# (``*.kernel_address``), with the arguments the Python path passes them.
_DRIVER_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>

typedef void (*norm_fn)(float *, const float *, float *, const float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                        float);
typedef void (*rotary_fn)(float *, float *, const float *, const float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t);
typedef int (*write_kv_fn)(void *, void *, float *, float *, const int64_t *, int64_t, int64_t, int64_t, int64_t,
                           int64_t);
typedef int (*gemm_pooled_fn)(void *, void *, char *, int64_t, int64_t, const float *, int64_t, const void *, float *,
                              int64_t, int64_t, int64_t, int64_t, int64_t);
typedef void (*gemm_f32_fn)(const float *, int64_t, const void *, float *, int64_t, int64_t, int64_t, int64_t);
typedef int (*gemm_bf16_fn)(const float *, int64_t, const void *, float *, int64_t, int64_t, int64_t, int64_t);
typedef int (*decode_pooled_fn)(void *, void *, char *, int64_t, int64_t, const float *, int64_t, const void *,
                                const void *, float *, const int64_t *, const int64_t *, const int64_t *, int64_t,
                                int64_t, int64_t, int64_t, int64_t, int64_t, float, float, int64_t);
typedef int (*decode_fn)(const float *, int64_t, const void *, const void *, float *, const int64_t *,
                         const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         float, float);
typedef int (*prefill_fn)(const float *, int64_t, const float *, const float *, float *, const int64_t *,
                          const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float, const int64_t *,
                          const int64_t *, const int64_t *, const void *, const void *);
typedef int (*silu_pooled_fn)(void *, void *, int64_t, float *, const float *, int64_t, int64_t, int64_t, int64_t);
typedef void (*silu_fn)(float *, const float *, int64_t, int64_t, int64_t, int64_t);

/* The kernels the layer stack calls (their libraries' functions), as the Python path calls them. */
typedef struct {
    norm_fn norm;
    rotary_fn rotary;
    write_kv_fn write_kv;
    gemm_pooled_fn gemm_pooled;
    gemm_f32_fn gemm_f32;
    gemm_bf16_fn gemm_bf16;
    gemm_pooled_fn gemm_bf16_pooled;  /* the bfloat16 panels' library's: another build on AVX-512 without BF16 */
    decode_pooled_fn decode_pooled;
    decode_fn decode;
    prefill_fn prefill;
    silu_pooled_fn silu_pooled;
    silu_fn silu;
} kernels;

/* A packed projection: its panels, and whether they hold bfloat16. */
typedef struct {
    const void *panels;
    int64_t bf16;
} projection;

typedef struct {
    const float *input_norm, *post_norm;
    projection qkv, o, gate_up, down;
    int64_t window;    /* the decode rows' window: the model's on a sliding layer, else 0 */
    int64_t windowed;  /* the prompt chunks' plan: 1 for a sliding layer of a model with global ones, else 0 */
} layer;

/* A prompt-chunk plan (the prefill kernel's arrays); chunks 0: none. */
typedef struct {
    const int64_t *starts, *ends, *history, *slots, *slot_starts;
    int64_t chunks;
} plan;

typedef struct {
    int64_t tokens, hidden, heads, kv_heads, head_dim, intermediate, layers;
    float eps, scale;
    float *residual, *normed, *qkv, *attended, *projected, *gate_up, *mlp_out, *out;
    const float *final_norm, *cos, *sin;
    int64_t cos_stride;
    const int64_t *slots;
    int64_t cache_slots;
    void *const *caches;  /* layer l: key cache 2l, value cache 2l + 1 */
    const int64_t *decode_rows, *decode_tables, *decode_lens;
    int64_t decodes, block_size, max_blocks;
    plan plans[2];
    void *pool, *run;
    char *input;
    int64_t input_bytes, threads, silu_piece;
} step;

static int project(const kernels *k, const step *s, const projection *p, const float *x, int64_t x_stride,
                   float *out, int64_t out_features, int64_t in_features) {
    const gemm_pooled_fn pooled = p->bf16 ? k->gemm_bf16_pooled : k->gemm_pooled;
    if (s->pool && pooled(s->pool, s->run, s->input, s->input_bytes, s->threads, x, x_stride, p->panels, out,
                          out_features, s->tokens, out_features, in_features, p->bf16))
        return 0;
    if (p->bf16) return k->gemm_bf16(x, x_stride, p->panels, out, out_features, s->tokens, out_features, in_features)
                        ? 0 : -3;
    k->gemm_f32(x, x_stride, p->panels, out, out_features, s->tokens, out_features, in_features);
    return 0;
}

/* The layer stack and the final norm, in the order and with the calls of LeanCpuForward's Python path (the
   same bits). 0, or -1 (a KV slot outside the cache), -2 (the decode attention's scratch), -3 (the bfloat16
   GEMM's scratch), -4 (the prefill attention's scratch): the step failed part-way. */
int asyncllm_lean_layers(const step *s, const layer *layers, const kernels *k) {
    const int64_t T = s->tokens, H = s->hidden, D = s->head_dim, I = s->intermediate;
    const int64_t q_size = s->heads * D, kv_size = s->kv_heads * D, qkv_size = q_size + 2 * kv_size;
    float *q = s->qkv, *key = s->qkv + q_size, *value = s->qkv + q_size + kv_size;
    int status;
    for (int64_t l = 0; l < s->layers; ++l) {
        const layer *L = layers + l;
        void *k_cache = s->caches[2 * l], *v_cache = s->caches[2 * l + 1];
        if (l == 0)
            k->norm(s->normed, s->residual, NULL, L->input_norm, T, H, H, H, 0, s->eps);
        else
            k->norm(s->normed, s->mlp_out, s->residual, L->input_norm, T, H, H, H, H, s->eps);
        if ((status = project(k, s, &L->qkv, s->normed, H, s->qkv, qkv_size, H))) return status;
        k->rotary(q, key, s->cos, s->sin, T, s->heads, s->kv_heads, D / 2, qkv_size, D, qkv_size, D, s->cos_stride);
        if (k->write_kv(k_cache, v_cache, key, value, s->slots, T, kv_size, qkv_size, qkv_size, s->cache_slots))
            return -1;
        if (s->decodes) {
            int done = s->pool && k->decode_pooled(s->pool, s->run, s->input, s->input_bytes, s->threads, q, qkv_size,
                                                   k_cache, v_cache, s->attended, s->decode_rows, s->decode_tables,
                                                   s->decode_lens, s->decodes, s->heads, s->kv_heads, s->block_size,
                                                   s->max_blocks, L->window, s->scale, 0.0f, s->cache_slots);
            if (!done && k->decode(q, qkv_size, k_cache, v_cache, s->attended, s->decode_rows, s->decode_tables,
                                   s->decode_lens, s->decodes, s->heads, s->kv_heads, s->block_size, s->max_blocks,
                                   L->window, s->scale, 0.0f))
                return -2;
        }
        const plan *P = &s->plans[L->windowed];
        if (P->chunks && k->prefill(q, qkv_size, key, value, s->attended, P->starts, P->ends, P->chunks, s->heads,
                                    s->kv_heads, qkv_size, qkv_size, s->scale, P->history, P->slots, P->slot_starts,
                                    k_cache, v_cache))
            return -4;
        if ((status = project(k, s, &L->o, s->attended, q_size, s->projected, H, q_size))) return status;
        k->norm(s->normed, s->projected, s->residual, L->post_norm, T, H, H, H, H, s->eps);
        if ((status = project(k, s, &L->gate_up, s->normed, H, s->gate_up, 2 * I, H))) return status;
        if (!(s->pool && k->silu_pooled(s->pool, s->run, s->threads, s->gate_up, s->gate_up + I, T, I, 2 * I,
                                        s->silu_piece)))
            k->silu(s->gate_up, s->gate_up + I, T, I, 2 * I, s->silu_piece);
        if ((status = project(k, s, &L->down, s->gate_up, 2 * I, s->mlp_out, H, I))) return status;
    }
    k->norm(s->out, s->mlp_out, s->residual, s->final_norm, T, H, H, H, H, s->eps);
    return 0;
}
"""


@functools.cache
def _driver() -> ctypes.CDLL | None:
    return native.load("lean_forward", _DRIVER_SOURCE, {"asyncllm_lean_layers": ([PTR, PTR, PTR], I32)})


_I64, _F32, _ADDRESS = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _Kernels(ctypes.Structure):
    _fields_ = [
        (name, _ADDRESS)
        for name in (
            "norm", "rotary", "write_kv", "gemm_pooled", "gemm_f32", "gemm_bf16", "gemm_bf16_pooled",
            "decode_pooled", "decode", "prefill", "silu_pooled", "silu",
        )
    ]  # fmt: skip


class _Projection(ctypes.Structure):
    _fields_ = [("panels", _ADDRESS), ("bf16", _I64)]


class _LayerArgs(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ADDRESS), ("post_norm", _ADDRESS), ("qkv", _Projection), ("o", _Projection),
        ("gate_up", _Projection), ("down", _Projection), ("window", _I64), ("windowed", _I64),
    ]  # fmt: skip


class _PlanArgs(ctypes.Structure):
    _fields_ = [(name, _ADDRESS) for name in ("starts", "ends", "history", "slots", "slot_starts")]
    _fields_ += [("chunks", _I64)]


class _StepArgs(ctypes.Structure):
    _fields_ = [
        (name, _I64) for name in ("tokens", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "layers")
    ]
    _fields_ += [("eps", _F32), ("scale", _F32)]
    _fields_ += [
        (name, _ADDRESS)
        for name in (
            "residual", "normed", "qkv", "attended", "projected", "gate_up", "mlp_out", "out", "final_norm", "cos",
            "sin",
        )
    ]  # fmt: skip
    _fields_ += [("cos_stride", _I64), ("slots", _ADDRESS), ("cache_slots", _I64), ("caches", _ADDRESS)]
    _fields_ += [("decode_rows", _ADDRESS), ("decode_tables", _ADDRESS), ("decode_lens", _ADDRESS)]
    _fields_ += [("decodes", _I64), ("block_size", _I64), ("max_blocks", _I64), ("plans", _PlanArgs * 2)]
    _fields_ += [("pool", _ADDRESS), ("run", _ADDRESS), ("input", _ADDRESS)]
    _fields_ += [("input_bytes", _I64), ("threads", _I64), ("silu_piece", _I64)]


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

    def projection(self) -> _Projection:
        """The panels as the C stack reads them."""
        return _Projection(self.panels, int(self.bfloat16))

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

    def arguments(self, window: int, has_global: bool) -> _LayerArgs:
        """The layer as the C stack reads it, for a step with this sliding window (0: none) and global layers."""
        return _LayerArgs(
            self.input_norm.data_ptr(), self.post_norm.data_ptr(), self.qkv.projection(), self.o.projection(),
            self.gate_up.projection(), self.down.projection(), window if self.sliding else 0,
            int(self.sliding and has_global),
        )  # fmt: skip


def _all_causal(meta: CpuAttentionMetadata) -> bool:
    """Whether every prompt chunk of the step is the prefill kernel's (no window cuts its context), as the C
    stack needs."""
    chunks = meta.prefills if meta.global_prefills is None else meta.prefills + meta.global_prefills
    return all(chunk.causal for chunk in chunks)


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
        # The whole stack in one C call (``_DRIVER_SOURCE``), for layers whose every part is a C kernel: no q/k/v
        # bias or q/k norms (torch ops), every projection on its panels; MKL's copies take rows above
        # PANEL_MAX_ROWS, so where a projection has one, steps up to that many rows only.
        matmuls = [m for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        in_c = self._silu_mul is not None and _driver() is not None and all(m.panels for m in matmuls)
        in_c = in_c and all(layer.qkv_bias is None and layer.q_norm is None for layer in layers)
        mkl_above = any(m.packed and not m.bfloat16 for m in matmuls)
        self._c_max_tokens = 0 if not in_c else PANEL_MAX_ROWS if mkl_above else 1 << 62
        self._c_kernels: dict[torch.dtype, _Kernels] = {}  # by the KV cache's dtype
        # By (window, global layers too), for the norm weights' addresses they were built with.
        self._c_layers: dict[tuple[int, bool], tuple[tuple[int, ...], ctypes.Array[_LayerArgs]]] = {}
        self._c_caches: tuple[tuple[object, ...], ctypes.Array[ctypes.c_void_p]] | None = None  # checked ones

    def _run_in_c(
        self,
        addresses: tuple[int, int, int, int, int, int, int],
        out: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: CpuAttentionMetadata,
        pool: kernel_pool.KernelPool | None,
    ) -> None:
        """The layer stack as one C call (``asyncllm_lean_layers``): the Python path's kernel calls, in its order,
        into the same scratch (``addresses``: residual, normed, qkv, attended, projected, gate_up, mlp_out)."""
        tokens = out.shape[0]
        k_cache = kv_caches[0][0]
        caches = self._checked_caches(kv_caches)
        window, has_global = meta.sliding_window or 0, meta.global_prefills is not None
        norms = tuple(weight.data_ptr() for layer in self._layers for weight in (layer.input_norm, layer.post_norm))
        built = self._c_layers.get((window, has_global))
        if built is None or built[0] != norms:  # the weights' memory is read where it is now, as the Python path does
            built = self._c_layers[(window, has_global)] = (
                norms,
                (_LayerArgs * len(self._layers))(*(layer.arguments(window, has_global) for layer in self._layers)),
            )
        layers = built[1]
        plans = [_PlanArgs(), _PlanArgs()]
        for windowed in (False, True) if has_global else (False,):
            plan = attention_cpu.kernel_plan(meta, windowed)
            if plan.chunks:
                bounds = plan.bounds
                plans[windowed] = _PlanArgs(
                    bounds[0].data_ptr(), bounds[1].data_ptr(), plan.history.data_ptr(), plan.slots.data_ptr(),
                    plan.slot_starts.data_ptr(), len(plan.chunks),
                )  # fmt: skip
        threads = None if pool is None else pool.threads
        step = _StepArgs(
            tokens, self._hidden, self._heads, self._kv_heads, self._head_dim, self._intermediate, len(self._layers),
            self._eps, self._scale, *addresses, out.data_ptr(), self._final_norm.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), cos.stride(0), meta.slot_mapping.data_ptr(), k_cache.shape[0], ctypes.addressof(caches),
            meta.decode_rows.data_ptr(), meta.decode_block_tables.data_ptr(), meta.decode_seq_lens.data_ptr(),
            meta.decode_rows.numel(), meta.block_size, meta.decode_block_tables.shape[1], (_PlanArgs * 2)(*plans),
            0 if pool is None else pool.handle, 0 if pool is None else pool.run, 0 if pool is None else pool.input,
            0 if pool is None else pool.input_bytes, threads or 1,
            activation_cpu.torch_piece(tokens * self._intermediate, threads),
        )  # fmt: skip
        driver = _driver()
        assert driver is not None  # ``_c_max_tokens`` is 0 without it
        status = driver.asyncllm_lean_layers(ctypes.byref(step), layers, ctypes.byref(self._kernels(k_cache.dtype)))
        if status == -1:
            raise ValueError(f"a KV slot lies outside the cache's {k_cache.shape[0]} slots")
        if status in (-2, -4):
            kind = "decode" if status == -2 else "prefill"
            raise RuntimeError(f"the cpu {kind} attention kernel could not allocate its scratch memory")
        if status == -3:
            raise MemoryError(f"no memory for {tokens} rows of a projection's inputs in bfloat16")

    def _checked_caches(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> ctypes.Array[ctypes.c_void_p]:
        """The caches' addresses (layer l's key cache at 2l, value cache at 2l + 1), checked as the Python path
        checks them (and of one size: the C call reads the first one's), again whenever any cache's address,
        shape, strides or dtype differs from the last checked ones (ValueError where they do not fit)."""
        tensors = [tensor for pair in kv_caches for tensor in pair]
        key = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)
        if self._c_caches is not None and self._c_caches[0] == key:
            return self._c_caches[1]
        first = kv_caches[0][0]
        heads, head_dim = self._kv_heads, self._head_dim
        if first.dtype not in self._write_kv:
            raise ValueError(f"the lean forward needs float32 or bfloat16 KV caches, not {first.dtype}")
        for k_cache, v_cache in kv_caches:
            fits = k_cache.is_contiguous() and v_cache.is_contiguous() and first.shape[1:] == (heads, head_dim)
            fits = fits and k_cache.shape == v_cache.shape == first.shape
            if not (fits and k_cache.dtype == v_cache.dtype == first.dtype):
                shape = f"[slots, {heads}, {head_dim}]"
                raise ValueError(f"the lean forward needs contiguous KV caches of {shape}, of one dtype and size")
        array = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
        self._c_caches = (key, array)
        return array

    def _kernels(self, kv_dtype: torch.dtype) -> _Kernels:
        """The C kernels' addresses for a ``kv_dtype`` cache, looked up once."""
        kernels = self._c_kernels.get(kv_dtype)
        if kernels is None:
            matmuls = (m for layer in self._layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
            head_dim, bfloat16 = self._head_dim, any(m.bfloat16 for m in matmuls)
            kernels = self._c_kernels[kv_dtype] = _Kernels(
                native.address(self._norm), native.address(self._rotate), native.address(self._write_kv[kv_dtype]),
                gemm_cpu.kernel_address("asyncllm_panel_matmul_pooled"),
                gemm_cpu.kernel_address("asyncllm_panel_matmul"),
                gemm_cpu.kernel_address("asyncllm_panel_matmul_bf16", bfloat16=True) if bfloat16 else 0,
                gemm_cpu.kernel_address("asyncllm_panel_matmul_pooled", bfloat16=True) if bfloat16 else 0,
                attention_cpu.kernel_address(head_dim, kv_dtype, "asyncllm_paged_decode_pooled"),
                attention_cpu.kernel_address(head_dim, kv_dtype, "asyncllm_paged_decode_f32"),
                attention_cpu.kernel_address(head_dim, kv_dtype, "asyncllm_causal_prefill_f32"),
                activation_cpu.kernel_address("asyncllm_silu_mul_pooled"),
                activation_cpu.kernel_address("asyncllm_silu_mul_f32"),
            )  # fmt: skip
        return kernels

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
        if tokens <= self._c_max_tokens and _all_causal(meta):
            out = torch.empty(tokens, hidden)
            buffers = (residual_at, normed_at, qkv_at, attended_at, projected_at, gate_up_at, mlp_out_at)
            self._run_in_c(buffers, out, cos, sin, kv_caches, meta, pool)
            return out
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
