"""Greedy tokens without the whole float32 output projection: bounded in bfloat16, decided in float32.

A greedy row needs one thing from its [vocab] logits: which column is largest. Computing all of them in
float32 is the output projection, a large share of a decode step on small models, whose vocabularies
(32,000-49,152 columns) dwarf their hidden sizes (512-576). This head gets the same token for a fraction
of that:

1. **Bound every logit.** The hidden state and the weight (packed once) go to bfloat16, and a bfloat16
   unit multiplies them with float32 sums: Intel's AMX tiles, or else AVX512-BF16's dot-pair instruction
   (AMD Zen 4 and later), at twice float32's vector rate. Half the bytes to stream, and the arithmetic
   nearly free on AMX, halved on AVX512-BF16.
   Each approximate logit ``a_j`` is within ``b_j = |x| e_j + (|x - x'| + g_t |x'| + g_c |x|) s_j`` of the
   float32 logit ``f_j`` the panel GEMM computes, by Cauchy-Schwarz on ``x.w - x'.w' = x.(w - w') +
   (x - x').w'`` and on the two sums' rounding: ``x'`` and ``w'`` are the bfloat16 copies, ``e_j`` the
   norm of column j's rounding error and ``s_j`` the larger of its two norms (both measured at packing),
   ``g_t`` and ``g_c`` the relative error bounds of a float32 sum over the padded and the actual inputs.
   Measured rounding errors, not the worst case of 2**-8 per value, keep the bound tight, so few columns
   survive step 2.
   The factors are rounded up, which covers the float32 arithmetic of the bound itself; rounding
   ``a_j +- b_j`` to nearest cannot cross ``f_j``, itself a float32.
2. **Keep the columns that could be the maximum.** Any column whose ``a_j + b_j`` falls below
   ``L = max_j (a_j - b_j)`` is beaten in float32 by the column that reaches ``L``. Each thread keeps the
   others while it streams its share of the weight (its floor only rises, so a column dropped early stays
   dropped): typically one, at most a few hundred on a flat distribution.
3. **Decide in float32.** Each kept column's logit is recomputed from the float32 weight as the panel
   GEMM computes it (one fused multiply-add per input, in order, from zero; 16 columns at a time, one per
   vector lane): bit for bit ``f_j``. The row's token is the first of the largest, as ``argmax`` of the
   full logits gives.

So the token equals the argmax of the full float32 logits of the same model, exactly, with the output
projection on the panel GEMM (``DecoderForCausalLM.pack_weights`` keeps the head on panels alone where
this head runs, so the full logits come from the same arithmetic at every row count). A row this
cannot decide (a non-finite or huge hidden value, more than 1,024 columns within the bound on a thread)
comes back as -1, and the caller computes its full logits. Only greedy rows whose logits nothing else
reads use it: no logprobs, masks, biases or penalties (``Sampler.plain_greedy_rows``).

Needs x86 with AMX-BF16 (Sapphire Rapids and later; with Linux's permission for the tile state,
``arch_prctl``, kernel 5.16+) or AVX512-BF16 (Cooper Lake, AMD Zen 4 and later), and a C compiler; the
two compile from the same source, the product loop aside. ``available()`` checks all of that and the claim
itself once per process.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import platform
import threading
from typing import Literal

import torch

from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu import _native as native
from asyncllm.backends.cpu._native import F32, I32, I64, PTR
from asyncllm.worker._memory import mapped_tensor

logger = logging.getLogger("asyncllm")

__all__ = ["GreedyHead", "ProductUnit", "available", "product_unit", "product_units", "rounding_gamma"]

_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TILE_K 32          /* inputs per tile: 16 rows of bfloat16 pairs */
#define TILE_N 16          /* output columns per tile */
#define TILE_M 16          /* hidden rows per tile */
#define GROUP 4            /* row tiles per pass over the weight: 64 rows */
#define SLOTS 1024         /* kept columns per row and thread */
#define LIMIT 0x1p50f      /* larger inputs or weights: no decision (keeps the bound's slack tiny) */
#define UP (1.0 + 0x1p-20) /* norms computed in double, rounded up by this */

int asyncllm_head_permit(void) {
#ifdef HEAD_AMX
    /* Linux hands out AMX's 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return 1;  /* AVX512-BF16 needs no permission */
#endif
}

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

#ifdef HEAD_AMX
static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) { config.rows[t] = 16; config.colsb[t] = 64; }
    _tile_loadconfig(&config);
}
#else
/* The same products with AVX512-BF16's dot-pair instruction: a tile row (16 columns' inputs 2p and 2p+1) is one
   vector, multiplied by a row's input pair broadcast; float32 sums like the tile unit's. 8 rows x 2 column
   blocks: 16 accumulators, per input pair 2 weight loads and 8 broadcasts. */
static void dot_pair_products(const uint16_t *xb, int64_t padded, int64_t count, const uint16_t *panel,
                              int64_t slices, int both, float approx[2][GROUP * TILE_M][TILE_N]) {
    const int64_t pairs = slices * TILE_K / 2, second = slices * TILE_K * TILE_N;
    for (int64_t r0 = 0; r0 < count; r0 += 8) {  /* rows past count are xb's zero padding */
        __m512 sum[2][8];
        for (int i = 0; i < 8; ++i) { sum[0][i] = _mm512_setzero_ps(); sum[1][i] = _mm512_setzero_ps(); }
        for (int64_t p = 0; p < pairs; ++p) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + p * 2 * TILE_N);
            const __m512bh w1 = both ? (__m512bh)_mm512_loadu_si512(panel + second + p * 2 * TILE_N) : w0;
            for (int i = 0; i < 8; ++i) {
                int32_t pair;
                memcpy(&pair, xb + (r0 + i) * padded + 2 * p, 4);
                const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                sum[0][i] = _mm512_dpbf16_ps(sum[0][i], x, w0);
                sum[1][i] = _mm512_dpbf16_ps(sum[1][i], x, w1);
            }
        }
        for (int i = 0; i < 8; ++i) {
            _mm512_store_ps(approx[0][r0 + i], sum[0][i]);
            _mm512_store_ps(approx[1][r0 + i], sum[1][i]);
        }
    }
}
#endif

static inline uint16_t to_bf16(float value) {  /* round to nearest even (finite inputs) */
    uint32_t bits;
    memcpy(&bits, &value, 4);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static inline float from_bf16(uint16_t value) {
    const uint32_t bits = (uint32_t)value << 16;
    float result;
    memcpy(&result, &bits, 4);
    return result;
}

/* The weight [vocab, hidden] as AMX tiles: per 16-column block and 32-input slice one 1 KB tile, row r
   holding inputs 2r and 2r+1 of each of the 16 columns; zeros past vocab and hidden. Per column, rounded
   up: `size`, the larger Euclidean norm of the column and of its bfloat16 copy, and `error`, the norm of
   their difference. Returns 0 if a weight is not finite or not below LIMIT. */
int asyncllm_head_pack(const float *weight, int64_t vocab, int64_t hidden, uint16_t *tiles, float *size,
                       float *error) {
    const int64_t blocks = (vocab + TILE_N - 1) / TILE_N, slices = (hidden + TILE_K - 1) / TILE_K;
    int ok = 1;
#pragma omp parallel for schedule(static) reduction(&& : ok)
    for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t n = 0; n < TILE_N; ++n) {
            const int64_t column = b * TILE_N + n;
            double squares = 0.0, rounded_squares = 0.0, error_squares = 0.0;
            for (int64_t k = 0; k < slices * TILE_K; ++k) {
                const float w = column < vocab && k < hidden ? weight[column * hidden + k] : 0.0f;
                const int usable = fabsf(w) < LIMIT;
                if (!usable) ok = 0;
                const uint16_t rounded = to_bf16(usable ? w : 0.0f);
                const double exact = usable ? w : 0.0, near = from_bf16(rounded);
                squares += exact * exact;
                rounded_squares += near * near;
                error_squares += (exact - near) * (exact - near);
                const int64_t slice = k / TILE_K, pair = (k % TILE_K) / 2;
                tiles[((b * slices + slice) * TILE_K / 2 + pair) * 2 * TILE_N + 2 * n + k % 2] = rounded;
            }
            size[column] = (float)(sqrt(squares > rounded_squares ? squares : rounded_squares) * UP);
            error[column] = (float)(sqrt(error_squares) * UP);
        }
    }
    return ok;
}

/* One thread's kept columns for up to GROUP * TILE_M rows. */
typedef struct {
    float floor[GROUP * TILE_M];            /* the largest lower bound seen: L so far */
    int32_t count[GROUP * TILE_M];          /* -1: more columns than SLOTS within the bound */
    int32_t column[GROUP * TILE_M][SLOTS];
    float upper[GROUP * TILE_M][SLOTS];
} kept_columns;

int64_t asyncllm_head_scratch_bytes(void) { return sizeof(kept_columns); }

/* Fold one block's 16 approximate logits of row r into the row's kept columns:
   bound = error_scale * error_j + size_scale * size_j + slack. */
static void keep(kept_columns *kept, int r, const float *approx, const float *size, const float *error,
                 int64_t first, int64_t vocab, float error_scale, float size_scale, float slack, float *approx_out,
                 float *bound_out) {
    const __mmask16 valid = vocab - first >= TILE_N ? (__mmask16)0xFFFF : (__mmask16)((1u << (vocab - first)) - 1);
    const __m512 a = _mm512_loadu_ps(approx);
    const __m512 bound = _mm512_fmadd_ps(_mm512_set1_ps(error_scale), _mm512_maskz_loadu_ps(valid, error + first),
        _mm512_fmadd_ps(_mm512_set1_ps(size_scale), _mm512_maskz_loadu_ps(valid, size + first), _mm512_set1_ps(slack)));
    if (approx_out) {  /* asyncllm_head_argmax's record: for checking the bound */
        _mm512_mask_storeu_ps(approx_out + first, valid, a);
        _mm512_mask_storeu_ps(bound_out + first, valid, bound);
    }
    if (kept->count[r] < 0) return;
    /* Rounding a +- bound to nearest cannot cross f_j, itself a float32: the true maximum's high stays >= it. */
    const __m512 high = _mm512_add_ps(a, bound);
    /* Most blocks end here: no column reaches the floor (then no lower bound can raise it either). */
    __mmask16 within = _mm512_mask_cmp_ps_mask(valid, high, _mm512_set1_ps(kept->floor[r]), _CMP_GE_OQ);
    if (!within) return;
    const float best = _mm512_mask_reduce_max_ps(valid, _mm512_sub_ps(a, bound));
    if (best > kept->floor[r]) {
        kept->floor[r] = best;
        within = _mm512_mask_cmp_ps_mask(valid, high, _mm512_set1_ps(best), _CMP_GE_OQ);
    }
    int32_t count = kept->count[r];
    if (count + TILE_N > SLOTS) {  /* drop what the floor has risen past since it was kept */
        int32_t kept_count = 0;
        for (int32_t i = 0; i < count; ++i)
            if (kept->upper[r][i] >= kept->floor[r]) {
                kept->column[r][kept_count] = kept->column[r][i];
                kept->upper[r][kept_count++] = kept->upper[r][i];
            }
        count = kept_count;
        if (count + TILE_N > SLOTS) { kept->count[r] = -1; return; }
    }
    const __m512i columns = _mm512_add_epi32(_mm512_set1_epi32((int32_t)first),
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    _mm512_mask_compressstoreu_epi32(&kept->column[r][count], within, columns);
    _mm512_mask_compressstoreu_ps(&kept->upper[r][count], within, high);
    kept->count[r] = count + __builtin_popcount(within);
}

/* The float32 logits of `n` columns as the panel GEMM computes them: per column, fused multiply-adds over
   the inputs in order from zero. 16 columns at a time, one per vector lane, gathered from the row-major
   weight (each lane's row is 1-2 KB read front to back, so every line fetched serves 16 inputs). */
static void exact_logits(const float *x, const float *weight, int64_t hidden, const int32_t *columns, int n,
                         float *logits) {
    for (int i = 0; i < n; i += TILE_N) {
        const __mmask16 lanes = n - i >= TILE_N ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        int32_t start[TILE_N] = {0};
        for (int l = 0; l < TILE_N && i + l < n; ++l) start[l] = (int32_t)(columns[i + l] * hidden);
        __m512i at = _mm512_loadu_si512(start);
        const __m512i one = _mm512_set1_epi32(1);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t k = 0; k < hidden; ++k) {
            const __m512 w = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes, at, weight, 4);
            sum = _mm512_fmadd_ps(_mm512_set1_ps(x[k]), w, sum);
            at = _mm512_add_epi32(at, one);
        }
        _mm512_mask_storeu_ps(logits + i, lanes, sum);
    }
}

/* tokens[r] = argmax of row r's float32 logits, or -1 where this cannot decide. x is [rows, hidden] with
   x_stride floats between rows; weight is the float32 [vocab, hidden]; scratch holds `slots` kept_columns
   (asyncllm_head_scratch_bytes each), and at most that many threads run. gamma_tiles and gamma_chain
   bound the relative rounding of the tile unit's sums and of the panel GEMM's chain. With record_approx and
   record_bound ([rows, vocab] each; else NULL) it also writes every approximate logit and its bound. Returns
   0 when memory ran out (nothing decided). */
int asyncllm_head_argmax(const float *x, int64_t x_stride, int64_t rows, const uint16_t *tiles, const float *size,
                         const float *error, const float *weight, int64_t vocab, int64_t hidden, float gamma_tiles,
                         float gamma_chain, float slack, void *scratch, int64_t slots, int64_t *tokens,
                         float *record_approx, float *record_bound) {
    const int64_t slices = (hidden + TILE_K - 1) / TILE_K, padded = slices * TILE_K;
    const int64_t blocks = (vocab + TILE_N - 1) / TILE_N, group_rows = GROUP * TILE_M;
    const int threads = omp_get_max_threads() < slots ? omp_get_max_threads() : (int)slots;
    kept_columns *kept = scratch;
    uint16_t *xb = aligned_alloc(64, (size_t)group_rows * padded * 2);
    float *error_scale = malloc(sizeof(float) * group_rows), *size_scale = malloc(sizeof(float) * group_rows);
    int32_t *candidates = malloc(sizeof(int32_t) * SLOTS * threads);
    float *logits = malloc(sizeof(float) * SLOTS * threads);
    if (!xb || !error_scale || !size_scale || !candidates || !logits) {
        free(xb); free(error_scale); free(size_scale); free(candidates); free(logits);
        return 0;
    }
    for (int64_t first = 0; first < rows; first += group_rows) {
        const int64_t count = rows - first < group_rows ? rows - first : group_rows;
        const int64_t row_tiles = (count + TILE_M - 1) / TILE_M;
        memset(xb, 0, (size_t)row_tiles * TILE_M * padded * 2);
        for (int64_t r = 0; r < count; ++r) {  /* bfloat16 copy, norms, and whether the row can be decided */
            const float *row = x + (first + r) * x_stride;
            double squares = 0.0, rounded_squares = 0.0, error_squares = 0.0;
            int ok = 1;
            for (int64_t k = 0; k < hidden; ++k) {
                if (!(fabsf(row[k]) < LIMIT)) ok = 0;
                const uint16_t rounded = ok ? to_bf16(row[k]) : 0;
                const double exact = row[k], near = from_bf16(rounded);
                squares += exact * exact;
                rounded_squares += near * near;
                error_squares += (exact - near) * (exact - near);
                xb[r * padded + k] = rounded;
            }
            /* |approx - exact| <= |x| e_j + (|x - xb| + g_t |xb| + g_c |x|) s_j (module docstring). */
            error_scale[r] = ok ? (float)(sqrt(squares) * UP) : -1.0f;
            size_scale[r] = (float)((sqrt(error_squares) + gamma_tiles * sqrt(rounded_squares)
                                     + gamma_chain * sqrt(squares)) * UP);
        }
        for (int t = 0; t < threads; ++t)  /* every slot, in case the team is smaller */
            for (int64_t r = 0; r < count; ++r) {
                kept[t].floor[r] = -INFINITY;
                kept[t].count[r] = error_scale[r] < 0 ? -1 : 0;
            }
#pragma omp parallel num_threads(threads)
        {
            kept_columns *mine = &kept[omp_get_thread_num()];
            float approx[2][GROUP * TILE_M][TILE_N] __attribute__((aligned(64)));
#ifdef HEAD_AMX
            configure_tiles();
#endif
            /* Two column blocks by two row tiles at a time: four sums (tiles 0-3), two input tiles (4, 5) and two
               weight tiles (6, 7), none loaded again while a product still reads it. */
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < (blocks + 1) / 2; ++pair) {
                const int64_t b = 2 * pair;
                const int both = b + 1 < blocks;
                const uint16_t *panel = tiles + b * slices * TILE_K * TILE_N;
#ifdef HEAD_AMX
                for (int64_t t = 0; t < row_tiles; t += 2) {
                    const int two = t + 1 < row_tiles;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    for (int64_t s = 0; s < slices; ++s) {
                        const uint16_t *a = xb + t * TILE_M * padded + s * TILE_K;
                        _tile_loadd(6, panel + s * TILE_K * TILE_N, 64);
                        _tile_loadd(4, a, padded * 2);
                        _tile_dpbf16ps(0, 4, 6);
                        if (two) { _tile_loadd(5, a + TILE_M * padded, padded * 2); _tile_dpbf16ps(2, 5, 6); }
                        if (both) {
                            _tile_loadd(7, panel + (slices + s) * TILE_K * TILE_N, 64);
                            _tile_dpbf16ps(1, 4, 7);
                            if (two) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, approx[0][t * TILE_M], 64);
                    if (two) _tile_stored(2, approx[0][(t + 1) * TILE_M], 64);
                    if (both) {
                        _tile_stored(1, approx[1][t * TILE_M], 64);
                        if (two) _tile_stored(3, approx[1][(t + 1) * TILE_M], 64);
                    }
                }
#else
                dot_pair_products(xb, padded, count, panel, slices, both, approx);
#endif
                for (int64_t r = 0; r < count; ++r) {
                    float *approx_out = record_approx ? record_approx + (first + r) * vocab : NULL;
                    float *bound_out = record_bound ? record_bound + (first + r) * vocab : NULL;
                    keep(mine, (int)r, approx[0][r], size, error, b * TILE_N, vocab, error_scale[r], size_scale[r],
                         slack, approx_out, bound_out);
                    if (both)
                        keep(mine, (int)r, approx[1][r], size, error, (b + 1) * TILE_N, vocab, error_scale[r],
                             size_scale[r], slack, approx_out, bound_out);
                }
            }
#ifdef HEAD_AMX
            _tile_release();
#endif
        }
        for (int64_t r = 0; r < count; ++r) {  /* merge the threads' columns (in column order) and decide */
            float floor = -INFINITY;
            int decided = 1, n = 0;
            for (int t = 0; t < threads; ++t) {
                if (kept[t].count[r] < 0) decided = 0;
                if (kept[t].floor[r] > floor) floor = kept[t].floor[r];
            }
            for (int t = 0; t < threads && decided; ++t)
                for (int32_t i = 0; i < kept[t].count[r]; ++i)
                    if (kept[t].upper[r][i] >= floor) candidates[n++] = kept[t].column[r][i];
            exact_logits(x + (first + r) * x_stride, weight, hidden, candidates, n, logits);
            int64_t token = -1;
            for (int i = 0; i < n; ++i)  /* the first largest, whatever order the threads left them in */
                if (token < 0 || logits[i] > logits[token]
                    || (logits[i] == logits[token] && candidates[i] < candidates[token]))
                    token = i;
            tokens[first + r] = decided && token >= 0 ? candidates[token] : -1;
        }
    }
    free(xb); free(error_scale); free(size_scale); free(candidates); free(logits);
    return 1;
}
"""


