"""SiLU of the gate times up, in one pass and bit for bit torch's, float32 on x86 CPUs with AVX-512 or AVX2.

An MLP's ``F.silu(gate, inplace=True)`` then ``gate.mul_(up)`` is two passes over the gate/up
projection's output, each a trip into torch's thread pool: at a prefill the output comes from memory
twice, at a decode step the two calls' fixed costs are most of the work. One C pass reads gate and up
once and writes the product (measurements: docs/performance-log.md, "Eighth round").

The result is exactly torch's: torch computes ``x / (1 + exp(-x))`` with SLEEF's ``expf16_u10``, two
AVX-512 vectors (32 floats) at a time (on AVX2, ``expf8_u10avx2`` on two vectors of 8), and with the C
library's ``expf`` on the rest of a stretch (up to 31 floats, or 15, whose bits can differ from the vector
path's), then the product in float32; a stretch is a
row, cut where torch's threads split the elements between them (``torch_piece``). This kernel calls
the same SLEEF function (exported by ``libtorch_cpu``; its address is passed in at load) and ``expf``
on the same stretches, with no fused multiply-adds. ``available()`` checks the claim once per process
against torch itself (tails of several lengths, strided halves of one tensor, a split mid-row), and
leaves the kernel unused where it does not hold (another torch build, another CPU).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from asyncllm.backends.cpu import _native as native
from asyncllm.backends.cpu import _pool as kernel_pool
from asyncllm.backends.cpu._native import I64, PTR

__all__ = ["TORCH_GRAIN", "available", "kernel_address", "silu_mul_", "silu_mul_into", "torch_piece"]

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
""" + kernel_pool.HEADER + r"""
/* Rows of at least this many floats in all go to OpenMP; fewer run on the calling thread. */
#define PARALLEL_FLOATS 65536

/* torch's vectors: 16 floats with AVX-512, else 8 (AVX2), and SLEEF's exponential of that width. */
#ifdef __AVX512F__
#define LANES 16
typedef __m512 vf;
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VMUL _mm512_mul_ps
#define VDIV _mm512_div_ps
#else
#define LANES 8
typedef __m256 vf;
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VADD _mm256_add_ps
#define VSUB _mm256_sub_ps
#define VMUL _mm256_mul_ps
#define VDIV _mm256_div_ps
#endif

typedef vf (*vector_exp)(vf);
static vector_exp vexp;

void asyncllm_silu_mul_init(void *sleef_expf_u10) { vexp = (vector_exp)sleef_expf_u10; }

/* torch's loop over one stretch of a row: two vectors at a time from the stretch's start, then the rest
   (up to 2 * LANES - 1 floats) element by element. */
static void stretch(float *g, const float *u, int64_t n) {
    const vf one = VSET1(1.0f), zero = VZERO();
    int64_t i = 0;
    for (; i + 2 * LANES <= n; i += 2 * LANES)
        for (int64_t j = i; j < i + 2 * LANES; j += LANES) {
            const vf x = VLOAD(g + j);
            const vf silu = VDIV(x, VADD(one, vexp(VSUB(zero, x))));
            VSTORE(g + j, VMUL(silu, VLOAD(u + j)));
        }
    for (; i < n; ++i) {
        const float x = g[i];
        g[i] = (x / (1.0f + expf(-x))) * u[i];
    }
}

/* gate[r, :n] = silu(gate[r, :n]) * up[r, :n] for r < rows; both with row stride `stride` (floats). torch
   splits the rows x n elements, in order, into pieces of `piece` for its threads, and each piece restarts
   the loop above: a row is done in stretches cut at the multiples of `piece`, as torch's would be. */
void asyncllm_silu_mul_f32(float *gate, const float *up, int64_t rows, int64_t n, int64_t stride, int64_t piece) {
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_FLOATS)
    for (int64_t r = 0; r < rows; ++r) {
        float *g = gate + r * stride;
        const float *u = up + r * stride;
        for (int64_t at = r * n, end = at + n; at < end;) {
            const int64_t cut = (at / piece + 1) * piece, stop = cut < end ? cut : end;
            stretch(g + (at - r * n), u + (at - r * n), stop - at);
            at = stop;
        }
    }
}

/* asyncllm_silu_mul_f32 as a job of the kernel pool (backends.cpu._pool): a task per row, computed into the
   participant's scratch and committed to the gate row. Gate and up are read in place, so the caller keeps
   their memory mapped while the pool lives (the lean forward's scratch: it quiesces the pool before it
   replaces that). Returns 1 once done, 0 when the pool cannot take it (a row larger than its scratch). */
typedef struct { float *gate; const float *up; int64_t n, stride, piece; } silu_job;

static void silu_compute(const void *context, int64_t r, int64_t next, void *scratch) {
    (void)next;
    const silu_job *job = context;
    float *g = scratch;
    const float *u = job->up + r * job->stride;
    memcpy(g, job->gate + r * job->stride, sizeof(float) * (size_t)job->n);
    for (int64_t at = r * job->n, end = at + job->n; at < end;) {
        const int64_t cut = (at / job->piece + 1) * job->piece, stop = cut < end ? cut : end;
        stretch(g + (at - r * job->n), u + (at - r * job->n), stop - at);
        at = stop;
    }
}

static void silu_direct(const void *context, int64_t r, int64_t next, void *scratch) {
    (void)next;
    (void)scratch;
    const silu_job *job = context;
    float *g = job->gate + r * job->stride;
    const float *u = job->up + r * job->stride;
    for (int64_t at = r * job->n, end = at + job->n; at < end;) {
        const int64_t cut = (at / job->piece + 1) * job->piece, stop = cut < end ? cut : end;
        stretch(g + (at - r * job->n), u + (at - r * job->n), stop - at);
        at = stop;
    }
}

static void silu_commit(const void *context, int64_t r, const void *scratch) {
    const silu_job *job = context;
    memcpy(job->gate + r * job->stride, scratch, sizeof(float) * (size_t)job->n);
}

int asyncllm_silu_mul_pooled(void *pool, void *run, int64_t threads, float *gate, const float *up, int64_t rows,
                             int64_t n, int64_t stride, int64_t piece) {
    const silu_job context = {gate, up, n, stride, piece};
    pool_job job = {silu_compute, silu_commit, silu_direct, rows, n * (int64_t)sizeof(float), threads,
                    sizeof context, {0}};
    memcpy(job.context, &context, sizeof context);
    return ((pool_run_fn)run)(pool, &job);
}
"""


