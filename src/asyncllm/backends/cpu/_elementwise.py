"""RMSNorm (with the residual add fused in), rotary embeddings and the KV write as C kernels, float32 on the CPU.

torch has no fused RMSNorm kernel on the CPU: ``torch.rms_norm`` runs the composite (square, mean,
add, rsqrt, two multiplies), each op a pass over the tensor and a trip into the thread pool, which
at a decode step's few rows costs far more than the arithmetic. Rotary is five ops per tensor the
same way. Here each is one pass, called through ``ctypes`` (built by
``asyncllm.backends.cpu._native``; ``available()`` says whether it could be).

The KV write (``write_kv``) is ``index_copy_``'s result in one pass over the rows, with streaming stores
where the CPU has AVX-512: the cache rows a step writes are scattered, rarely in the cache, and an
ordinary store reads each line from memory first.

Numerics, against HF transformers' float32 path:

- rotary: the same products and sums in the same order, each rounded to float32 (the kernels are
  built with ``-ffp-contract=off``: no fused multiply-adds), so the result is bit for bit
  ``models._rotary.apply_rotary``'s;
- RMSNorm: the residual add is the same single float32 add; the mean square is summed in float32
  vector lanes in another order than torch's, so the normalised row can differ from torch's in
  the last bit. Greedy tokens still match transformers' (tests/models/test_parity.py runs this path).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from asyncllm.backends.cpu import _native as native
from asyncllm.backends.cpu._native import F32, I32, I64, PTR

__all__ = ["available", "check_slots", "kernel", "rms_norm", "rotary_", "write_kv"]

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Rows of at least this many floats in all go to OpenMP; fewer run on the calling thread (waking the
   pool costs more than a decode step's few rows of arithmetic). */
#define PARALLEL_FLOATS 65536

#define W 16
""" + native.VECTOR_HELPERS + r"""

/* The sum of squares of n floats: four vector accumulators (as torch's own reductions keep several),
   then their lanes, then the tail. */
static inline float sum_of_squares(const float *x, int64_t n) {
    vec acc[4] = {{0}, {0}, {0}, {0}};
    int64_t j = 0;
    for (; j + 4 * W <= n; j += 4 * W)
        for (int a = 0; a < 4; ++a) {
            const vec v = load(x + j + a * W);
            acc[a] += v * v;
        }
    for (; j + W <= n; j += W) {
        const vec v = load(x + j);
        acc[0] += v * v;
    }
    float sum = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
    for (; j < n; ++j) sum += x[j] * x[j];
    return sum;
}

/* out = weight * norm(x) per row; with residual: residual += x first, and the sum is normalised.
   Every tensor [rows, n], rows strided by its own stride; residual may be NULL. */
void asyncllm_rms_norm_f32(float *out, const float *x, float *residual, const float *weight, int64_t rows,
                           int64_t n, int64_t out_stride, int64_t x_stride, int64_t residual_stride, float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        const float *src = xr;
        if (residual) {
            float *res = residual + r * residual_stride;
            for (int64_t j = 0; j < n; ++j) res[j] = xr[j] + res[j];
            src = res;
        }
        const float mean = sum_of_squares(src, n) / (float)n;
        const float inv = 1.0f / sqrtf(mean + eps);
        for (int64_t j = 0; j < n; ++j) {
            const float normed = src[j] * inv;
            o[j] = weight[j] * normed;
        }
    }
}

/* In place on x [tokens, heads, head_dim] (tokens and heads strided, head_dim contiguous), the half-split
   layout: x1' = x1*c - x2*s, x2' = x2*c + x1*s, with c, s the first half of cos/sin's row [tokens, *]. */
static void rotate(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads, int64_t half,
                   int64_t token_stride, int64_t head_stride, int64_t angle_stride) {
#pragma omp parallel for schedule(static) if (tokens * heads * half >= PARALLEL_FLOATS / 2)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos + t * angle_stride;
        const float *s = sin + t * angle_stride;
        for (int64_t h = 0; h < heads; ++h) {
            float *x1 = x + t * token_stride + h * head_stride;
            float *x2 = x1 + half;
            for (int64_t j = 0; j < half; ++j) {
                const float a = x1[j], b = x2[j];
                const float ac = a * c[j], bs = b * s[j], bc = b * c[j], as = a * s[j];
                x1[j] = ac - bs;
                x2[j] = bc + as;
            }
        }
    }
}

void asyncllm_rotary_f32(float *q, float *k, const float *cos, const float *sin, int64_t tokens, int64_t q_heads,
                         int64_t k_heads, int64_t half, int64_t q_token_stride, int64_t q_head_stride,
                         int64_t k_token_stride, int64_t k_head_stride, int64_t angle_stride) {
    rotate(q, cos, sin, tokens, q_heads, half, q_token_stride, q_head_stride, angle_stride);
    rotate(k, cos, sin, tokens, k_heads, half, k_token_stride, k_head_stride, angle_stride);
}

/* Copy n floats to a cache row. The row's lines are rarely in the cache (a sequence's slots are scattered over
   the whole KV cache), and an ordinary store first reads each line from memory; with AVX-512, rows of whole
   64-byte lines at aligned addresses are written with streaming stores instead, which skip that read. */
static inline void store_row(float *dst, const float *src, int64_t n) {
#ifdef __AVX512F__
    if (n % 16 == 0 && (uintptr_t)dst % 64 == 0) {
        for (int64_t j = 0; j < n; j += 16) _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
        return;
    }
#endif
    memcpy(dst, src, sizeof(float) * (size_t)n);
}

/* The KV write: row t of k and v (row_floats each, rows strided by k_stride, v_stride: views into the fused
   projection) to row slots[t] of k_cache and v_cache ([num_slots, row_floats], contiguous). One copy per row,
   no temporaries. Returns 0, or -1 (writing nothing) when a slot is outside [0, num_slots). */
static int slots_inside(const int64_t *slots, int64_t tokens, int64_t num_slots) {
    for (int64_t t = 0; t < tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return 0;
    return 1;
}

int asyncllm_write_kv_f32(float *k_cache, float *v_cache, const float *k, const float *v, const int64_t *slots,
                          int64_t tokens, int64_t row_floats, int64_t k_stride, int64_t v_stride, int64_t num_slots) {
    if (!slots_inside(slots, tokens, num_slots)) return -1;
#pragma omp parallel if (tokens * row_floats >= PARALLEL_FLOATS)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t) {
            store_row(k_cache + slots[t] * row_floats, k + t * k_stride, row_floats);
            store_row(v_cache + slots[t] * row_floats, v + t * v_stride, row_floats);
        }
#ifdef __AVX512F__
        _mm_sfence(); /* each thread's streaming stores are visible before the attention reads them */
#endif
    }
    return 0;
}

/* float32 to bfloat16, rounded to nearest even (a NaN stays a NaN): the upper half of the rounded bits. */
static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* Row `row` of n floats to bfloat16 at dst, and the rounded values back into the row: the step's own rows then
   hold what the cache holds, so attention reads the same keys and values from either. */
static inline void round_row(uint16_t *dst, float *row, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
        const uint16_t rounded = to_bf16(row[j]);
        const uint32_t bits = (uint32_t)rounded << 16;
        dst[j] = rounded;
        memcpy(row + j, &bits, 4);
    }
}

/* asyncllm_write_kv_f32 into a bfloat16 cache ([num_slots, row_floats] bfloat16): each value rounded once, in the
   cache and in k and v themselves (round_row). Returns 0, or -1 (writing nothing) for a slot outside the cache. */
int asyncllm_write_kv_bf16(uint16_t *k_cache, uint16_t *v_cache, float *k, float *v, const int64_t *slots,
                           int64_t tokens, int64_t row_floats, int64_t k_stride, int64_t v_stride, int64_t num_slots) {
    if (!slots_inside(slots, tokens, num_slots)) return -1;
#pragma omp parallel for schedule(static) if (tokens * row_floats >= PARALLEL_FLOATS)
    for (int64_t t = 0; t < tokens; ++t) {
        round_row(k_cache + slots[t] * row_floats, k + t * k_stride, row_floats);
        round_row(v_cache + slots[t] * row_floats, v + t * v_stride, row_floats);
    }
    return 0;
}
"""


