"""Attention against the paged KV cache on the CPU: the ``cpu`` backend (float32).

The ``torch`` reference backend (``asyncllm.backends.torch._attention``) gathers, for every layer, the keys
and values of every decode sequence into one batch padded to the longest context, then runs SDPA
on it: a copy of every context per layer into freshly allocated memory, which dominates a decode
step. This backend reads the cache in place:

- Decode tokens (one query per sequence) go to a small C kernel, compiled once per head size with
  the system C compiler at start-up (about half a second; cached under ``cache_root()/kernels``)
  and called through ``ctypes`` (which releases the GIL). For each sequence it walks the block
  table once, a block at a time, with an online softmax: the scores of every query head of a KV
  head against the block's key rows where they lie, their exponentials (vectorized) against the
  running maximum, and the weighted value rows, while the block is in the L1 cache. The cache is
  read once, nothing is gathered or padded. Work is split over sequences (over sequences x KV heads when the batch is
  small) with OpenMP; the library links to the ``libgomp`` torch already loaded, so it shares
  torch's thread pool and thread count. The lean forward's decode-sized steps run the same tasks on the
  kernel pool instead (``backends.cpu._pool``: ``attend_into(..., pool=)``), same bits.
- Prompt chunks that start at position 0 attend only to their own new keys and values, taken
  straight from the projection: a second C kernel (flash-attention tiling: tiles of as many
  queries as a vector has lanes walk the key tiles up to their diagonal with an online softmax
  run across the tile's queries at once). A chunk with cached history (chunked prefill, a prefix-cache
  hit) goes to the same kernel, which reads its keys and values from the cache through its slots; one that
  a sliding window cuts, or a soft-capped model's, gathers its slots once (from the window of its first
  query on) and runs SDPA, as the reference does. The decode kernel too reads
  only a sliding window's positions, so blocks that left it are never touched.

Same cache layout ([slots, kv_heads, head_dim]), and ``write_kv`` from the reference backend.
``native_decode_available(head_dim)`` says whether the kernel could be built (a C compiler is
needed); the runner picks this backend only then and only for float32.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from asyncllm.backends.cpu import _native as native
from asyncllm.backends.cpu import _pool as kernel_pool
from asyncllm.backends.cpu._native import F32, I32, I64, PTR
from asyncllm.backends.torch._attention import PrefillSpan, split_step
from asyncllm.backends.torch._attention import sdpa as reference_sdpa
from asyncllm.worker._input_batch import StepInputs

__all__ = [
    "KV_DTYPES",
    "CpuAttentionMetadata",
    "CpuPrefillChunk",
    "attend_into",
    "bfloat16_kv_available",
    "build_metadata",
    "kernel_address",
    "kernel_plan",
    "layer_prefills",
    "native_decode_available",
    "paged_attention",
]

# One query token per sequence against its paged context. HEAD_DIM is fixed at compile time so the
# compiler unrolls and vectorizes the per-row dot products and updates.
_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
""" + kernel_pool.HEADER + r"""
/* Vectors as wide as divides the head size, up to the machine's registers: on x86, 16 floats with AVX-512 only,
   else 8 (AVX2's 16 registers cannot hold the prefill's register block of 16-float vectors: it spilled to the
   stack). Other CPUs keep 16. */
#if HEAD_DIM % 16 == 0 && (defined(__AVX512F__) || !defined(__x86_64__))
#define W 16
#elif HEAD_DIM % 8 == 0
#define W 8
#else
#define W 4
#endif
""" + native.VECTOR_HELPERS + r"""

/* Per lane: mask set (all ones) takes yes, else no. */
static inline vec vselect(ivec mask, vec yes, vec no) {
    ivec a, b;
    memcpy(&a, &yes, sizeof a);
    memcpy(&b, &no, sizeof b);
    a = (a & mask) | (b & ~mask);
    vec r;
    memcpy(&r, &a, sizeof r);
    return r;
}

static inline vec vmax(vec a, vec b) { return vselect(a > b, a, b); }

/* The cache's element: float32, or with KV_BF16 bfloat16 (the upper half of a float32's bits). */
#if KV_BF16
typedef uint16_t kv_t;
typedef uint16_t kv_vec __attribute__((vector_size(W * 2)));
typedef uint32_t wide_vec __attribute__((vector_size(W * 4)));
static inline vec load_kv(const kv_t *p) {
    kv_vec h;
    memcpy(&h, p, sizeof h);
    const wide_vec bits = __builtin_convertvector(h, wide_vec) << 16;
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}
static inline float kv_float(kv_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#else
typedef float kv_t;
static inline vec load_kv(const kv_t *p) { return load(p); }
static inline float kv_float(kv_t x) { return x; }
#endif

/* exp(x) for x <= 0 (scores minus their running maximum), W lanes at once: 2^n * e^f with n = round(x / ln 2)
   (the 1.5 * 2^23 shift rounds, and leaves n in the low bits) and |f| <= ln 2 / 2; e^f by its degree-6
   Taylor polynomial (relative error under 2e-7, as libm's expf). x under -87 is clamped there: e^-87 is
   1.6e-38, nothing beside the maximum's 1. */
static inline vec vexp(vec x) {
    /* Lanes whose result is discarded (masked keys, stale scratch) may hold anything: clamp to [-87, 0],
       with vector compares: a lane-by-lane loop compiles to scalar code, which would cost more than the
       rest of the exponential. */
    x = vselect(x < splat(-87.0f), splat(-87.0f), x);
    x = vselect(x > splat(0.0f), splat(0.0f), x);
    const vec shift = splat(12582912.0f);
    const vec t = x * splat(1.44269504f) + shift;
    const vec n = t - shift;
    const vec f = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vec p = splat(1.0f / 720.0f);
    p = p * f + splat(1.0f / 120.0f);
    p = p * f + splat(1.0f / 24.0f);
    p = p * f + splat(1.0f / 6.0f);
    p = p * f + splat(0.5f);
    p = p * f + splat(1.0f);
    p = p * f + splat(1.0f);
    ivec bits;
    memcpy(&bits, &t, sizeof bits);
    bits = (bits - 0x4B400000 + 127) << 23;
    vec power;
    memcpy(&power, &bits, sizeof power);
    return p * power;
}

/* A sequence's blocks are scattered over the cache and the hardware prefetchers stop at page boundaries,
   so the next block's rows are prefetched while this block is computed, into L2 (hint 2), spread out: per
   row computed, that row of the next block, one KV head's keys and values beside that head's scores: fetches
   in bursts (a whole block, or a whole row, at once) fill the line-fill buffers and stall the loads of the
   block being computed. */
static inline void prefetch_row(const kv_t *row, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)row + b, 0, 2);
}

/* Query heads whose value accumulators fit in registers beside a value row: 6 at head size 64 (W 16), 2 at 128. */
#define VALUE_VECTORS (HEAD_DIM / W)
#define VALUE_HEADS ((28 - VALUE_VECTORS) / VALUE_VECTORS >= 6 ? 6 : (28 - VALUE_VECTORS) / VALUE_VECTORS >= 2 ? 2 : 1)

/* acc[h] += weights[h][p] * value row p for `heads` query heads h and rows p in [p0, p1): per head and lane the
   same sums, in the same order, as one head at a time (`heads` is a constant at each call: registers). */
static inline __attribute__((always_inline)) void weigh_values(const kv_t *restrict value, int64_t row_size,
        const float *restrict weights, int64_t padded, float *restrict acc, int64_t p0, int64_t p1, const int heads) {
    vec a[VALUE_HEADS][VALUE_VECTORS];
    for (int h = 0; h < heads; ++h)
        for (int d = 0; d < VALUE_VECTORS; ++d) a[h][d] = load(acc + h * HEAD_DIM + d * W);
    for (int64_t p = p0; p < p1; ++p) {
        vec v[VALUE_VECTORS];
        for (int d = 0; d < VALUE_VECTORS; ++d) v[d] = load_kv(value + p * row_size + d * W);
        for (int h = 0; h < heads; ++h) {
            const vec e = splat(weights[h * padded + p]);
            for (int d = 0; d < VALUE_VECTORS; ++d) a[h][d] = a[h][d] + e * v[d];
        }
    }
    for (int h = 0; h < heads; ++h)
        for (int d = 0; d < VALUE_VECTORS; ++d) store(acc + h * HEAD_DIM + d * W, a[h][d]);
}

/* The arguments of a decode call, and what every task shares. */
typedef struct {
    const float *q;
    const kv_t *k_cache, *v_cache;
    const int64_t *rows, *tables, *lens;
    int64_t q_stride, q_rows, n, q_heads, kv_heads, block_size, max_blocks, window, cache_blocks;
    int64_t group, row_size, splits, heads_per_task, width, task_bytes, padded;
    float scale, softcap;
} decode_args;

static decode_args decode_arguments(const float *q, int64_t q_stride, int64_t q_rows, const kv_t *k_cache,
        const kv_t *v_cache, const int64_t *rows, const int64_t *tables, const int64_t *lens, int64_t n,
        int64_t q_heads, int64_t kv_heads, int64_t block_size, int64_t max_blocks, int64_t window,
        int64_t cache_blocks, float scale, float softcap, int64_t threads) {
    /* Few sequences: one task per (sequence, KV head) so every thread has work; else whole sequences,
       whose key and value rows are then read front to back. */
    const int64_t splits = n >= 2 * threads ? 1 : kv_heads;
    const int64_t heads_per_task = kv_heads / splits;
    const decode_args a = {q, k_cache, v_cache, rows, tables, lens, q_stride, q_rows, n, q_heads, kv_heads, block_size,
        max_blocks, window, cache_blocks, q_heads / kv_heads, kv_heads * HEAD_DIM, splits, heads_per_task,
        heads_per_task * (q_heads / kv_heads), (int64_t)sizeof(kv_t) * heads_per_task * HEAD_DIM,
        (block_size + W - 1) / W * W, scale, softcap};
    return a;
}

/* One task: a sequence's (or, split, one KV head's) query heads against its context, into `oi` (width heads of
   HEAD_DIM, contiguous), with the thread's scratch. Returns early, `oi` untouched, on a length, row or block out
   of range: only a late pool helper reading a buffer a later job rewrites sees one (its result is dropped). */
static void decode_task(const decode_args *a, int64_t task, float *queries, float *acc, float *top, float *total,
                        float *scores, float *oi) {
    const float *q = a->q;
    const kv_t *k_cache = a->k_cache, *v_cache = a->v_cache;
    const int64_t *rows = a->rows, *tables = a->tables, *lens = a->lens;
    const int64_t q_stride = a->q_stride, block_size = a->block_size, max_blocks = a->max_blocks;
    const int64_t window = a->window, group = a->group, row_size = a->row_size, splits = a->splits;
    const int64_t heads_per_task = a->heads_per_task, width = a->width, task_bytes = a->task_bytes;
    const int64_t padded = a->padded;
    const float scale = a->scale, softcap = a->softcap;
    const int64_t i = task / splits;
    const int64_t h0 = (task % splits) * heads_per_task;
    const int64_t len = lens[i];
    if (len < 1 || len > max_blocks * block_size || rows[i] < 0 || rows[i] >= a->q_rows) return;
    const int64_t start = (window > 0 && len > window) ? len - window : 0;
    const int64_t *table = tables + i * max_blocks;
    const float *qi = q + rows[i] * q_stride + h0 * group * HEAD_DIM;
    for (int64_t j = 0; j < width * HEAD_DIM; ++j) {
        queries[j] = qi[j] * scale;
        acc[j] = 0.0f;
    }
    for (int64_t h = 0; h < width; ++h) {
        top[h] = -INFINITY;
        total[h] = 0.0f;
    }
    const int64_t first = start / block_size, last = (len - 1) / block_size;
    for (int64_t b = first; b <= last; ++b) {
        if (table[b] < 0 || table[b] >= a->cache_blocks) return;  /* a late pool helper's garbage */
        const int64_t p0 = b == first ? start - b * block_size : 0;
        const int64_t p1 = b == last ? len - b * block_size : block_size;
        const kv_t *keys = k_cache + (table[b] * block_size * row_size + h0 * HEAD_DIM);
        const kv_t *values = v_cache + (table[b] * block_size * row_size + h0 * HEAD_DIM);
        /* Keys row by row, front to back through the block (the order the memory system
           streams best), every head's score against each row. */
        const int64_t next = b < last ? table[b + 1] * block_size * row_size + h0 * HEAD_DIM : -1;
        const kv_t *next_keys = next >= 0 ? k_cache + next : 0;
        const kv_t *next_values = next >= 0 ? v_cache + next : 0;
        /* The next block's rows that hold context: the last block's end is the sequence's. */
        const int64_t next_rows = b + 1 == last ? len - last * block_size : block_size;
        for (int64_t p = p0; p < p1; ++p) {
            const kv_t *key = keys + p * row_size;
            const int ahead = next_keys && p < next_rows;
            for (int64_t g = 0; g < heads_per_task; ++g) {
                /* The next block's row p, a KV head's slice at a time: its keys now, its values after the
                   first query head's score. */
                const int64_t slice = p * row_size + g * HEAD_DIM, slice_bytes = HEAD_DIM * sizeof(kv_t);
                if (ahead) prefetch_row(next_keys + slice, slice_bytes);
                vec k[HEAD_DIM / W];
                for (int d = 0; d < HEAD_DIM / W; ++d) k[d] = load_kv(key + g * HEAD_DIM + d * W);
                for (int64_t h = g * group; h < (g + 1) * group; ++h) {
                    vec s = load(queries + h * HEAD_DIM) * k[0];
                    for (int d = 1; d < HEAD_DIM / W; ++d) s += load(queries + h * HEAD_DIM + d * W) * k[d];
                    const float score = hsum(s);
                    scores[h * padded + p] = softcap > 0.0f ? softcap * tanhf(score / softcap) : score;
                    if (ahead && h == g * group) prefetch_row(next_values + slice, slice_bytes);
                }
            }
        }
        if (next_keys)
            for (int64_t p = 0; p < next_rows; ++p)
                if (p < p0 || p >= p1) {
                    prefetch_row(next_keys + p * row_size, task_bytes);
                    prefetch_row(next_values + p * row_size, task_bytes);
                }
        for (int64_t h = 0; h < width; ++h) {
            float *sh = scores + h * padded;
            float block_top = -INFINITY;
            for (int64_t p = p0; p < p1; ++p) block_top = sh[p] > block_top ? sh[p] : block_top;
            const float new_top = block_top > top[h] ? block_top : top[h];
            const float rescale = expf(top[h] - new_top);
            top[h] = new_top;
            for (int64_t p = p0 - p0 % W; p < p1; p += W) store(sh + p, vexp(load(sh + p) - splat(new_top)));
            float sum = 0.0f;
            for (int64_t p = p0; p < p1; ++p) sum += sh[p];
            total[h] = total[h] * rescale + sum;
            for (int d = 0; d < HEAD_DIM / W; ++d)
                store(acc + h * HEAD_DIM + d * W, load(acc + h * HEAD_DIM + d * W) * splat(rescale));
        }
        /* Values: per KV head, its query heads' accumulators in registers, VALUE_HEADS at a time,
           while the block's value rows pass (from L1 after the first group). */
        for (int64_t g = 0; g < heads_per_task; ++g)
            for (int64_t h = g * group; h < (g + 1) * group; h += VALUE_HEADS) {
                const int64_t count = (g + 1) * group - h < VALUE_HEADS ? (g + 1) * group - h : VALUE_HEADS;
                const kv_t *value = values + g * HEAD_DIM;
                const float *weights = scores + h * padded;
                float *into = acc + h * HEAD_DIM;
                switch (count) {
#if VALUE_HEADS >= 6
                case 6: weigh_values(value, row_size, weights, padded, into, p0, p1, 6); break;
                case 5: weigh_values(value, row_size, weights, padded, into, p0, p1, 5); break;
                case 4: weigh_values(value, row_size, weights, padded, into, p0, p1, 4); break;
                case 3: weigh_values(value, row_size, weights, padded, into, p0, p1, 3); break;
#endif
#if VALUE_HEADS >= 2
                case 2: weigh_values(value, row_size, weights, padded, into, p0, p1, 2); break;
#endif
                default: weigh_values(value, row_size, weights, padded, into, p0, p1, 1); break;
                }
            }
    }
    for (int64_t h = 0; h < width; ++h) {
        const float inv = 1.0f / total[h];
        for (int64_t d = 0; d < HEAD_DIM; ++d) oi[h * HEAD_DIM + d] = acc[h * HEAD_DIM + d] * inv;
    }
}

/* q: [tokens, q_heads, HEAD_DIM] with row stride q_stride (a view into the fused projection: no copy);
   out: [tokens, q_heads, HEAD_DIM] contiguous; caches: [slots, kv_heads, HEAD_DIM]; rows: [n] the flat-batch row
   of each decode query; tables: [n, max_blocks]; lens: [n] context length, the new token included;
   window: 0 for none, else the sliding window; softcap: 0 for none, else every score s becomes
   softcap * tanh(s / softcap) before the softmax (gemma2). Returns 0, or -1 when scratch memory ran out.

   One pass over the context, a block at a time, with an online softmax: every query head's score against
   each key row of the block (rows in order), per head the exponentials against the running maximum
   (rescaling what was accumulated when the maximum grows), then every head's update from each value row;
   keys and values are read once, each while it is in the L1 cache. */
int asyncllm_paged_decode_f32(const float *q, int64_t q_stride, const kv_t *k_cache, const kv_t *v_cache,
                              float *out, const int64_t *rows, const int64_t *tables, const int64_t *lens,
                              int64_t n, int64_t q_heads, int64_t kv_heads, int64_t block_size,
                              int64_t max_blocks, int64_t window, float scale, float softcap) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const decode_args a = decode_arguments(q, q_stride, INT64_MAX, k_cache, v_cache, rows, tables, lens, n, q_heads,
        kv_heads, block_size, max_blocks, window, INT64_MAX, scale, softcap, threads);
    const int64_t group = a.group, splits = a.splits, heads_per_task = a.heads_per_task, width = a.width;
    const int64_t padded = a.padded;
    int failed = 0;
#pragma omp parallel
    {
        float *queries = (float *)malloc(sizeof(float) * (size_t)(width * HEAD_DIM));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(width * HEAD_DIM));
        float *top = (float *)malloc(sizeof(float) * (size_t)width);
        float *total = (float *)malloc(sizeof(float) * (size_t)width);
        float *scores = (float *)calloc((size_t)(padded * width), sizeof(float));
        int ok = queries && acc && top && total && scores;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n * splits; ++task) {
            if (!ok) continue;
            decode_task(&a, task, queries, acc, top, total, scores,
                        out + (rows[task / splits] * q_heads + (task % splits) * heads_per_task * group) * HEAD_DIM);
        }
        free(queries);
        free(acc);
        free(top);
        free(total);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* asyncllm_paged_decode_f32 as a job of the kernel pool (backends.cpu._pool), a task per (sequence, KV heads)
   computed into the participant's scratch and committed to `out`. The sequences' query rows, block tables and
   lengths are first copied into the pool's input buffer (a late helper may still read them after this call);
   cache_slots: the caches' rows, which bound the blocks a task reads. Returns 1 once done, 0 when the pool
   cannot take it (the inputs do not fit its buffer, or the scratch its own): the caller runs the OpenMP one. */
typedef struct {
    decode_args a;
    float *out;            /* the caller's: only a commit, inside the call, writes there */
    const int64_t *rows;   /* the caller's rows, for the commit's offsets */
} decode_job;

static inline int64_t decode_scratch_floats(const decode_args *a) {
    return 3 * a->width * HEAD_DIM + 2 * a->width + a->padded * a->width;
}

static void decode_compute(const void *context, int64_t task, int64_t next, void *scratch) {
    (void)next;
    const decode_args *a = &((const decode_job *)context)->a;
    float *queries = scratch, *acc = queries + a->width * HEAD_DIM, *oi = acc + a->width * HEAD_DIM;
    float *top = oi + a->width * HEAD_DIM, *total = top + a->width, *scores = total + a->width;
    decode_task(a, task, queries, acc, top, total, scores, oi);
}

static void decode_direct(const void *context, int64_t task, int64_t next, void *scratch) {
    (void)next;
    const decode_job *job = context;
    const decode_args *a = &job->a;
    float *queries = scratch, *acc = queries + a->width * HEAD_DIM, *top = acc + 2 * a->width * HEAD_DIM;
    float *total = top + a->width, *scores = total + a->width;
    const int64_t i = task / a->splits, h0 = (task % a->splits) * a->heads_per_task;
    float *oi = job->out + (job->rows[i] * a->q_heads + h0 * a->group) * HEAD_DIM;
    decode_task(a, task, queries, acc, top, total, scores, oi);
}

static void decode_commit(const void *context, int64_t task, const void *scratch) {
    const decode_job *job = context;
    const decode_args *a = &job->a;
    const float *oi = (const float *)scratch + 2 * a->width * HEAD_DIM;
    const int64_t i = task / a->splits, h0 = (task % a->splits) * a->heads_per_task;
    memcpy(job->out + (job->rows[i] * a->q_heads + h0 * a->group) * HEAD_DIM, oi,
           sizeof(float) * (size_t)(a->width * HEAD_DIM));
}

int asyncllm_paged_decode_pooled(void *pool, void *run, char *input, int64_t input_bytes, int64_t threads,
                                 const float *q, int64_t q_stride, const kv_t *k_cache, const kv_t *v_cache,
                                 float *out, const int64_t *rows, const int64_t *tables, const int64_t *lens,
                                 int64_t n, int64_t q_heads, int64_t kv_heads, int64_t block_size,
                                 int64_t max_blocks, int64_t window, float scale, float softcap, int64_t cache_slots) {
    const int64_t q_floats = n * q_heads * HEAD_DIM, q_bytes = (q_floats * 4 + 63) / 64 * 64;
    if (n < 1 || q_bytes + (2 * n + n * max_blocks) * 8 > input_bytes) return 0;
    float *q_copy = (float *)input;
    int64_t *rows_copy = (int64_t *)(input + q_bytes), *lens_copy = rows_copy + n, *tables_copy = lens_copy + n;
    for (int64_t i = 0; i < n; ++i) {
        memcpy(q_copy + i * q_heads * HEAD_DIM, q + rows[i] * q_stride, sizeof(float) * (size_t)(q_heads * HEAD_DIM));
        rows_copy[i] = i;
    }
    memcpy(lens_copy, lens, sizeof(int64_t) * (size_t)n);
    memcpy(tables_copy, tables, sizeof(int64_t) * (size_t)(n * max_blocks));
    const decode_job context = {
        decode_arguments(q_copy, q_heads * HEAD_DIM, n, k_cache, v_cache, rows_copy, tables_copy, lens_copy, n, q_heads,
                         kv_heads, block_size, max_blocks, window, cache_slots / block_size, scale, softcap, threads),
        out, rows};
    pool_job job = {decode_compute, decode_commit, decode_direct, n * context.a.splits,
                    decode_scratch_floats(&context.a) * (int64_t)sizeof(float), threads, sizeof context, {0}};
    memcpy(job.context, &context, sizeof context);
    return ((pool_run_fn)run)(pool, &job);
}

/* Causal attention of prompt chunks (a flash-attention tiling): q rows [tokens, q_heads, HEAD_DIM], k, v rows
   [tokens, kv_heads, HEAD_DIM], with row strides q_stride, k_stride, v_stride (views into the fused
   projection); out rows [tokens, q_heads, HEAD_DIM] contiguous; chunk c is rows [starts[c], ends[c]). A chunk
   with history (history[c] > 0 cached positions before its first query; history may be NULL: none) reads
   every key and value of positions [0, history[c] + its length) from the caches k_cache, v_cache ([slots,
   kv_heads, HEAD_DIM]) at slots[slot_starts[c] + position], its own new ones included (already written
   there); a chunk without reads its own new keys and values from k and v. Work: (chunk, KV head, block of
   TILE queries), each walking the key tiles up to its diagonal with an online softmax. The softmax runs
   across the tile's queries at once (lanes = queries): the scores of every query against one key are one
   vector, so a tile's maxima, exponentials and sums are whole-vector operations, not per-row maxima, sums and
   scalar exponentials across lanes. Returns 0, or -1 when scratch memory ran out. */
#define TILE W
/* The weighted values' register block: QB queries x DV vectors (HEAD_DIM / W) of accumulators, at most 16. */
#define DV (HEAD_DIM / W)
#define QB_FIT (16 / DV >= 16 ? 16 : 16 / DV >= 8 ? 8 : 16 / DV >= 4 ? 4 : 16 / DV >= 2 ? 2 : 1)
#define QB (QB_FIT < TILE ? QB_FIT : TILE)
#define HISTORY(c) (history ? history[c] : 0)
int asyncllm_causal_prefill_f32(const float *q, int64_t q_stride, const float *k, const float *v, float *out,
                                const int64_t *starts, const int64_t *ends, int64_t chunks, int64_t q_heads,
                                int64_t kv_heads, int64_t k_stride, int64_t v_stride, float scale,
                                const int64_t *history, const int64_t *slots, const int64_t *slot_starts,
                                const kv_t *k_cache, const kv_t *v_cache) {
    const int64_t group = q_heads / kv_heads, cache_row = kv_heads * HEAD_DIM;
    int64_t total = 0, tasks = 0;
    for (int64_t c = 0; c < chunks; ++c) {
        total += (HISTORY(c) + ends[c] - starts[c] + TILE - 1) / TILE * TILE;
        tasks += (ends[c] - starts[c] + TILE - 1) / TILE * kv_heads;
    }
    /* keys_r[offset of chunk + (kv head * padded + key) * HEAD_DIM + d], values_r alike: each chunk's keys and
       values per KV head (its history's first), contiguous and zero-padded to whole tiles, so a tile's rows
       sit at fixed offsets from one pointer. */
    float *keys_r = (float *)calloc((size_t)(total * kv_heads * HEAD_DIM), sizeof(float));
    float *values_r = (float *)calloc((size_t)(total * kv_heads * HEAD_DIM), sizeof(float));
    int64_t *offsets = (int64_t *)malloc(sizeof(int64_t) * (size_t)(chunks + 1));
    if (!keys_r || !values_r || !offsets) {
        free(keys_r);
        free(values_r);
        free(offsets);
        return -1;
    }
    offsets[0] = 0;
    for (int64_t c = 0; c < chunks; ++c)
        offsets[c + 1] = offsets[c] + (HISTORY(c) + ends[c] - starts[c] + TILE - 1) / TILE * TILE * kv_heads * HEAD_DIM;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t ck = 0; ck < chunks * kv_heads; ++ck) {
            const int64_t c = ck / kv_heads, g = ck % kv_heads, hist = HISTORY(c), len = hist + ends[c] - starts[c];
            const int64_t padded = (len + TILE - 1) / TILE * TILE;
            float *key_dst = keys_r + offsets[c] + g * padded * HEAD_DIM;
            float *value_dst = values_r + offsets[c] + g * padded * HEAD_DIM;
            for (int64_t t = 0; t < len; ++t) {
                if (hist) {
                    const kv_t *key = k_cache + slots[slot_starts[c] + t] * cache_row + g * HEAD_DIM;
                    const kv_t *value = v_cache + slots[slot_starts[c] + t] * cache_row + g * HEAD_DIM;
                    for (int64_t d = 0; d < HEAD_DIM; ++d) {
                        key_dst[t * HEAD_DIM + d] = kv_float(key[d]);
                        value_dst[t * HEAD_DIM + d] = kv_float(value[d]);
                    }
                } else {
                    const int64_t row = starts[c] + t;
                    memcpy(key_dst + t * HEAD_DIM, k + row * k_stride + g * HEAD_DIM, sizeof(float) * HEAD_DIM);
                    memcpy(value_dst + t * HEAD_DIM, v + row * v_stride + g * HEAD_DIM, sizeof(float) * HEAD_DIM);
                }
            }
        }
        /* queries_t[d * TILE + i]: the tile's queries (scaled), d-major, so a column is one vector (lanes =
           queries); probs[j * TILE + i]: the tile's probabilities against key j. */
        float *queries_t = (float *)malloc(sizeof(float) * TILE * HEAD_DIM);
        float *acc = (float *)malloc(sizeof(float) * TILE * HEAD_DIM);
        float *probs = (float *)malloc(sizeof(float) * TILE * TILE);
        if (!queries_t || !acc || !probs) {
#pragma omp atomic write
            failed = 1;
        }
        ivec lane;
        for (int j = 0; j < W; ++j) lane[j] = j;
        /* Tasks in order of chunk, then query tile from the last (the longest walks first), then KV head. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            if (!queries_t || !acc || !probs) continue;
            int64_t c = 0, rest = task;
            while (rest >= (ends[c] - starts[c] + TILE - 1) / TILE * kv_heads) {
                rest -= (ends[c] - starts[c] + TILE - 1) / TILE * kv_heads;
                ++c;
            }
            const int64_t hist = HISTORY(c), len = ends[c] - starts[c], padded = (len + TILE - 1) / TILE * TILE;
            const int64_t kv_padded = (hist + len + TILE - 1) / TILE * TILE;
            const int64_t tile = padded / TILE - 1 - rest / kv_heads, g = rest % kv_heads;
            const int64_t first = tile * TILE, rows = len - first < TILE ? len - first : TILE;
            /* The tile's queries sit at positions base + i; keys up to base + rows - 1 are visible to some. */
            const int64_t base = hist + first, key_tiles = (base + rows + TILE - 1) / TILE;
            const float *kr = keys_r + offsets[c] + g * kv_padded * HEAD_DIM;
            const float *vr = values_r + offsets[c] + g * kv_padded * HEAD_DIM;
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
                /* rows past the chunk's end stay zero: computed along, never written out */
                memset(queries_t, 0, sizeof(float) * TILE * HEAD_DIM);
                memset(acc, 0, sizeof(float) * TILE * HEAD_DIM);
                for (int64_t i = 0; i < rows; ++i) {
                    const float *qi = q + (starts[c] + first + i) * q_stride + h * HEAD_DIM;
                    for (int64_t d = 0; d < HEAD_DIM; ++d) queries_t[d * TILE + i] = qi[d] * scale;
                }
                /* The online softmax runs across the tile's queries at once: lane i is query i. */
                vec top = splat(-INFINITY), sum = splat(0.0f);
                for (int64_t kb = 0; kb < key_tiles; ++kb) {
                    /* keys this tile holds that some query sees (the diagonal tile's: up to the last query) */
                    const int64_t key0 = kb * TILE, keys = base + rows - key0 < TILE ? base + rows - key0 : TILE;
                    const int diagonal = key0 + TILE - 1 > base; /* some key here is past some query */
                    const float *tile_keys = kr + key0 * HEAD_DIM;
                    /* scores[j]: every query's score against key j; each query column loaded once. */
                    vec scores[TILE];
                    for (int j = 0; j < TILE; ++j) scores[j] = splat(0.0f);
                    for (int64_t d = 0; d < HEAD_DIM; ++d) {
                        const vec column = load(queries_t + d * TILE);
                        for (int j = 0; j < TILE; ++j) scores[j] += column * tile_keys[j * HEAD_DIM + d];
                    }
                    /* Key key0 + j is visible to the queries at positions base + i >= key0 + j only (causal). */
                    if (diagonal)
                        for (int j = 0; j < TILE; ++j)
                            scores[j] = vselect(lane >= (int)(key0 + j - base), scores[j], splat(-INFINITY));
                    vec block_top = scores[0];
                    for (int j = 1; j < TILE; ++j) block_top = vmax(block_top, scores[j]);
                    const vec new_top = vmax(top, block_top);
                    const vec rescale = vexp(top - new_top);
                    top = new_top;
                    vec block_sum = splat(0.0f);
                    for (int j = 0; j < TILE; ++j) {
                        vec p = vexp(scores[j] - new_top);
                        if (diagonal) p = vselect(lane >= (int)(key0 + j - base), p, splat(0.0f));
                        block_sum += p;
                        store(probs + j * TILE, p);
                    }
                    sum = sum * rescale + block_sum;
                    /* Weighted values, lanes = dimensions: acc[i] (query i's accumulator row) += query i's
                       probability against key j, broadcast, x value row j. QB queries at a time keep their
                       rows in registers, rescaled as they are loaded, and share each value row's loads: per
                       key DV loads feed QB x DV multiply-adds, where lanes = queries would need a load per
                       multiply-add. */
                    float rescales[TILE];
                    store(rescales, rescale);
                    const float *tile_values = vr + key0 * HEAD_DIM;
                    for (int i0 = 0; i0 < TILE; i0 += QB) {
                        vec a[QB][DV];
                        for (int i = 0; i < QB; ++i)
                            for (int e = 0; e < DV; ++e)
                                a[i][e] = load(acc + (i0 + i) * HEAD_DIM + e * W) * splat(rescales[i0 + i]);
                        for (int64_t j = 0; j < keys; ++j) {
                            vec value[DV];
                            for (int e = 0; e < DV; ++e) value[e] = load(tile_values + j * HEAD_DIM + e * W);
                            for (int i = 0; i < QB; ++i) {
                                const vec p = splat(probs[j * TILE + i0 + i]);
                                for (int e = 0; e < DV; ++e) a[i][e] += p * value[e];
                            }
                        }
                        for (int i = 0; i < QB; ++i)
                            for (int e = 0; e < DV; ++e) store(acc + (i0 + i) * HEAD_DIM + e * W, a[i][e]);
                    }
                }
                for (int64_t i = 0; i < rows; ++i) {
                    float *oi = out + ((starts[c] + first + i) * q_heads + h) * HEAD_DIM;
                    const float inv = 1.0f / sum[i];
                    for (int64_t d = 0; d < HEAD_DIM; ++d) oi[d] = acc[i * HEAD_DIM + d] * inv;
                }
            }
        }
        free(queries_t);
        free(acc);
        free(probs);
    }
    free(keys_r);
    free(values_r);
    free(offsets);
    return failed ? -1 : 0;
}
"""


