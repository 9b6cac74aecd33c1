"""Float32 matmul against weights packed into column panels: a C kernel for x86 CPUs with AVX-512 or AVX2.

A decode step multiplies a few to a few dozen rows by every weight of the model, and the weights
do not stay in the cache between steps: each matmul streams its weight from memory. MKL's packed
GEMM (``models._linear``) does not fetch the weight ahead of its arithmetic, so at those row counts
it waits on memory; this kernel fetches the next panel while it computes.

Layout: the [out_features, in_features] weight becomes panels of 48 output columns (three 16-float
AVX-512 vectors), each panel ``in_features`` rows of 48 floats, the last panel zero-padded. One
panel is 96 KB at 512 inputs: it stays in the core's L2 cache while every row block of the input
passes over it.

The micro-kernel computes 8 rows x 48 columns: 24 vector accumulators, per input column three
weight vectors loaded and each of the 8 inputs broadcast once. While a thread works on panel p it
prefetches its next panel into L2, spread evenly over its row blocks' steps of the inner loop, so the next
panel arrives during the arithmetic instead of stalling it. Inputs of more than
256 rows are done 256 rows at a time, so that the input block stays in L2 as well. Threads (torch's
OpenMP pool) claim panels one at a time from a shared counter, each claiming its next panel as it starts
one: the claimed panel is the one it prefetches (with threads taking consecutive panels, panel p + 1 is
usually another thread's), and on a shared machine a thread that loses its core for a while holds two
panels at most and leaves the rest to the others. The same panels run as tasks of the kernel pool
(``pooled_matmul_into``, ``panel_argmax(..., pool=)``; ``backends.cpu._pool``), where the caller takes over a
stalled thread's panels instead of waiting for it at the region's barrier.

AVX2 with FMA (no AVX-512: AMD Zen 1-3, Intel's client cores): 16 vector registers of 8 floats, so the same
panels are computed a 16-column strip at a time, 6 rows x 16 columns per micro-kernel call (12 accumulators).
Each group of up to 30 rows passes over the panel's three strips in turn (the strip's lines are reused from the
cache by the group's row blocks), its outputs in a block on the stack, then stored or reduced to each row's
largest. The AVX-512 kernel's register block on AVX2 would spill; a row block outside the strip loop ran at
half this rate (docs/performance-log.md, "Twenty-seventh session").

bfloat16 panels (``PanelWeight(..., bfloat16=True)``): the weight rounded to bfloat16, multiplied by the input
rows rounded to bfloat16 once per call, summed in float32; half the weight bytes. With AVX512-BF16 the panels
of 48 columns hold pairs of inputs for its dot-pair instruction (two bfloat16 products added to each float32
lane, twice float32's arithmetic rate). On AVX2 (no AVX-512) they hold one input's 48 columns per step, and the
strip micro-kernel widens each 16-column strip to float32 (a zero extension and a shift: exact) for the same
fused multiply-adds as float32 panels, in input order, on inputs rounded and kept as float32: float32's
arithmetic rate, half its weight bytes, where torch's own bfloat16 ran at a tenth of float32's speed. AVX-512
without BF16 gets these AVX2 panels from a second build of this source (``bfloat16_build``). Both read
subnormal operands as zero (float32 ones before rounding, bfloat16 ones after). Their bfloat16 outputs are not the
same bits: the dot pairs add input 2k + 1 before 2k and flush subnormal sums to zero, AVX2 sums in input order.

Numerics: each output is the float32 fused multiply-add chain over the inputs in order, one
rounding per step, the same bits from either micro-kernel (MKL sums in another order; both differ from the
exact product by float32 rounding only; greedy tokens match transformers', tests/models/test_parity.py).

Use: decode-sized inputs. For prefill-sized ones the arithmetic decides and MKL blocks for the
caches better, so ``models._linear`` sends inputs of more than ``PANEL_MAX_ROWS`` rows to MKL's layout
where it keeps both. The measurements: docs/performance-log.md, "Fifth round".

Shared with MKL's packed layout (``models._linear``): the packing source and input checks, and the
tensor side of a packed matmul (``matmul_with``: one wrapper, two raw-address GEMMs).
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable
from typing import Literal

import torch

from asyncllm.backends.cpu import _native as native
from asyncllm.backends.cpu import _pool as kernel_pool
from asyncllm.backends.cpu._native import I64, PTR
from asyncllm.worker._memory import mapped_tensor

__all__ = [
    "PANEL_COLUMNS",
    "MatmulInto",
    "PanelArgmaxHead",
    "PanelWeight",
    "available",
    "bfloat16_available",
    "bfloat16_panel_matmul_into",
    "check_input",
    "kernel_address",
    "matmul_with",
    "packing_source",
    "panel_argmax",
    "panel_matmul",
    "panel_matmul_into",
    "pooled_matmul_into",
]

PANEL_COLUMNS = 48
"""Output columns per panel: three AVX-512 vectors of 16 floats (three strips of 16 on AVX2)."""

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
""" + kernel_pool.HEADER + r"""
#define COLUMNS 48                 /* output columns per panel */
#ifdef __AVX512F__
#define ROWS 8                     /* input rows per micro-kernel call */
#define VECTORS 3                  /* 16-float vectors per panel row */
#else                              /* AVX2 with FMA: 16 vector registers */
#define ROWS 6                     /* input rows per micro-kernel call: 6 x 16 columns, 12 accumulators */
#define STRIP 16                   /* columns per pass: a panel is three strips, one cache line of each input */
#endif
#define ROW_BLOCK 256              /* input rows done per pass over the panels */
#define LINE 64
#if defined(__AVX512BF16__) || !defined(__AVX512F__)
#define BF16_PANELS 1              /* AVX512-BF16's dot pairs, or AVX2's float32 FMAs on widened values */
#endif
#ifdef __AVX512F__
#define PAIR_BYTES 4               /* a row's rounded input pair: two bfloat16 values */
#else
#define PAIR_BYTES 8               /* two float32 values holding bfloat16 ones */
#endif

#ifdef BF16_PANELS
static inline uint16_t to_bf16(float value) {  /* round to nearest even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* An input as AVX512-BF16's conversion gives it, held as float32: a subnormal value as zero (of its sign), else
   rounded to bfloat16 (to nearest even; NaN stays NaN). */
static inline float rounded_input(float value);

/* A float32 subnormal value as zero (of its sign), as AVX512-BF16's conversion reads it; other values as they are. */
static inline float flushed(float value) { return fpclassify(value) == FP_SUBNORMAL ? copysignf(0.0f, value) : value; }

/* A bfloat16 value as AVX512-BF16 reads it: subnormal values as zero (of their sign). */
static inline float from_bf16(uint16_t value) {
    const uint32_t bits = (value & 0x7F80u) ? (uint32_t)value << 16 : (uint32_t)(value & 0x8000u) << 16;
    float result;
    memcpy(&result, &bits, 4);
    return result;
}

static inline float rounded_input(float value) { return from_bf16(to_bf16(flushed(value))); }
#endif

void asyncllm_panel_pack(const float *weight, float *panels, int64_t out_features, int64_t in_features) {
    const int64_t count = (out_features + COLUMNS - 1) / COLUMNS;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; ++p)
        for (int64_t j = 0; j < COLUMNS; ++j) {
            const int64_t n = p * COLUMNS + j;
            float *column = panels + p * in_features * COLUMNS + j;
            for (int64_t k = 0; k < in_features; ++k)
                column[k * COLUMNS] = n < out_features ? weight[n * in_features + k] : 0.0f;
        }
}

#ifdef __AVX512F__
static inline __attribute__((always_inline)) void store_block(__m512 acc[ROWS][VECTORS], float *restrict out,
        int64_t out_stride, int64_t columns, const int rows) {
    for (int v = 0; v < VECTORS; ++v) {
        const int64_t left = columns - 16 * v;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out + r * out_stride + 16 * v, mask, acc[r][v]);
    }
}

/* Greedy rows need only each row's largest output: the micro-kernels can reduce their block to that
   instead of storing it (no [rows, out_features] logits written, then read again by an argmax). */
#endif

typedef struct {
    float *values;     /* [rows, stride]: per row and panel, the largest output (NaN if any output was NaN) */
    int32_t *indices;  /* [rows, stride]: the first column holding it; -1 where no column of the panel counts */
    int64_t stride;    /* the panel count */
    int64_t valid;     /* columns from this one on do not count (padding past a vocabulary) */
    int64_t slot;      /* -1: each panel's own column of the target; else this column (a pool task's scratch) */
} argmax_target;

#ifdef __AVX512F__
/* Per row r < rows of a panel whose first column is first_column: the largest of its outputs in columns below
   target->valid, and the first column holding it, with NaN reported as the value. Equal values (+0 and -0
   included) go to the first column, as torch.argmax gives. */
static inline __attribute__((always_inline)) void argmax_block(__m512 acc[ROWS][VECTORS],
        const argmax_target *target, int64_t row0, int64_t panel, int64_t first_column, int64_t columns,
        const int rows) {
    const int64_t counted = target->valid - first_column < columns ? target->valid - first_column : columns;
    __mmask16 masks[VECTORS];
    for (int v = 0; v < VECTORS; ++v) {
        const int64_t left = counted - 16 * v;
        masks[v] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    }
    for (int r = 0; r < rows; ++r) {
        __m512 top = _mm512_set1_ps(-INFINITY);
        __mmask16 unordered = 0;
        for (int v = 0; v < VECTORS; ++v) {
            unordered |= _mm512_mask_cmp_ps_mask(masks[v], acc[r][v], acc[r][v], _CMP_UNORD_Q);
            top = _mm512_mask_max_ps(top, masks[v], top, acc[r][v]);
        }
        const float best = _mm512_reduce_max_ps(top);
        int32_t index = -1;
        for (int v = 0; v < VECTORS && index < 0; ++v) {
            const unsigned hit = _mm512_mask_cmp_ps_mask(masks[v], acc[r][v], _mm512_set1_ps(best), _CMP_EQ_OQ);
            if (hit) index = (int32_t)(first_column + 16 * v + __builtin_ctz(hit));
        }
        const int64_t at = (row0 + r) * target->stride + (target->slot < 0 ? panel : target->slot);
        target->values[at] = unordered ? NAN : best;
        target->indices[at] = index;
    }
}

/* A block's outputs: stored, or with a target reduced to each row's largest (argmax_block). */
#define FINISH_BLOCK(acc, out, out_stride, columns, rows) do { \
        if (target) argmax_block(acc, target, row0, panel_index, panel_index * COLUMNS, columns, rows); \
        else store_block(acc, out, out_stride, columns, rows); } while (0)

/* out[r, 0:columns] = x[r, :] . panel for r < rows. While computing, prefetch `lines` cache lines from
   `ahead` into L2, evenly: `rate` lines per `in_features` input columns, a running remainder carrying the
   fractions, so the fetches neither bunch up nor leave the end of the block without any. */
static inline __attribute__((always_inline)) void micro(const float *restrict x, int64_t x_stride,
        const float *restrict panel, float *restrict out, int64_t out_stride, int64_t in_features, int64_t columns,
        const int rows, const char *restrict ahead, int64_t lines, int64_t rate, const argmax_target *target,
        int64_t row0, int64_t panel_index) {
    __m512 acc[ROWS][VECTORS];
    int64_t owed = in_features - 1; /* in units of 1 / in_features lines; the first line goes at once */
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in_features; ++k) {
        __m512 w[VECTORS];
        for (int v = 0; v < VECTORS; ++v) w[v] = _mm512_loadu_ps(panel + k * COLUMNS + 16 * v);
        if (lines > 0) {
            for (owed += rate; owed >= in_features && lines > 0; owed -= in_features, --lines, ahead += LINE)
                _mm_prefetch(ahead, _MM_HINT_T1);
        }
        for (int r = 0; r < rows; ++r) {
            const __m512 a = _mm512_set1_ps(x[r * x_stride + k]);
            for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_fmadd_ps(a, w[v], acc[r][v]);
        }
    }
    FINISH_BLOCK(acc, out, out_stride, columns, rows);
}

#else
/* The AVX2 kernel: a panel's 48 columns as three strips of 16, each computed by 6-row x 16-column passes over
   the inputs (strip_micro; every output the same fused multiply-add chain in input order as the AVX-512
   kernel's, so the same bits), into a block on the stack that panel_rows stores or reduces to each row's
   largest output (argmax_rows). */
static inline __attribute__((always_inline)) __m256 lanes_below(int64_t left) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 0 ? 0 : left > 8 ? 8 : left)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* argmax_block's reduction (largest output below target->valid, first column holding it, NaN reported) over a
   block of rows x 48 outputs. */
static inline __attribute__((always_inline)) void argmax_rows(float (*block)[COLUMNS],
        const argmax_target *target, int64_t row0, int64_t panel, int64_t first_column, int64_t columns,
        const int rows) {
    const int64_t counted = target->valid - first_column < columns ? target->valid - first_column : columns;
    for (int r = 0; r < rows; ++r) {
        __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        for (int v = 0; v < COLUMNS / 8; ++v) {
            const __m256 counts = lanes_below(counted - 8 * v), value = _mm256_loadu_ps(block[r] + 8 * v);
            unordered = _mm256_or_ps(unordered, _mm256_and_ps(counts, _mm256_cmp_ps(value, value, _CMP_UNORD_Q)));
            top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), value, counts));
        }
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        const float best = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
        int32_t index = -1;
        for (int v = 0; v < COLUMNS / 8 && index < 0; ++v) {
            const __m256 equal = _mm256_cmp_ps(_mm256_loadu_ps(block[r] + 8 * v), _mm256_set1_ps(best), _CMP_EQ_OQ);
            const unsigned hit = (unsigned)_mm256_movemask_ps(_mm256_and_ps(equal, lanes_below(counted - 8 * v)));
            if (hit) index = (int32_t)(first_column + 8 * v + __builtin_ctz(hit));
        }
        const int64_t at = (row0 + r) * target->stride + (target->slot < 0 ? panel : target->slot);
        target->values[at] = _mm256_movemask_ps(unordered) ? NAN : best;
        target->indices[at] = index;
    }
}

/* Eight weights of a strip step as float32: float32 panels' as they are; bfloat16 panels' (AVX2's layout, pack_bf16)
   widened (a zero extension and a shift: exact). */
static inline __attribute__((always_inline)) __m256 strip_weights(const void *strip, int64_t at, const int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)strip + at))), 16));
    return _mm256_loadu_ps((const float *)strip + at);
}

/* block[r, 0:16] = x[r, :] . strip for r < rows (block rows COLUMNS floats apart), prefetching `lines` cache
   lines from `ahead` evenly over the inputs. With bf16 the strip holds bfloat16 and x the rows rounded to bfloat16
   and held as float32 (round_rows_f32): the same fused multiply-adds on the widened values. */
static inline __attribute__((always_inline)) void strip_micro(const float *restrict x, int64_t x_stride,
        const void *restrict strip, float *restrict block, int64_t in_features, const int rows,
        const char *restrict ahead, int64_t lines, const int bf16) {
    __m256 acc[ROWS][STRIP / 8];
    int64_t owed = in_features - 1;
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < STRIP / 8; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in_features; ++k) {
        __m256 w[STRIP / 8];
        for (int v = 0; v < STRIP / 8; ++v) w[v] = strip_weights(strip, k * COLUMNS + 8 * v, bf16);
        if (lines > 0) {
            for (owed += lines; owed >= in_features; owed -= in_features, ahead += LINE)
                _mm_prefetch(ahead, _MM_HINT_T1);
        }
        for (int r = 0; r < rows; ++r) {
            const __m256 a = _mm256_broadcast_ss(x + r * x_stride + k);
            for (int v = 0; v < STRIP / 8; ++v) acc[r][v] = _mm256_fmadd_ps(a, w[v], acc[r][v]);
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < STRIP / 8; ++v) _mm256_storeu_ps(block + r * COLUMNS + 8 * v, acc[r][v]);
}

/* Rows first..last of x rounded to bfloat16 (to nearest even; NaN stays NaN, subnormal values become zero, as
   AVX512-BF16 reads them) and held as float32, each padded with zeros to `width` inputs: rounded[r - first]. */
static void round_rows_f32(const float *x, int64_t x_stride, int64_t first, int64_t last, int64_t in_features,
                           int64_t width, float *rounded) {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF), infinity = _mm256_set1_epi32(0x7F800000);
    const __m256i exponent = _mm256_set1_epi32(0x7F800000), high = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF), quiet = _mm256_set1_epi32(0x400000);
#pragma omp for schedule(static)
    for (int64_t r = first; r < last; ++r) {
        const float *source = x + r * x_stride;
        float *target = rounded + (r - first) * width;
        int64_t k = 0;
        for (; k + 8 <= in_features; k += 8) {
            const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(source + k));
            const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, magnitude), infinity);
            const __m256i subnormal = _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), _mm256_setzero_si256());
            const __m256i even = _mm256_add_epi32(_mm256_add_epi32(bits, half),
                                                  _mm256_and_si256(_mm256_srli_epi32(bits, 16), one));
            __m256i result = _mm256_blendv_epi8(even, _mm256_or_si256(bits, quiet), nan);
            result = _mm256_andnot_si256(subnormal, _mm256_and_si256(result, high));
            result = _mm256_or_si256(result, _mm256_and_si256(subnormal, _mm256_andnot_si256(magnitude, bits)));
            _mm256_storeu_ps(target + k, _mm256_castsi256_ps(result));
        }
        for (; k < width; ++k) target[k] = k < in_features ? rounded_input(source[k]) : 0.0f;
    }
}

#define GROUP 30  /* the most rows per pass over a panel's strips: their outputs (5.6 KB) stay on the stack */
_Static_assert(ROWS == 6, "panel_rows's switch has a case for each row count below ROWS");

/* Rows first..last of x against one panel: in groups of at most GROUP rows, each strip of 16 columns for every
   row block of the group in turn (the strip is reused from the cache by the group's blocks), then the group's
   outputs stored to out[r, 0:columns] (out: row `first`'s first column) or reduced to each row's largest
   (argmax_rows). Groups and blocks are cut evenly (32 rows: two groups of 16, blocks of 6, 5, 5), not ROWS
   rows and a remainder: a block of 1 or 2 rows has too few accumulator chains to hide the FMA's latency, so
   it costs most of a full block's time. The next panel's `lines` from `ahead` are prefetched evenly over the
   micro-kernel calls. Row r of x is at x + (r - x_first) * x_stride. With bf16 the panel holds bfloat16 (AVX2's
   layout) and x the rows rounded by round_rows_f32; `in_features` counts inputs either way. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, int64_t x_stride, int64_t x_first,
        const void *panel, float *out, int64_t out_stride, int64_t first, int64_t last, int64_t in_features,
        int64_t columns, const char *ahead, int64_t lines, const argmax_target *target, int64_t panel_index,
        const int bf16) {
    float block[GROUP][COLUMNS];
    const int64_t strips = (columns + STRIP - 1) / STRIP, rows = last - first;
    const int64_t groups = (rows + GROUP - 1) / GROUP;
    int64_t calls = 0, owed = 0;
    for (int64_t i = 0; i < groups; ++i) {
        const int64_t size = rows / groups + (i < rows % groups);
        calls += strips * ((size + ROWS - 1) / ROWS);
    }
    for (int64_t i = 0, g = first; i < groups; ++i) {
        const int64_t size = rows / groups + (i < rows % groups), g_last = g + size;
        const int64_t blocks = (size + ROWS - 1) / ROWS;
        for (int64_t s = 0; s < strips; ++s)
            for (int64_t j = 0, r0 = g; j < blocks; ++j) {
                const int64_t n = size / blocks + (j < size % blocks);
                /* This call's share of the lines: a running remainder spreads them over every call. */
                const int64_t share = (owed + lines) / calls;
                owed = (owed + lines) % calls;
/* Two calls, so that each inlines with a constant bf16 (a pool task's is known only at run time). */
#define PANEL_MICRO(n) do { \
        const void *strip = bf16 ? (const void *)((const uint16_t *)panel + s * STRIP) \
                                 : (const void *)((const float *)panel + s * STRIP); \
        if (bf16) strip_micro(x + (r0 - x_first) * x_stride, x_stride, strip, block[r0 - g] + s * STRIP, \
                              in_features, n, ahead, share, 1); \
        else strip_micro(x + (r0 - x_first) * x_stride, x_stride, strip, block[r0 - g] + s * STRIP, \
                         in_features, n, ahead, share, 0); } while (0)
                switch (n) {  /* a constant row count per call, so that the accumulators stay in registers */
                    case 1: PANEL_MICRO(1); break; case 2: PANEL_MICRO(2); break; case 3: PANEL_MICRO(3); break;
                    case 4: PANEL_MICRO(4); break; case 5: PANEL_MICRO(5); break; default: PANEL_MICRO(ROWS); break;
                }
#undef PANEL_MICRO
                ahead += LINE * share;
                r0 += n;
            }
        if (target) {
            argmax_rows(block, target, g, panel_index, panel_index * COLUMNS, columns, (int)size);
        } else {
            for (int64_t r = g; r < g_last; ++r)
                memcpy(out + (r - first) * out_stride, block[r - g], sizeof(float) * (size_t)columns);
        }
        g = g_last;
    }
}
#endif

#ifdef BF16_PANELS
/* The bfloat16 panels, zeros past the weight. With AVX512-BF16: per panel and input pair (2k, 2k+1), 48 columns of
   two bfloat16 values, the pair of column j at 2j and 2j+1 (the layout of its dot-pair instruction). On AVX2: per
   panel and input k (up to a whole number of pairs), the 48 columns' bfloat16 values, subnormal ones stored as
   zero (the widened values then read as AVX512-BF16 reads them). The weight is float32 (rounded to nearest even)
   or, with `from_bf16`, bfloat16 already (copied). */
static inline __attribute__((always_inline)) void pack_bf16(const void *weight, uint16_t *panels,
        int64_t out_features, int64_t in_features, const int from_bf16) {
    const int64_t count = (out_features + COLUMNS - 1) / COLUMNS, pairs = (in_features + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < count; ++p)
        for (int64_t j = 0; j < COLUMNS; ++j) {
            const int64_t n = p * COLUMNS + j;
            for (int64_t k = 0; k < 2 * pairs; ++k) {
                const int64_t at = n * in_features + k;
                uint16_t value = n >= out_features || k >= in_features ? 0
                    : from_bf16 ? ((const uint16_t *)weight)[at] : to_bf16(flushed(((const float *)weight)[at]));
#ifdef __AVX512BF16__
                panels[p * pairs * 2 * COLUMNS + (k / 2) * 2 * COLUMNS + 2 * j + k % 2] = value;
#else
                if (!(value & 0x7F80u)) value &= 0x8000u;
                panels[(p * 2 * pairs + k) * COLUMNS + j] = value;
#endif
            }
        }
}

void asyncllm_panel_pack_bf16(const float *weight, uint16_t *panels, int64_t out_features, int64_t in_features) {
    pack_bf16(weight, panels, out_features, in_features, 0);
}

void asyncllm_panel_pack_bf16_from_bf16(const uint16_t *weight, uint16_t *panels, int64_t out_features,
                                        int64_t in_features) {
    pack_bf16(weight, panels, out_features, in_features, 1);
}
#endif

#ifdef __AVX512BF16__
/* micro's arithmetic on bfloat16 pairs: per input pair, each row's pair broadcast and one dot-pair
   instruction per vector (two products added to each float32 sum). `x` holds the rows' pairs, `pairs` each. */
static inline __attribute__((always_inline)) void micro_bf16(const uint32_t *restrict x, int64_t pairs,
        const uint16_t *restrict panel, float *restrict out, int64_t out_stride, int64_t columns,
        const int rows, const char *restrict ahead, int64_t lines, int64_t rate, const argmax_target *target,
        int64_t row0, int64_t panel_index) {
    __m512 acc[ROWS][VECTORS];
    int64_t owed = pairs - 1;
    for (int r = 0; r < rows; ++r)
        for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < pairs; ++k) {
        __m512bh w[VECTORS];
        for (int v = 0; v < VECTORS; ++v) w[v] = (__m512bh)_mm512_loadu_si512(panel + k * 2 * COLUMNS + 32 * v);
        if (lines > 0) {
            for (owed += rate; owed >= pairs && lines > 0; owed -= pairs, --lines, ahead += LINE)
                _mm_prefetch(ahead, _MM_HINT_T1);
        }
        for (int r = 0; r < rows; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[r * pairs + k]);
            for (int v = 0; v < VECTORS; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, w[v]);
        }
    }
    FINISH_BLOCK(acc, out, out_stride, columns, rows);
}

/* Rows first..last of x to bfloat16 (round to nearest even), each padded with a zero to whole pairs. */
static void round_rows(const float *x, int64_t x_stride, int64_t first, int64_t last, int64_t in_features,
                       int64_t pairs, uint32_t *rounded) {
#pragma omp for schedule(static)
    for (int64_t r = first; r < last; ++r) {
        const float *source = x + r * x_stride;
        uint16_t *target = (uint16_t *)(rounded + (r - first) * pairs);
        int64_t k = 0;
        for (; k + 16 <= in_features; k += 16)
            _mm256_storeu_si256((__m256i *)(target + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(source + k)));
        for (; k < 2 * pairs; ++k) target[k] = k < in_features ? to_bf16(flushed(source[k])) : 0;
    }
}
#define MICRO_BF16(n) micro_bf16((const uint32_t *)rounded + (r0 - first) * steps, steps, (const uint16_t *)panel, \
                                 o, out_stride, columns, n, ahead, lines, lines_per_block, target, r0, p)
#endif

#define MICRO(n) micro((const float *)x + r0 * x_stride, x_stride, (const float *)panel, o, out_stride, steps, \
                       columns, n, ahead, lines, lines_per_block, target, r0, p)

/* A constant row count per call, so that the accumulators stay in registers. */
#define BY_ROWS(CALL) switch (last - r0 < ROWS ? last - r0 : ROWS) { \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(ROWS); break; }

/* Both GEMMs: inputs ROW_BLOCK rows at a time, threads claiming panels one at a time from a shared counter (a
   thread that loses its core to another process for a while does not hold the others up at the end, as a
   static split would), each claiming its next panel when it starts one and prefetching it over the current
   one's row blocks.
   A panel is `steps` steps of 192 bytes: 48 floats per input, or per input pair 48 bfloat16 pairs (AVX512-BF16)
   or the pair's two inputs' 48 bfloat16 values each (AVX2). Returns 0 if the bfloat16 rows' scratch cannot be
   allocated (the rows rounded: bfloat16 pairs with AVX512-BF16, float32 values on AVX2, PAIR_BYTES per pair). */
static inline __attribute__((always_inline)) int panel_matmul(const float *x, int64_t x_stride, const char *panels,
        float *out, int64_t out_stride, int64_t rows, int64_t out_features, int64_t in_features, const int bf16,
        const argmax_target *target) {
    const int64_t count = (out_features + COLUMNS - 1) / COLUMNS, steps = bf16 ? (in_features + 1) / 2 : in_features;
    const int64_t panel_bytes = steps * COLUMNS * 4, panel_lines = panel_bytes / LINE;
    void *rounded = NULL;
    if (bf16) {
        rounded = malloc((size_t)((rows < ROW_BLOCK ? rows : ROW_BLOCK) * steps * PAIR_BYTES));
        if (rounded == NULL) return 0;
    }
    for (int64_t first = 0; first < rows; first += ROW_BLOCK) {
        const int64_t last = rows - first < ROW_BLOCK ? rows : first + ROW_BLOCK;
        const int64_t blocks = (last - first + ROWS - 1) / ROWS;
        /* The next panel's lines, shared out over this panel's row blocks. */
        const int64_t lines_per_block = (panel_lines + blocks - 1) / blocks;
        (void)lines_per_block;  /* the AVX2 path spreads its prefetches by itself */
        int64_t unclaimed = 0;  /* the next panel no thread has claimed */
#pragma omp parallel
        {
#ifdef __AVX512BF16__
            if (bf16) round_rows(x, x_stride, first, last, in_features, steps, rounded);  /* ends in a barrier */
#elif !defined(__AVX512F__)
            if (bf16) round_rows_f32(x, x_stride, first, last, in_features, 2 * steps, rounded);  /* a barrier */
#endif
            int64_t p = __atomic_fetch_add(&unclaimed, 1, __ATOMIC_RELAXED);
            while (p < count) {
                /* The panel after this one is claimed now, so that it is the one prefetched. */
                const int64_t q = __atomic_fetch_add(&unclaimed, 1, __ATOMIC_RELAXED);
                const char *panel = panels + p * panel_bytes;
                const int64_t columns = (p + 1) * COLUMNS <= out_features ? COLUMNS : out_features - p * COLUMNS;
                const int has_next = q < count;
#ifndef __AVX512F__
                if (bf16)
                    panel_rows(rounded, 2 * steps, first, panel, target ? NULL : out + first * out_stride + p * COLUMNS,
                               out_stride, first, last, 2 * steps, columns, has_next ? panels + q * panel_bytes : panel,
                               has_next ? panel_lines : 0, target, p, 1);
                else
                    panel_rows(x, x_stride, 0, panel, target ? NULL : out + first * out_stride + p * COLUMNS,
                               out_stride, first, last, steps, columns, has_next ? panels + q * panel_bytes : panel,
                               has_next ? panel_lines : 0, target, p, 0);
#else
                for (int64_t r0 = first; r0 < last; r0 += ROWS) {
                    const int64_t block = (r0 - first) / ROWS, done = block * lines_per_block;
                    const int64_t lines = !has_next || done >= panel_lines ? 0
                        : (lines_per_block < panel_lines - done ? lines_per_block : panel_lines - done);
                    const char *ahead = has_next ? panels + q * panel_bytes + LINE * done : panel;
                    float *o = target ? NULL : out + r0 * out_stride + p * COLUMNS;
#ifdef __AVX512BF16__
                    if (bf16) { BY_ROWS(MICRO_BF16) continue; }
#endif
                    BY_ROWS(MICRO)
                }
#endif
                p = q;
            }
        }
    }
    free(rounded);
    return 1;
}

void asyncllm_panel_matmul(const float *x, int64_t x_stride, const float *panels, float *out, int64_t out_stride,
                           int64_t rows, int64_t out_features, int64_t in_features) {
    panel_matmul(x, x_stride, (const char *)panels, out, out_stride, rows, out_features, in_features, 0, NULL);
}

static void reduce_argmax(const argmax_target *target, int64_t rows, int64_t *tokens);

/* tokens[r] = the first column below `valid` where x[r] . weight.T is largest (what torch.argmax of the GEMM's
   outputs gives), or -1 where an output of the row is NaN; the outputs themselves are never stored. Returns 0
   if scratch memory ran out. */
static int panel_argmax(const float *x, int64_t x_stride, const char *panels, int64_t *tokens, int64_t rows,
                        int64_t out_features, int64_t in_features, int64_t valid, const int bf16) {
    const int64_t count = (out_features + COLUMNS - 1) / COLUMNS;
    argmax_target target = {malloc((size_t)(rows * count) * sizeof(float)),
                            malloc((size_t)(rows * count) * sizeof(int32_t)), count, valid, -1};
    int ok = target.values && target.indices
        && panel_matmul(x, x_stride, panels, NULL, 0, rows, out_features, in_features, bf16, &target);
    if (ok) reduce_argmax(&target, rows, tokens);
    free(target.values);
    free(target.indices);
    return ok;
}

/* tokens[r]: the token of row r from its panels' largest outputs ([rows, count] in `target`). */
static void reduce_argmax(const argmax_target *target, int64_t rows, int64_t *tokens) {
    const int64_t count = target->stride;
    for (int64_t r = 0; r < rows; ++r) {
        const float *values = target->values + r * count;
        const int32_t *indices = target->indices + r * count;
        float best = -INFINITY;
        int64_t token = -1;
        for (int64_t p = 0; p < count; ++p) {
            if (isnan(values[p])) {
                token = -1;
                break;
            }
            /* Strictly larger: among equal values the earlier panel's column stays. */
            if (indices[p] >= 0 && (token < 0 || values[p] > best)) {
                best = values[p];
                token = indices[p];
            }
        }
        tokens[r] = token;
    }
}

int asyncllm_panel_argmax(const float *x, int64_t x_stride, const float *panels, int64_t *tokens, int64_t rows,
                          int64_t out_features, int64_t in_features, int64_t valid) {
    return panel_argmax(x, x_stride, (const char *)panels, tokens, rows, out_features, in_features, valid, 0);
}

#ifdef BF16_PANELS
int asyncllm_panel_matmul_bf16(const float *x, int64_t x_stride, const uint16_t *panels, float *out,
                               int64_t out_stride, int64_t rows, int64_t out_features, int64_t in_features) {
    return panel_matmul(x, x_stride, (const char *)panels, out, out_stride, rows, out_features, in_features, 1, NULL);
}

int asyncllm_panel_argmax_bf16(const float *x, int64_t x_stride, const uint16_t *panels, int64_t *tokens,
                               int64_t rows, int64_t out_features, int64_t in_features, int64_t valid) {
    return panel_argmax(x, x_stride, (const char *)panels, tokens, rows, out_features, in_features, valid, 1);
}
#endif

/* The panel GEMM as a job of the kernel pool (backends.cpu._pool): a task per panel, computed into the
   participant's scratch ([rows, 48] outputs, or per row the panel's largest output and its column) and then
   committed to the output. The input is first copied into the pool's input buffer (rows rounded to bfloat16,
   or float32 rows), which outlives any late helper; one that reads it while a later job overwrites it computes
   garbage and drops it (its task was taken). */
typedef struct {
    const char *x;
    const char *panels;
    float *out;
    int64_t out_stride, rows, out_features, steps, count, panel_bytes, panel_lines, lines_per_block;
    int64_t bf16;
    argmax_target target;  /* values NULL: store the outputs */
} panel_job;

/* Panel p into the scratch (direct 0) or straight into the output (direct 1). */
static inline __attribute__((always_inline)) void panel_task(const panel_job *job, int64_t p, int64_t q,
                                                             void *scratch, const int direct) {
    const int64_t first = 0, last = job->rows, steps = job->steps, x_stride = steps;
    const int64_t out_stride = direct ? job->out_stride : COLUMNS;
    const int64_t panel_bytes = job->panel_bytes, panel_lines = job->panel_lines;
    const int64_t lines_per_block = job->lines_per_block;
    const char *panels = job->panels, *panel = panels + p * panel_bytes;
    const int64_t columns = (p + 1) * COLUMNS <= job->out_features ? COLUMNS : job->out_features - p * COLUMNS;
    const int has_next = q >= 0 && q < job->count;
    argmax_target into = job->target;
    const argmax_target *target = into.values && direct ? &job->target : NULL;
    if (into.values && !direct) {
        into.values = scratch;
        into.indices = (int32_t *)((float *)scratch + last);
        into.stride = 1;
        into.slot = 0;
        target = &into;
    }
    const float *x = (const float *)job->x;
    (void)x;
    (void)lines_per_block;
#ifdef __AVX512BF16__
    const uint32_t *rounded = (const uint32_t *)job->x;
#endif
#ifndef __AVX512F__
    const int bf16 = job->bf16 != 0;  /* the rows rounded to float32 values: two per input pair */
    panel_rows((const float *)job->x, bf16 ? 2 * steps : x_stride, 0, panel, target ? NULL
               : direct ? job->out + p * COLUMNS : (float *)scratch, out_stride, first, last, bf16 ? 2 * steps : steps,
               columns, has_next ? panels + q * panel_bytes : panel, has_next ? panel_lines : 0, target, p, bf16);
#else
    for (int64_t r0 = first; r0 < last; r0 += ROWS) {
        const int64_t block = (r0 - first) / ROWS, done = block * lines_per_block;
        const int64_t lines = !has_next || done >= panel_lines ? 0
            : (lines_per_block < panel_lines - done ? lines_per_block : panel_lines - done);
        const char *ahead = has_next ? panels + q * panel_bytes + LINE * done : panel;
        float *o = target ? NULL
            : direct ? job->out + r0 * out_stride + p * COLUMNS : (float *)scratch + r0 * COLUMNS;
#ifdef __AVX512BF16__
        if (job->bf16) { BY_ROWS(MICRO_BF16) continue; }
#endif
        BY_ROWS(MICRO)
    }
#endif
}

static void panel_compute(const void *context, int64_t p, int64_t q, void *scratch) {
    panel_task(context, p, q, scratch, 0);
}

static void panel_direct(const void *context, int64_t p, int64_t q, void *scratch) {
    panel_task(context, p, q, scratch, 1);
}

static void panel_commit(const void *context, int64_t p, const void *scratch) {
    const panel_job *job = context;
    if (job->target.values) {
        const float *values = scratch;
        const int32_t *indices = (const int32_t *)(values + job->rows);
        for (int64_t r = 0; r < job->rows; ++r) {
            job->target.values[r * job->count + p] = values[r];
            job->target.indices[r * job->count + p] = indices[r];
        }
        return;
    }
    const int64_t columns = (p + 1) * COLUMNS <= job->out_features ? COLUMNS : job->out_features - p * COLUMNS;
    for (int64_t r = 0; r < job->rows; ++r)
        memcpy(job->out + r * job->out_stride + p * COLUMNS, (const float *)scratch + r * COLUMNS,
               sizeof(float) * (size_t)columns);
}

/* 1 once done; 0 when the pool cannot take it (too many rows for its input buffer or scratch): the caller then
   runs the OpenMP GEMM. */
static int pooled_matmul(void *pool, void *run, char *input, int64_t input_bytes, int64_t threads, const float *x,
        int64_t x_stride, const char *panels, float *out, int64_t out_stride, int64_t rows, int64_t out_features,
        int64_t in_features, int bf16, argmax_target target) {
    const int64_t count = (out_features + COLUMNS - 1) / COLUMNS, steps = bf16 ? (in_features + 1) / 2 : in_features;
    if (rows < 1 || rows > ROW_BLOCK || rows * steps * (bf16 ? PAIR_BYTES : 4) > input_bytes) return 0;
#ifndef BF16_PANELS
    if (bf16) return 0;  /* no bfloat16 panels in this build (AVX-512 without BF16): the caller's OpenMP one */
#endif
#ifdef __AVX512BF16__
    if (bf16) round_rows(x, x_stride, 0, rows, in_features, steps, (uint32_t *)input);  /* no team: this thread */
#elif !defined(__AVX512F__)
    if (bf16) round_rows_f32(x, x_stride, 0, rows, in_features, 2 * steps, (float *)input);  /* no team: this thread */
#endif
    if (!bf16)
        for (int64_t r = 0; r < rows; ++r)
            memcpy(input + r * steps * 4, x + r * x_stride, sizeof(float) * (size_t)in_features);
    const int64_t panel_bytes = steps * COLUMNS * 4, blocks = (rows + ROWS - 1) / ROWS;
    const panel_job context = {input, panels, out, out_stride, rows, out_features, steps, count, panel_bytes,
                               panel_bytes / LINE, (panel_bytes / LINE + blocks - 1) / blocks, bf16, target};
    pool_job job = {panel_compute, panel_commit, panel_direct, count, rows * COLUMNS * (int64_t)sizeof(float), threads,
                    sizeof context, {0}};
    memcpy(job.context, &context, sizeof context);
    return ((pool_run_fn)run)(pool, &job);
}

int asyncllm_panel_matmul_pooled(void *pool, void *run, char *input, int64_t input_bytes, int64_t threads,
        const float *x, int64_t x_stride, const void *panels, float *out, int64_t out_stride, int64_t rows,
        int64_t out_features, int64_t in_features, int64_t bf16) {
    const argmax_target none = {NULL, NULL, 0, 0, -1};
    return pooled_matmul(pool, run, input, input_bytes, threads, x, x_stride, panels, out, out_stride, rows,
                         out_features, in_features, (int)bf16, none);
}

/* panel_argmax on the pool: 1 once `tokens` holds the rows' tokens, 0 when the pool cannot take it, -1 when scratch
   memory ran out. */
int asyncllm_panel_argmax_pooled(void *pool, void *run, char *input, int64_t input_bytes, int64_t threads,
        const float *x, int64_t x_stride, const void *panels, int64_t *tokens, int64_t rows, int64_t out_features,
        int64_t in_features, int64_t valid, int64_t bf16) {
    const int64_t count = (out_features + COLUMNS - 1) / COLUMNS;
    argmax_target target = {malloc((size_t)(rows * count) * sizeof(float)),
                            malloc((size_t)(rows * count) * sizeof(int32_t)), count, valid, -1};
    int done = -1;
    if (target.values && target.indices) {
        done = pooled_matmul(pool, run, input, input_bytes, threads, x, x_stride, panels, NULL, 0, rows, out_features,
                             in_features, (int)bf16, target);
        if (done == 1) reduce_argmax(&target, rows, tokens);
    }
    free(target.values);
    free(target.indices);
    return done;
}
"""


