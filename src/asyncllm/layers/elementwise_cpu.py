"""RMSNorm (with the residual add before it fused in) and rotary embeddings as C kernels, float32 on the CPU.

torch has no fused RMSNorm kernel on the CPU: ``torch.rms_norm`` runs the composite (square, mean,
add, rsqrt, two multiplies), each op a pass over the tensor and a trip into the thread pool. At a
decode step's few rows that is 0.1-0.2 ms per norm for microseconds of arithmetic, 17 norms a step
on the benchmark model; at a 2,048-token prefill it is seven passes over 4 MB. Rotary is five ops
per tensor the same way. Here each is one pass, called through ``ctypes`` (built by
``asyncllm.layers.native``; ``available()`` says whether it could be).

Numerics, against HF transformers' float32 path:

- rotary: the same products and sums in the same order, each rounded to float32 (the kernels are
  built with ``-ffp-contract=off``: no fused multiply-adds), so the result is bit for bit
  ``layers.rotary.apply_rotary``'s;
- RMSNorm: the residual add is the same single float32 add; the mean square is summed in float32
  vector lanes in another order than torch's, so the normalised row can differ from torch's in
  the last bit. Greedy tokens still match transformers' (tests/test_parity.py runs this path).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from asyncllm.layers import native

__all__ = ["available", "kernel", "rms_norm", "rotary_"]

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

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
"""


@functools.cache
def _library() -> ctypes.CDLL | None:
    path = native.build("elementwise", _SOURCE, ("-ffp-contract=off",))
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.asyncllm_rms_norm_f32.argtypes = [pointer] * 4 + [i64] * 5 + [ctypes.c_float]
    library.asyncllm_rms_norm_f32.restype = None
    library.asyncllm_rotary_f32.argtypes = [pointer] * 4 + [i64] * 9
    library.asyncllm_rotary_f32.restype = None
    return library


def available() -> bool:
    """Whether the kernels are built (building them now, once per process, if needed)."""
    return _library() is not None


@functools.cache
def kernel(name: str) -> Callable[..., None]:
    """The raw ``ctypes`` function ``name`` (``asyncllm_rms_norm_f32``, ``asyncllm_rotary_f32``): no checks.

    For callers that own the layout of every pointer they pass (``asyncllm.models.lean_cpu``);
    everyone else calls ``rms_norm`` and ``rotary_``. RuntimeError when the kernels are unavailable.
    """
    library = _library()
    if library is None:
        raise RuntimeError("the cpu element-wise kernels are unavailable; see available()")
    function: Callable[..., None] = getattr(library, name)
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

    The half-split layout HF Llama uses; bit for bit ``layers.rotary.apply_rotary``.

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