@dataclass(frozen=True, slots=True)
class CpuPrefillChunk:
    """A sequence that feeds more than one token this step."""

    query_start: int
    query_end: int
    kv_slots: torch.Tensor | None
    """[kv_len] slots of the cached context, new tokens included; None when the chunk starts at
    position 0 (it attends to its own new keys and values only)."""
    mask: torch.Tensor | None
    """[query_len, kv_len] True where a query may attend; None: plain causal."""
    history: int = 0
    """Cached positions before the chunk's first query (its start position)."""
    causal: bool = False
    """Every query sees every position up to its own (no window cuts the context): the prefill kernel's case."""


@dataclass(frozen=True, slots=True)
class CpuAttentionMetadata:
    """A step's flat batch as the ``cpu`` backend reads it; built once per step, shared by every layer."""

    slot_mapping: torch.Tensor
    """[tokens] int64 the cache slot each new token's K/V is written to."""
    decode_rows: torch.Tensor
    """[decodes] int64 rows of the single-token queries in the flat batch."""
    decode_block_tables: torch.Tensor
    """[decodes, max_blocks] int64 block tables, zero-padded."""
    decode_seq_lens: torch.Tensor
    """[decodes] int64 context lengths, the new token included."""
    block_size: int
    sliding_window: int | None
    prefills: tuple[CpuPrefillChunk, ...]
    global_prefills: tuple[CpuPrefillChunk, ...] | None = None
    """``prefills`` without the sliding window, for a model's global layers; None: no window (the same)."""
    kernel_plans: dict[bool, _KernelPlan] = field(default_factory=dict)
    """The prefill kernel's arrays for ``prefills`` (key True) and ``global_prefills`` (False), built by the
    first layer that needs them and shared by the rest."""