def _has_vector_unit() -> bool:
    """x86 with AVX-512, or with AVX2 and FMA (the kernel's two micro-kernels)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = native.cpu_flags()
    return "avx512f" in flags or {"avx2", "fma"} <= flags


_SIGNATURES: native.Signatures = {
    "asyncllm_panel_pack": ([PTR, PTR, I64, I64], None),
    "asyncllm_panel_matmul": ([PTR, I64, PTR, PTR, I64, I64, I64, I64], None),
    "asyncllm_panel_argmax": ([PTR, I64, PTR, PTR, I64, I64, I64, I64], ctypes.c_int),
    "asyncllm_panel_matmul_pooled": ([PTR, PTR, PTR, I64, I64, PTR, I64, PTR, PTR, *[I64] * 5], ctypes.c_int),
    "asyncllm_panel_argmax_pooled": ([PTR, PTR, PTR, I64, I64, PTR, I64, PTR, PTR, *[I64] * 5], ctypes.c_int),
}
_BFLOAT16_SIGNATURES: native.Signatures = {
    "asyncllm_panel_pack_bf16": ([PTR, PTR, I64, I64], None),
    "asyncllm_panel_pack_bf16_from_bf16": ([PTR, PTR, I64, I64], None),
    "asyncllm_panel_matmul_bf16": ([PTR, I64, PTR, PTR, I64, I64, I64, I64], ctypes.c_int),
    "asyncllm_panel_argmax_bf16": ([PTR, I64, PTR, PTR, I64, I64, I64, I64], ctypes.c_int),
}


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not _has_vector_unit():
        return None
    return native.load("panel_gemm", _SOURCE, _SIGNATURES)


def bfloat16_build(flags: set[str] | frozenset[str]) -> Literal["native", "avx2"] | None:
    """Which build of the kernel has the bfloat16 panels on a CPU with these flags (``native.cpu_flags``).

    "native": the ``-march=native`` one, with AVX512-BF16's dot pairs, or with AVX2's widened values where
    there is no AVX-512. "avx2": a second build with AVX-512 switched off (``-mno-avx512f``), for AVX-512
    without BF16 (Skylake-X, Cascade Lake, Ice Lake), whose native build has no bfloat16 panels: AVX2's
    widened values at half AVX-512's vector width are still several times torch's bfloat16 there. None:
    no AVX2 and FMA.
    """
    if "avx512f" in flags and "avx512_bf16" not in flags:
        return "avx2"
    return "native" if "avx512f" in flags or {"avx2", "fma"} <= flags else None


@functools.cache
def _avx2_library() -> ctypes.CDLL | None:
    """The kernel built with AVX-512 switched off: the AVX2 micro-kernels, bfloat16 panels included."""
    return native.load("panel_gemm_avx2", _SOURCE, {**_SIGNATURES, **_BFLOAT16_SIGNATURES}, ("-mno-avx512f",))


@functools.cache
def _bfloat16_library() -> ctypes.CDLL | None:
    """The library whose functions take bfloat16 panels (packing, OpenMP and pooled GEMMs, argmax): every call
    on such panels goes to it, since the two builds' layouts differ. None where no build has them."""
    library = _library()
    build = bfloat16_build(native.cpu_flags()) if library is not None else None
    if build == "avx2":
        return _avx2_library()
    if library is None or build is None:
        return None
    try:
        return native.declare(library, _BFLOAT16_SIGNATURES)
    except AttributeError:  # a compiler that does not define __AVX512BF16__ for this CPU
        return None