_SIGNATURES: native.Signatures = {
    "asyncllm_rms_norm_f32": ([PTR] * 4 + [I64] * 5 + [F32], None),
    "asyncllm_rotary_f32": ([PTR] * 4 + [I64] * 9, None),
    "asyncllm_write_kv_f32": ([PTR] * 5 + [I64] * 5, I32),
    "asyncllm_write_kv_bf16": ([PTR] * 5 + [I64] * 5, I32),
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    return native.load("elementwise", _SOURCE, _SIGNATURES, ("-ffp-contract=off",))


def available() -> bool:
    """Whether the kernels are built (building them now, once per process, if needed)."""
    return _library() is not None


@functools.cache
def kernel(name: str) -> Callable[..., int | None]:
    """The raw ``ctypes`` function ``name``: no checks. ``asyncllm_rms_norm_f32`` and ``asyncllm_rotary_f32``
    return nothing; ``asyncllm_write_kv_f32`` (and ``asyncllm_write_kv_bf16``, into a bfloat16 cache, rounding the
    rows it reads in place too) returns 0, or -1 for a slot outside the cache.

    For callers that own the layout of every pointer they pass (``asyncllm.backends.cpu._lean_forward``);
    everyone else calls ``rms_norm``, ``rotary_`` and ``write_kv``. RuntimeError when the kernels are unavailable.
    """
    library = _library()
    if library is None:
        raise RuntimeError("the cpu element-wise kernels are unavailable; see available()")
    function: Callable[..., int | None] = getattr(library, name)
    return function


def _check_rows(tensor: torch.Tensor, name: str, hidden: int) -> None:
    # A handful of attribute reads: at a decode step's few rows the call's Python overhead is the cost.
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        raise ValueError(f"{name} must be a float32 CPU tensor, got {tensor.dtype} on {tensor.device}")
    if tensor.dim() != 2 or tensor.shape[1] != hidden or tensor.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, {hidden}] with contiguous rows, got {tuple(tensor.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * rmsnorm(x)`` over the last dimension; with ``residual``, of ``x + residual``.

    Args:
        x: [rows, hidden] float32 CPU input (rows may be strided; each row contiguous).
        weight: [hidden] float32 contiguous scale.
        eps: Added to the mean square.
        residual: [rows, hidden] like ``x``; overwritten with ``x + residual``, which is then what
            is normalised.

    Returns:
        A new contiguous [rows, hidden] tensor.

    Raises:
        ValueError: Shapes, dtypes or layouts do not fit.
        RuntimeError: The kernels are unavailable.
    """
    hidden = weight.shape[0]
    _check_rows(x, "x", hidden)
    if weight.dim() != 1 or weight.stride(0) != 1 or weight.dtype != torch.float32:
        raise ValueError(f"weight must be a contiguous float32 [{hidden}] tensor")
    rows = x.shape[0]
    if residual is not None:
        _check_rows(residual, "residual", hidden)
        if residual.shape[0] != rows:
            raise ValueError(f"residual has {residual.shape[0]} rows, x has {rows}")
    out = torch.empty((rows, hidden), dtype=torch.float32)
    kernel("asyncllm_rms_norm_f32")(
        out.data_ptr(),
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        rows,
        hidden,
        hidden,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        eps,
    )
    return out


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``q`` [tokens, heads, head_dim] and ``k`` [tokens, kv_heads, head_dim] in place (float32, CPU).

    The half-split layout HF Llama uses; bit for bit ``models._rotary.apply_rotary``.

    Args:
        q: Queries; the head dimension contiguous (tokens and heads may be strided, e.g. views
            into a fused q/k/v projection).
        k: Keys; likewise.
        cos: [tokens, head_dim] cosines as ``RotaryEmbedding.cos_sin`` returns them (the first
            half of each row is read), rows contiguous.
        sin: Like ``cos``, sines.

    Raises:
        ValueError: Shapes, dtypes or layouts do not fit.
        RuntimeError: The kernels are unavailable.
    """
    tokens, q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share tokens and an even head_dim")
    if cos.shape != (tokens, head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos/sin {tuple(cos.shape)} must both be [{tokens}, {head_dim}] with equal strides")
    for name, tensor in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be a float32 CPU tensor with a contiguous last dimension")
    kernel("asyncllm_rotary_f32")(
        q.data_ptr(),
        k.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        tokens,
        q_heads,
        k.shape[1],
        head_dim // 2,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
    )


def check_slots(slots: torch.Tensor, tokens: int) -> None:
    """ValueError unless ``slots`` is ``tokens`` contiguous int64 values (what the KV write reads)."""
    if slots.dtype != torch.int64 or slots.shape != (tokens,) or not slots.is_contiguous():
        raise ValueError(f"the slots must be {tokens} contiguous int64 values, not {slots.dtype} {tuple(slots.shape)}")


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store a step's new keys and values at their cache slots: ``attention.write_kv``'s result, one C pass.

    Args:
        k_cache: [num_slots, kv_heads, head_dim] contiguous float32 CPU key cache.
        v_cache: Like ``k_cache``, for values.
        k: [tokens, kv_heads, head_dim] float32 keys; tokens may be strided (views into a fused
            projection), each token's heads contiguous.
        v: Like ``k``, values.
        slots: [tokens] contiguous int64 slot of each token.

    Raises:
        ValueError: Shapes, dtypes or layouts do not fit, or a slot lies outside the cache (then
            nothing is written).
        RuntimeError: The kernels are unavailable.
    """
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be one 3-D shape")
    num_slots, kv_heads, head_dim = k_cache.shape
    tokens = k.shape[0]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != torch.float32 or cache.device.type != "cpu" or not cache.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
    for name, rows in (("k", k), ("v", v)):
        if rows.dtype != torch.float32 or rows.device.type != "cpu" or rows.shape != (tokens, kv_heads, head_dim):
            raise ValueError(f"{name} must be [{tokens}, {kv_heads}, {head_dim}] float32 on the CPU")
        if rows.stride(2) != 1 or rows.stride(1) != head_dim:
            raise ValueError(f"each token's heads in {name} must be contiguous")
    check_slots(slots, tokens)
    failed = kernel("asyncllm_write_kv_f32")(
        k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(),
        tokens, kv_heads * head_dim, k.stride(0), v.stride(0), num_slots,
    )  # fmt: skip
    if failed:
        raise ValueError(f"a slot lies outside the cache's {num_slots} slots")