@dataclass(frozen=True, slots=True)
class _KernelPlan:
    """The causal chunks of a step as the prefill kernel takes them (``CpuPrefillChunk.causal``)."""

    chunks: list[CpuPrefillChunk]
    bounds: torch.Tensor
    """[2, chunks] int64: each chunk's first and end rows."""
    history: torch.Tensor
    """[chunks] int64 cached positions before each chunk."""
    slots: torch.Tensor
    """The slots of every position of the chunks with history, chunk after chunk (empty without any)."""
    slot_starts: torch.Tensor
    """[chunks] int64: where each chunk's slots start in ``slots``."""

    @classmethod
    def of(cls, chunks: list[CpuPrefillChunk]) -> _KernelPlan:
        starts, parts, at = [], [], 0
        for chunk in chunks:
            starts.append(at)
            if chunk.history:
                assert chunk.kv_slots is not None  # a chunk with history reads the cache
                parts.append(chunk.kv_slots)
                at += chunk.kv_slots.numel()
        return cls(
            chunks,
            torch.tensor([[c.query_start, c.query_end] for c in chunks], dtype=torch.int64).t().contiguous(),
            torch.tensor([c.history for c in chunks], dtype=torch.int64),
            torch.cat(parts) if parts else torch.zeros(1, dtype=torch.int64),
            torch.tensor(starts, dtype=torch.int64),
        )