@functools.cache
def available() -> bool:
    """Whether the kernel runs here (x86 with AVX-512 or AVX2 and FMA, a C compiler) and agrees with ``F.linear``.

    Checked once per process, building the kernel if needed.
    """
    if _library() is None:
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 37, generator=generator)  # a partial last panel, an odd input width
    panels = PanelWeight(weight)
    for rows in (1, 9, 300):
        x = torch.randn(rows, 37, generator=generator)
        if not torch.allclose(panels.linear(x), torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4):
            return False
    return True


@functools.cache
def bfloat16_available() -> bool:
    """Whether the bfloat16 panels run here (x86 with AVX2 and FMA, or AVX-512) and compute what they claim.

    The claim: each output is a float32 sum of the products of the input and the weight both rounded
    to bfloat16, subnormal values read as zero as AVX512-BF16 reads them (checked against float64 on such
    values once per process, building the kernel if needed).
    """
    if _bfloat16_library() is None or not available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 37, generator=generator)
    panels = PanelWeight(weight, bfloat16=True)
    for rows in (1, 9, 300):
        x = torch.randn(rows, 37, generator=generator)
        exact = x.bfloat16().double() @ weight.bfloat16().double().T
        if not torch.allclose(panels.linear(x).double(), exact, rtol=1e-5, atol=1e-5):
            return False
    return True