ProductUnit = Literal["amx", "avx512_bf16"]
"""What multiplies the bfloat16 pass: AMX-BF16's tile unit, or AVX512-BF16's dot-pair vector instruction."""

_UNIT_FLAGS: dict[ProductUnit, tuple[str, ...]] = {
    "amx": ("-DHEAD_AMX", "-mamx-tile", "-mamx-bf16"),
    "avx512_bf16": ("-mavx512bf16",),
}
_UNIT_CPU_FLAGS: dict[ProductUnit, set[str]] = {
    "amx": {"amx_tile", "amx_bf16", "avx512f"},
    "avx512_bf16": {"avx512_bf16", "avx512f", "avx512bw"},
}


def product_units() -> tuple[ProductUnit, ...]:
    """The units this CPU has, the faster first: AMX's tiles (Sapphire Rapids and later), then AVX512-BF16
    (those, Cooper Lake, AMD Zen 4 and later); empty off x86."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ()
    flags = native.cpu_flags()
    return tuple(unit for unit in ("amx", "avx512_bf16") if _UNIT_CPU_FLAGS[unit] <= flags)


def product_unit() -> ProductUnit | None:
    """The unit a head uses by default: the first of ``product_units()``, or None (no greedy head)."""
    units = product_units()
    return units[0] if units else None


_SIGNATURES: native.Signatures = {
    "asyncllm_head_permit": ([], I32),
    "asyncllm_head_pack": ([PTR, I64, I64, PTR, PTR, PTR], I32),
    "asyncllm_head_scratch_bytes": ([], I64),
    "asyncllm_head_argmax": (
        [PTR, I64, I64, PTR, PTR, PTR, PTR, I64, I64, F32, F32, F32, PTR, I64, PTR, PTR, PTR],
        I32,
    ),
}


@functools.cache
def _library(unit: ProductUnit | None) -> ctypes.CDLL | None:
    if unit is None or unit not in product_units() or not gemm_cpu.available():
        return None
    library = native.load("greedy_head", _SOURCE, _SIGNATURES, _UNIT_FLAGS[unit])
    if library is None or not library.asyncllm_head_permit():
        return None
    return library


def rounding_gamma(terms: int, unit: float = 2.0**-24) -> float:
    """``n u / (1 - n u)`` for ``n = terms`` and the rounding unit ``u`` (float32 to nearest: 2**-24), with 1%
    to spare: the relative error bound of a float32 sum of ``terms`` products in any order (against the sum of
    their magnitudes)."""
    return terms * unit / (1 - terms * unit) * 1.01


# Both units read subnormal bfloat16 inputs as zero (a product moves by under 2**-126 * 2**50 = 2**-76)
# and flushes subnormal sums (2**-126 each): with at most 2**16 inputs, far below this.
_SLACK = 2.0**-40


class GreedyHead:
    """The greedy token of each row of hidden states, equal to the argmax of the full float32 logits.

    Built from the output projection's float32 weight ([vocab, hidden], row-major), which it keeps a
    reference to and reads for the exact logits: the model's output embedding, never released beside a
    head (tied models share it with the input embedding anyway). Holds a bfloat16 copy of the weight in
    AMX's tile layout (half the float32 weight's memory; AVX512-BF16 reads the same layout) and two norms
    per column. ``unit`` picks the product unit (None: ``product_unit()``).
    """

    def __init__(self, weight: torch.Tensor, unit: ProductUnit | None = None) -> None:
        self.unit = unit or product_unit()
        library = _library(self.unit)
        if library is None:
            raise RuntimeError(
                "the greedy head needs AMX-BF16 (with Linux's permission for it) or AVX512-BF16, and a C compiler"
            )
        source = gemm_cpu.packing_source(weight)
        self.vocab, self.hidden = (int(size) for size in source.shape)
        if self.vocab * self.hidden >= 2**31:
            raise ValueError("the greedy head gathers weights with 32-bit offsets: the weight is too large")
        self._weight = source
        blocks, slices = -(-self.vocab // 16), -(-self.hidden // 32)
        self._tiles = mapped_tensor(blocks * 16 * slices * 32, torch.int16)
        self._sizes = torch.empty(blocks * 16, dtype=torch.float32)
        self._errors = torch.empty(blocks * 16, dtype=torch.float32)
        if not library.asyncllm_head_pack(
            source.data_ptr(), self.vocab, self.hidden, self._tiles.data_ptr(), self._sizes.data_ptr(),
            self._errors.data_ptr(),
        ):  # fmt: skip
            raise ValueError("the greedy head needs finite weights below 2**50")
        # The tile unit's sums: 2**-23, any faithful rounding, not only the documented round-to-nearest.
        self._gamma_tiles = rounding_gamma(slices * 32, unit=2.0**-23)
        self._gamma_chain = rounding_gamma(self.hidden)
        # One thread's kept columns per thread slot (about 0.5 MB each); the kernel runs on at most this many.
        self._slots = max(1, torch.get_num_threads())
        self._scratch = torch.empty(self._slots * library.asyncllm_head_scratch_bytes(), dtype=torch.uint8)
        self._lock = threading.Lock()

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows] int64 tokens for [rows, hidden] float32 states; -1 in a row this cannot decide.

        A decided row's token is the first largest column of ``hidden @ weight.T`` as the panel GEMM
        computes it (``gemm_cpu.panel_matmul`` on panels of the same weight). Where the kernel cannot get
        its scratch memory every row comes back -1 (the caller's logits path decides them).
        """
        tokens, _ = self._run(hidden, record=False)
        return tokens

    def bounds(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The approximate logits and the bound on their distance from the float32 logits ([rows, vocab] each).

        What ``argmax`` decides from, for checking the bound: ``|approx - logits| <= bound`` must hold for
        every column of every row that ``argmax`` does not leave undecided.
        """
        _, recorded = self._run(hidden, record=True)
        assert recorded is not None
        return recorded

    def _run(self, hidden: torch.Tensor, record: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        gemm_cpu.check_input(hidden, self.hidden)
        if hidden.dim() != 2:
            raise ValueError(f"expected [rows, {self.hidden}] hidden states, got {tuple(hidden.shape)}")
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        rows = hidden.shape[0]
        tokens = torch.full((rows,), -1, dtype=torch.int64)
        recorded = (torch.empty(rows, self.vocab), torch.empty(rows, self.vocab)) if record else None
        library = _library(self.unit)
        assert library is not None  # built in __init__
        if not rows:
            return tokens, recorded
        with self._lock:  # one scratch per head
            done = library.asyncllm_head_argmax(
                hidden.data_ptr(), hidden.stride(0), rows, self._tiles.data_ptr(), self._sizes.data_ptr(),
                self._errors.data_ptr(), self._weight.data_ptr(), self.vocab, self.hidden, self._gamma_tiles,
                self._gamma_chain, _SLACK, self._scratch.data_ptr(), self._slots, tokens.data_ptr(),
                recorded[0].data_ptr() if recorded else None, recorded[1].data_ptr() if recorded else None,
            )  # fmt: skip
        if not done:
            logger.warning("the greedy head could not allocate its scratch memory: these rows take the logits path")
            tokens.fill_(-1)
        return tokens, recorded


@functools.cache
def available(unit: ProductUnit | None = None) -> bool:
    """Whether the head runs here on ``unit`` (None: ``product_unit()``; with the panel GEMM and a C compiler,
    and for AMX Linux's permission), agrees with the argmax of the panel GEMM's logits, near-ties included,
    and its bound holds. Checked once per process and unit."""
    unit = unit or product_unit()
    if _library(unit) is None:
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 70, generator=generator)  # a partial last tile, a partial input slice
    weight[7] = weight[500]  # an exact tie: the first must win
    weight[600] = weight[3] * (1 + 2.0**-20)  # near-ties the bfloat16 pass cannot tell apart
    panels = gemm_cpu.PanelWeight(weight)
    head = GreedyHead(weight, unit)
    x = torch.randn(70, 70, generator=generator)
    logits = panels.linear(x)
    approx, bound = head.bounds(x)
    return bool(torch.equal(head.argmax(x), logits.argmax(dim=-1)) and ((approx - logits).abs() <= bound).all())