def layer_prefills(meta: CpuAttentionMetadata, windowed: bool) -> tuple[CpuPrefillChunk, ...]:
    """The prompt chunks a layer attends with: the window's (``windowed``: a sliding layer of a model that also has
    global ones) or the global ones, which are the same where the model has no window."""
    return meta.prefills if windowed or meta.global_prefills is None else meta.global_prefills


def kernel_plan(meta: CpuAttentionMetadata, windowed: bool) -> _KernelPlan:
    """The causal chunks of ``layer_prefills(meta, windowed)`` as the prefill kernel takes them: built by the
    step's first layer that needs them, shared by the rest (``meta.kernel_plans``)."""
    plan = meta.kernel_plans.get(windowed)
    if plan is None:
        plan = meta.kernel_plans[windowed] = _KernelPlan.of([c for c in layer_prefills(meta, windowed) if c.causal])
    return plan


def build_metadata(step: StepInputs, *, sliding_window: int | None) -> CpuAttentionMetadata:
    """The ``cpu`` backend's metadata for a step (the CPU only: tensors share the step's arrays, no copies).

    Args:
        step: The step's arrays (``InputBatch.prepare``).
        sliding_window: The model's sliding window, or None.
    """
    split = split_step(step)
    block_size = step.block_size
    return CpuAttentionMetadata(
        slot_mapping=torch.from_numpy(np.ascontiguousarray(step.slot_mapping, dtype=np.int64)),
        decode_rows=torch.from_numpy(split.decode_rows),
        decode_block_tables=torch.from_numpy(split.decode_tables),
        decode_seq_lens=torch.from_numpy(split.decode_lens),
        block_size=block_size,
        sliding_window=sliding_window,
        prefills=tuple(_prefill_chunk(span, block_size, sliding_window) for span in split.prefills),
        global_prefills=None
        if sliding_window is None
        else tuple(_prefill_chunk(span, block_size, None) for span in split.prefills),
    )