def packing_source(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as the contiguous 2-D float32 CPU tensor a packer reads; ValueError for anything else."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"packing needs a 2-D float32 CPU weight, not {weight.dtype} {tuple(weight.shape)}")
    return weight.detach().contiguous()


def check_input(x: torch.Tensor, in_features: int) -> None:
    """ValueError unless ``x`` is a [..., in_features] float32 CPU tensor (the packed weights' input)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != in_features:
        raise ValueError(f"expected [..., {in_features}] float32 CPU input, got {x.dtype} {tuple(x.shape)}")


class PanelWeight:
    """A float32 [out_features, in_features] CPU weight packed into column panels for ``panel_matmul``.

    With ``bfloat16`` the panels hold the weight rounded to bfloat16 (half the bytes; the weight may be
    bfloat16 itself), and the GEMM multiplies them by the input rounded to bfloat16 too, summing in float32
    (AVX512-BF16's dot-pair instruction, twice float32's arithmetic rate; elsewhere AVX2's float32 multiply-adds
    on the widened values); the buffer's dtype (``torch.bfloat16``) says which. The layout differs between the two.
    """

    def __init__(self, weight: torch.Tensor, *, bfloat16: bool = False) -> None:
        library = _bfloat16_library() if bfloat16 else _library()
        if library is None:
            raise RuntimeError("the panel GEMM needs an x86 CPU with AVX-512 or AVX2 with FMA, and a C compiler")
        from_bfloat16 = bfloat16 and weight.dtype == torch.bfloat16
        if from_bfloat16 and (weight.device.type != "cpu" or weight.dim() != 2):
            raise ValueError(f"packing needs a 2-D CPU weight, not {weight.device.type} {tuple(weight.shape)}")
        source = weight.detach().contiguous() if from_bfloat16 else packing_source(weight)
        self.out_features, self.in_features = (int(size) for size in weight.shape)
        panels = -(-self.out_features // PANEL_COLUMNS) * PANEL_COLUMNS
        # Huge pages where the kernel gives them: every decode step streams every weight.
        if bfloat16:
            self.buffer = mapped_tensor(panels * 2 * -(-self.in_features // 2), torch.bfloat16)
            pack = library.asyncllm_panel_pack_bf16_from_bf16 if from_bfloat16 else library.asyncllm_panel_pack_bf16
        else:
            self.buffer = mapped_tensor(panels * self.in_features, torch.float32)
            pack = library.asyncllm_panel_pack
        pack(source.data_ptr(), self.buffer.data_ptr(), self.out_features, self.in_features)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` from the panels; ``x`` is [..., in_features] float32."""
        check_input(x, self.in_features)
        return panel_matmul(x, self.buffer, bias, self.out_features)

    def argmax(self, x: torch.Tensor, valid: int | None = None) -> torch.Tensor:
        """``panel_argmax`` of ``x`` over these panels: ``linear(x)[:, :valid].argmax(-1)``, outputs never stored."""
        valid = self.out_features if valid is None else valid
        return panel_argmax(x, self.buffer, self.out_features, valid, in_features=self.in_features)


class PanelArgmaxHead:
    """Greedy tokens from an output projection on panels, its argmax fused into the GEMM (``panel_argmax``).

    A greedy row needs only its largest logit's column: the [rows, vocab] logits are never written, nor
    read again by an argmax. The same panels compute the logits of every other row, so the token equals
    the argmax of the row's logits exactly. The model's ``greedy_head`` where the output projection runs on
    bfloat16 panels, and on float32 panels where ``_greedy_head``'s cheaper bound cannot run (no AMX or
    AVX512-BF16).

    Args:
        panels: The output projection's ``PanelWeight`` buffer (float32 or bfloat16).
        out_features: Its output columns.
        valid: Columns that count (the vocabulary; beyond it, padding).
        in_features: Its input width (None: the input's own, which bfloat16 panels of an even width cannot
            tell from one less).
    """

    def __init__(self, panels: torch.Tensor, out_features: int, valid: int, in_features: int | None = None) -> None:
        self.panels, self.out_features, self.valid, self.in_features = panels, out_features, valid, in_features
        self.pool: kernel_pool.KernelPool | None = None
        """The kernel pool to run on (the runner's, ``backends.cpu._pool``), or None for OpenMP's threads."""

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows] int64 tokens for [rows, hidden] float32 states; -1 in a row with a NaN logit (the caller's
        logits path decides it, as torch would), and in every row where the call's scratch memory could not
        be allocated (as ``_greedy_head.GreedyHead`` leaves them)."""
        try:
            return panel_argmax(
                hidden, self.panels, self.out_features, self.valid, in_features=self.in_features, pool=self.pool
            )
        except MemoryError:
            return torch.full((hidden.shape[0],), -1, dtype=torch.int64)


def panel_argmax(
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    valid: int,
    *,
    in_features: int | None = None,
    pool: kernel_pool.KernelPool | None = None,
) -> torch.Tensor:
    """[rows] int64: per row of ``x`` ([rows, in_features] float32), the first of the columns below ``valid`` where
    ``x @ weight.T`` (``weight`` packed into ``panels`` by ``PanelWeight``) is largest, as torch.argmax of the
    panel GEMM's outputs gives, without storing them; -1 in a row with a NaN output (torch would return the
    NaN's column). ``in_features``: the weight's width, checked against ``x``'s (None: ``x``'s own, checked
    against the panels' size only, which bfloat16 panels of an even width share with one less). With ``pool``, on
    that kernel pool (``backends.cpu._pool``) at torch's thread count where it takes the rows, else on OpenMP.

    Raises:
        ValueError: ``x`` is not [rows, in_features] float32 on the CPU, or ``valid`` is out of range.
        MemoryError: The call's scratch memory could not be allocated.
    """
    bfloat16 = panels.dtype == torch.bfloat16
    if in_features is None:
        in_features = x.shape[-1]
    steps = 2 * -(-in_features // 2) if bfloat16 else in_features  # bfloat16 panels hold whole input pairs
    if panels.numel() != -(-out_features // PANEL_COLUMNS) * PANEL_COLUMNS * steps:
        raise ValueError(
            f"input of width {in_features} does not fit these panels ({panels.numel()} values, {out_features} outputs)"
        )
    check_input(x, in_features)
    if x.dim() != 2:
        raise ValueError(f"expected [rows, {in_features}] input, got {tuple(x.shape)}")
    if not 0 < valid <= out_features:
        raise ValueError(f"valid must be in [1, {out_features}], got {valid}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64)
    if rows == 0:
        return tokens
    library = _bfloat16_library() if bfloat16 else _library()
    if library is None:  # panels exist only where the kernel does
        raise RuntimeError("the panel GEMM is unavailable here")
    if pool is not None:
        done = library.asyncllm_panel_argmax_pooled(
            pool.handle, pool.run, pool.input, pool.input_bytes, pool.threads, x.data_ptr(), x.stride(0),
            panels.data_ptr(), tokens.data_ptr(), rows, out_features, in_features, valid, int(bfloat16),
        )  # fmt: skip
        if done < 0:
            raise MemoryError(f"no memory for the argmax of {rows} rows")
        if done:
            return tokens
    argmax = library.asyncllm_panel_argmax_bf16 if bfloat16 else library.asyncllm_panel_argmax
    ok = argmax(x.data_ptr(), x.stride(0), panels.data_ptr(), tokens.data_ptr(), rows, out_features, in_features, valid)
    if not ok:
        raise MemoryError(f"no memory for the argmax of {rows} rows")
    return tokens


def pooled_matmul_into(
    pool: kernel_pool.KernelPool,
    x: int,
    x_stride: int,
    rows: int,
    panels: int,
    out: int,
    out_stride: int,
    out_features: int,
    in_features: int,
    *,
    bfloat16: bool,
) -> bool:
    """``panel_matmul_into`` (``bfloat16_panel_matmul_into`` with ``bfloat16``) on ``pool`` at torch's thread count:
    the caller never waits for a helper another process has descheduled (``backends.cpu._pool``). Same bits as the
    OpenMP GEMM. False, with nothing computed, when the pool cannot take the rows (more than 256, or more input than
    its buffer holds): the caller runs the OpenMP one. No checks, as ``panel_matmul_into``."""
    library = _bfloat16_library() if bfloat16 else _library()
    if library is None:  # panels exist only where the kernel does
        raise RuntimeError("the panel GEMM is unavailable here")
    done = library.asyncllm_panel_matmul_pooled(
        pool.handle, pool.run, pool.input, pool.input_bytes, pool.threads, x, x_stride, panels, out,
        out_stride, rows, out_features, in_features, int(bfloat16),
    )  # fmt: skip
    return bool(done)


def kernel_address(name: str, *, bfloat16: bool = False) -> int:
    """The address of the GEMM library's C function ``name`` (with ``bfloat16``, the library for bfloat16 panels:
    another build on AVX-512 without BF16), for C code that calls it directly (``backends.cpu._lean_forward``).
    RuntimeError where it is not built."""
    library = _bfloat16_library() if bfloat16 else _library()
    if library is None:
        raise RuntimeError(f"the panel GEMM's {name} is unavailable here")
    return native.address(getattr(library, name))


MatmulInto = Callable[[int, int, int, int, int, int, int, int], None]
"""A packed GEMM on raw addresses, ``(x, x_stride, rows, weight, out, out_stride, out_features, in_features)``:
``out[:rows, :out_features] = x[:rows, :in_features] @ weight.T`` (``panel_matmul_into``, and MKL's
``linear.packed_matmul_into``)."""


def matmul_with(
    into: MatmulInto, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` of [..., in_features], with ``weight`` packed for ``into`` (no checks).

    The tensor side of every packed layout: rows made contiguous where they are not, a fresh output,
    the bias added after the GEMM.
    """
    in_features = x.shape[-1]
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    count = rows.shape[0]
    out = torch.empty(count, out_features, dtype=torch.float32)
    if count:
        into(
            rows.data_ptr(), rows.stride(0), count, weight.data_ptr(), out.data_ptr(), out_features,
            out_features, in_features,
        )  # fmt: skip
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out_features)