_SIGNATURES: native.Signatures = {
    "asyncllm_silu_mul_init": ([PTR], None),
    "asyncllm_silu_mul_f32": ([PTR, PTR, I64, I64, I64, I64], None),
    "asyncllm_silu_mul_pooled": ([PTR, PTR, I64, PTR, PTR, I64, I64, I64, I64], ctypes.c_int),
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    flags = native.cpu_flags()
    if "avx512f" in flags:
        sleef_name = "Sleef_expf16_u10"  # what torch's AVX-512 build of its vectors calls
    elif {"avx2", "fma"} <= flags:
        sleef_name = "Sleef_expf8_u10avx2"  # and its AVX2 build
    else:
        return None
    torch_cpu = native.torch_cpu_library()
    if torch_cpu is None:
        return None
    try:
        sleef_exp = ctypes.cast(getattr(torch_cpu, sleef_name), ctypes.c_void_p).value
    except AttributeError:
        return None
    if not sleef_exp:
        return None
    library = native.load("silu_mul", _SOURCE, _SIGNATURES, ("-ffp-contract=off",))
    if library is None:
        return None
    library.asyncllm_silu_mul_init(sleef_exp)
    return library


@functools.cache
def available() -> bool:
    """Whether the kernel runs here and gives torch's bits (checked once per process)."""
    if _library() is None:
        return False
    generator = torch.Generator().manual_seed(0)
    # Tails of 16, 5 and 8 floats with AVX-512's vectors (none, 5 and 8 with AVX2's); with more than one thread,
    # torch's split in the middle of row 16 (33,000 elements) and between rows 34 and 35 (70,000).
    for rows, width in ((1, 48), (3, 37), (33, 1000), (70, 1000)):
        gate_up = torch.randn(rows, 2 * width, generator=generator) * 6
        expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
        silu_mul_(gate_up[:, :width], gate_up[:, width:])
        if not torch.equal(gate_up[:, :width], expected):
            return False
    return True


TORCH_GRAIN = 32768
"""torch's ``at::internal::GRAIN_SIZE``: element-wise ops on fewer elements run on one thread."""


def torch_piece(elements: int, threads: int | None = None) -> int:
    """How many of ``elements`` each of torch's threads takes in an element-wise op, as ``at::parallel_for``
    splits them with torch's current thread count, or ``threads`` (all of them when it runs on one thread)."""
    threads = torch.get_num_threads() if threads is None else threads
    if elements < TORCH_GRAIN or threads == 1:
        return max(elements, 1)
    pieces = min(threads, -(-elements // TORCH_GRAIN))
    return -(-elements // pieces)


def kernel_address(name: str) -> int:
    """The address of the SiLU library's C function ``name`` (``asyncllm_silu_mul_f32``,
    ``asyncllm_silu_mul_pooled``), for C code that calls it directly (``backends.cpu._lean_forward``)."""
    library = _library()
    if library is None:
        raise RuntimeError("the SiLU kernel needs an x86 CPU with AVX-512 or AVX2, a C compiler and torch's SLEEF")
    return native.address(getattr(library, name))


def silu_mul_into(
    gate: int, up: int, rows: int, width: int, stride: int, pool: kernel_pool.KernelPool | None = None
) -> None:
    """``gate = silu(gate) * up`` on raw addresses: ``rows`` rows of ``width`` floats, ``stride`` floats apart.

    No checks (``silu_mul_`` is the checked entry): for callers that own the layout
    (``asyncllm.backends.cpu._lean_forward``). With ``pool``, a row per task on that kernel pool where it takes
    them (``backends.cpu._pool``; the memory must stay mapped while the pool lives), else on OpenMP: same bits.
    """
    library = _library()
    if library is None:
        raise RuntimeError("the SiLU kernel needs an x86 CPU with AVX-512 or AVX2, a C compiler and torch's SLEEF")
    piece = torch_piece(rows * width, None if pool is None else pool.threads)  # torch's split at the step's count
    if pool is not None and library.asyncllm_silu_mul_pooled(
        pool.handle, pool.run, pool.threads, gate, up, rows, width, stride, piece
    ):
        return
    library.asyncllm_silu_mul_f32(gate, up, rows, width, stride, piece)


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate, inplace=True).mul_(up)`` in one pass; returns ``gate``.

    Both [rows, width] float32 CPU tensors with the same row stride and contiguous rows (the two
    halves of a gate/up projection's output, or two contiguous tensors).

    Raises:
        ValueError: The tensors do not have that layout.
        RuntimeError: The kernel is unavailable here.
    """
    if gate.dtype != torch.float32 or up.dtype != torch.float32 or gate.device.type != "cpu":
        raise ValueError(f"silu_mul_ needs float32 CPU tensors, not {gate.dtype} and {up.dtype} on {gate.device}")
    two_d = gate.dim() == 2 and gate.shape == up.shape
    one_stride = two_d and (gate.shape[0] <= 1 or gate.stride(0) == up.stride(0))
    if not one_stride or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(
            f"silu_mul_ needs two [rows, width] tensors with rows contiguous and one row stride, "
            f"not {tuple(gate.shape)} {gate.stride()} and {tuple(up.shape)} {up.stride()}"
        )
    if gate.numel():
        silu_mul_into(gate.data_ptr(), up.data_ptr(), gate.shape[0], gate.shape[1], gate.stride(0))
    return gate