def _prefill_chunk(span: PrefillSpan, block_size: int, sliding_window: int | None) -> CpuPrefillChunk:
    start, kv_len = span.start_position, span.kv_len
    windowed = sliding_window is not None and kv_len > sliding_window
    if start == 0 and not windowed:
        return CpuPrefillChunk(span.query_start, span.query_end, None, None, causal=True)
    # A chunk with history reads the cache from the window of its first query on: the positions before
    # it are never read (their blocks may have gone back to the pool, ``SequenceInput.block_offset``).
    first = 0 if start == 0 or sliding_window is None else max(0, start - sliding_window + 1)
    kv_positions = np.arange(first, kv_len, dtype=np.int64)
    query_positions = np.arange(start, kv_len, dtype=np.int64)
    mask = kv_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        mask &= kv_positions[None, :] > query_positions[:, None] - sliding_window
    if start == 0:
        return CpuPrefillChunk(span.query_start, span.query_end, None, torch.from_numpy(mask))
    slots = span.block_table[kv_positions // block_size] * block_size + kv_positions % block_size
    return CpuPrefillChunk(
        span.query_start,
        span.query_end,
        torch.from_numpy(slots),
        torch.from_numpy(mask),
        history=start,
        causal=not windowed and not first,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: CpuAttentionMetadata,
    scale: float,
    *,
    sliding: bool = True,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of every query in the flat batch against its sequence's cached K/V.

    Args:
        q: [tokens, heads, head_dim] float32 queries (rotary applied).
        k: [tokens, kv_heads, head_dim] this step's keys (rotary applied), already written to the cache.
        v: [tokens, kv_heads, head_dim] this step's values, already written to the cache.
        k_cache: [slots, kv_heads, head_dim] float32 contiguous key cache of the layer.
        v_cache: Like ``k_cache``, for values.
        meta: The step's metadata (``build_metadata``).
        scale: Softmax scale.
        sliding: Apply the metadata's sliding window (False: a global layer of a model with one).
        softcap: Soft-cap the scores before the softmax (gemma2): the decode kernel does; prompt chunks
            then take the torch path (``backends.torch._attention.sdpa``), not the prefill kernel.

    Returns:
        [tokens, heads, head_dim] attention outputs.

    Raises:
        ValueError: The tensors are not float32, do not agree in shape, or a cache is not contiguous.
        RuntimeError: The decode kernel is unavailable, or a kernel could not allocate its scratch memory.
    """
    _check_inputs(q, k, v, k_cache, v_cache)
    # The kernels take q's row stride (q is a view into the fused projection); the heads of a row
    # must be packed.
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    attend_into(q, k, v, k_cache, v_cache, meta, scale, out, sliding=sliding, softcap=softcap)
    return out


def attend_into(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: CpuAttentionMetadata,
    scale: float,
    out: torch.Tensor,
    *,
    sliding: bool = True,
    softcap: float | None = None,
    pool: kernel_pool.KernelPool | None = None,
) -> None:
    """``paged_attention`` into ``out`` ([tokens, heads, head_dim], contiguous), without its checks.

    For callers that own the layouts (``asyncllm.backends.cpu._lean_forward``): q with packed heads (row stride
    free), everything float32 on the CPU, the caches contiguous. With ``pool``, the decode rows run on that
    kernel pool (``backends.cpu._pool``) at torch's thread count where it takes them, else on OpenMP; same
    bits either way. Raises RuntimeError as ``paged_attention`` does.
    """
    num_decodes = meta.decode_rows.numel()
    window = (meta.sliding_window or 0) if sliding else 0
    if num_decodes and pool is not None:
        pooled = _function(q.shape[-1], k_cache.dtype, "asyncllm_paged_decode_pooled")
        if pooled is not None and pooled(
            pool.handle, pool.run, pool.input, pool.input_bytes, pool.threads,
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            meta.decode_rows.data_ptr(), meta.decode_block_tables.data_ptr(), meta.decode_seq_lens.data_ptr(),
            num_decodes, q.shape[1], k_cache.shape[1], meta.block_size, meta.decode_block_tables.shape[1], window,
            scale, softcap or 0.0, k_cache.shape[0],
        ):  # fmt: skip
            num_decodes = 0
    if num_decodes:
        kernel = _kernel(q.shape[-1], k_cache.dtype)
        if kernel is None:
            raise RuntimeError("the cpu attention backend needs its C kernel; see native_decode_available()")
        status = kernel(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            out.data_ptr(),
            meta.decode_rows.data_ptr(),
            meta.decode_block_tables.data_ptr(),
            meta.decode_seq_lens.data_ptr(),
            num_decodes,
            q.shape[1],
            k_cache.shape[1],
            meta.block_size,
            meta.decode_block_tables.shape[1],
            window,
            scale,
            softcap or 0.0,
        )
        if status != 0:
            raise RuntimeError("the cpu decode attention kernel could not allocate its scratch memory")
    windowed = sliding and meta.global_prefills is not None
    prefills = layer_prefills(meta, windowed)
    has_causal = any(c.causal for c in prefills)
    prefill = _prefill_kernel(q.shape[-1], k_cache.dtype) if has_causal and softcap is None else None
    rest: tuple[CpuPrefillChunk, ...] | list[CpuPrefillChunk] = prefills
    if prefill is not None and k.stride(2) == 1 and v.stride(2) == 1 and k.stride(1) == v.stride(1) == k.shape[2]:
        # Causal chunks (from position 0, or after cached history) in the C kernel, all at once.
        plan = kernel_plan(meta, windowed)
        status = prefill(
            q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), out.data_ptr(), plan.bounds[0].data_ptr(),
            plan.bounds[1].data_ptr(), len(plan.chunks), q.shape[1], k.shape[1], k.stride(0), v.stride(0), scale,
            plan.history.data_ptr(), plan.slots.data_ptr(), plan.slot_starts.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError("the cpu prefill attention kernel could not allocate its scratch memory")
        rest = [c for c in prefills if not c.causal]
    for chunk in rest:
        queries = q[chunk.query_start : chunk.query_end].transpose(0, 1).unsqueeze(0)
        if chunk.kv_slots is None:
            keys = k[chunk.query_start : chunk.query_end]
            values = v[chunk.query_start : chunk.query_end]
        else:
            keys = k_cache.index_select(0, chunk.kv_slots).to(queries.dtype)
            values = v_cache.index_select(0, chunk.kv_slots).to(queries.dtype)
        keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        attended = reference_sdpa(queries, keys, values, chunk.mask, scale, softcap)
        out[chunk.query_start : chunk.query_end] = attended.squeeze(0).transpose(0, 1)


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    # The kernels read raw pointers: what they cannot read must fail here, not as a wild read.
    tensors = {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache}
    for name, tensor in tensors.items():
        dtypes = KV_DTYPES if name.endswith("cache") else (torch.float32,)
        if tensor.dtype not in dtypes or tensor.device.type != "cpu" or tensor.dim() != 3:
            kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{name} must be a 3-D {kinds} CPU tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape):
        raise ValueError("k_cache and v_cache must be contiguous and of one shape")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must be of one dtype, not {k_cache.dtype} and {v_cache.dtype}")
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    if q.shape[2] != head_dim or q.shape[1] % kv_heads or k.shape != v.shape or k.shape[1:] != (kv_heads, head_dim):
        got = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)}"
        raise ValueError(f"attention shapes do not agree: {got}")


def native_decode_available(head_dim: int) -> bool:
    """Whether the decode kernel for ``head_dim`` is built (building it now, once per process, if needed)."""
    return _kernel(head_dim) is not None


_Kernel = Callable[..., int]

KV_DTYPES = (torch.float32, torch.bfloat16)
"""The cache dtypes the kernels read: float32, or bfloat16 (beside bfloat16 weights: ``TorchModelRunner.kv_dtype``)."""


_SIGNATURES: native.Signatures = {
    "asyncllm_paged_decode_f32": ([PTR, I64, *[PTR] * 6, *[I64] * 6, F32, F32], I32),
    "asyncllm_causal_prefill_f32": ([PTR, I64, *[PTR] * 5, *[I64] * 5, F32, *[PTR] * 5], I32),
    "asyncllm_paged_decode_pooled": ([PTR, PTR, PTR, I64, I64, PTR, I64, *[PTR] * 6, *[I64] * 6, F32, F32, I64], I32),
}


@functools.cache
def _library(head_dim: int, bfloat16_kv: bool = False) -> ctypes.CDLL | None:
    if head_dim % 4:
        return None  # the kernels' vectors are 4, 8 or 16 floats wide
    # -ffp-contract=fast lets the multiply-adds be fused (ISO C mode forbids it by default): fewer roundings
    # and instructions in the dot products.
    source = f"#define HEAD_DIM {head_dim}\n#define KV_BF16 {int(bfloat16_kv)}\n{_SOURCE}"
    name = f"attention_hd{head_dim}{'_bf16kv' if bfloat16_kv else ''}"
    return native.load(name, source, _SIGNATURES, ("-ffp-contract=fast",))


def _function(head_dim: int, kv_dtype: torch.dtype, name: str) -> _Kernel | None:
    library = _library(head_dim, kv_dtype == torch.bfloat16)
    return None if library is None else cast(_Kernel, getattr(library, name))


def kernel_address(head_dim: int, kv_dtype: torch.dtype, name: str) -> int:
    """The address of the attention library's C function ``name`` for ``head_dim`` and a ``kv_dtype`` cache, for C
    code that calls it directly (``backends.cpu._lean_forward``). RuntimeError where it is not built."""
    library = _library(head_dim, kv_dtype == torch.bfloat16)
    if library is None:
        raise RuntimeError(f"the cpu attention kernels for head_dim {head_dim} are unavailable here")
    return native.address(getattr(library, name))


def _kernel(head_dim: int, kv_dtype: torch.dtype = torch.float32) -> _Kernel | None:
    return _function(head_dim, kv_dtype, "asyncllm_paged_decode_f32")


def _prefill_kernel(head_dim: int, kv_dtype: torch.dtype = torch.float32) -> _Kernel | None:
    return _function(head_dim, kv_dtype, "asyncllm_causal_prefill_f32")


def bfloat16_kv_available(head_dim: int) -> bool:
    """Whether the kernels for a bfloat16 KV cache at ``head_dim`` are built (building them now if needed)."""
    return _kernel(head_dim, torch.bfloat16) is not None