def panel_matmul(
    x: torch.Tensor,
    panels: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    pool: kernel_pool.KernelPool | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with ``weight`` packed by ``PanelWeight`` into ``panels`` (no checks); bfloat16
    panels (by their dtype) multiply in bfloat16. On ``pool`` where given and it takes the rows
    (``pooled_matmul_into``), else on OpenMP's threads; the same bits either way."""
    bfloat16 = panels.dtype == torch.bfloat16
    into: MatmulInto = bfloat16_panel_matmul_into if bfloat16 else panel_matmul_into
    if pool is not None:
        into = _on_pool(pool, into, bfloat16=bfloat16)
    return matmul_with(into, x, panels, bias, out_features)


def _on_pool(pool: kernel_pool.KernelPool, fallback: MatmulInto, *, bfloat16: bool) -> MatmulInto:
    """``fallback``'s GEMM on ``pool``, or ``fallback`` itself for rows the pool does not take."""

    def into(
        x: int, x_stride: int, rows: int, panels: int, out: int, out_stride: int, out_features: int, in_features: int
    ) -> None:
        shape = (out_features, in_features)
        if not pooled_matmul_into(pool, x, x_stride, rows, panels, out, out_stride, *shape, bfloat16=bfloat16):
            fallback(x, x_stride, rows, panels, out, out_stride, *shape)

    return into


def panel_matmul_into(
    x: int, x_stride: int, rows: int, panels: int, out: int, out_stride: int, out_features: int, in_features: int
) -> None:
    """The panel GEMM on raw addresses: ``out[:rows, :out_features] = x[:rows, :in_features] @ weight.T``.

    ``panels`` is the address of a ``PanelWeight`` buffer of that weight; strides count floats. No
    checks (``panel_matmul`` is the checked entry): for callers that own every layout they pass
    (``asyncllm.backends.cpu._lean_forward``). ``rows`` must be positive.
    """
    library = _library()
    if library is None:  # panels exist only where the kernel does
        raise RuntimeError("the panel GEMM is unavailable here")
    library.asyncllm_panel_matmul(x, x_stride, panels, out, out_stride, rows, out_features, in_features)


def bfloat16_panel_matmul_into(
    x: int, x_stride: int, rows: int, panels: int, out: int, out_stride: int, out_features: int, in_features: int
) -> None:
    """``panel_matmul_into`` for bfloat16 panels (``PanelWeight(..., bfloat16=True)``): the rows are rounded to
    bfloat16 (into scratch the call allocates), the products summed in float32.

    Raises:
        MemoryError: The rounded rows' scratch could not be allocated.
    """
    library = _bfloat16_library()
    if library is None:  # bfloat16 panels exist only where the kernel does
        raise RuntimeError("the bfloat16 panel GEMM is unavailable here")
    if not library.asyncllm_panel_matmul_bf16(x, x_stride, panels, out, out_stride, rows, out_features, in_features):
        raise MemoryError(f"no memory for {rows} rows of {in_features} inputs in bfloat16")
