"""Float32 matmuls on AMX from bfloat16 parts, against MKL's float32 GEMM: an experiment kept runnable.

    python benchmarks/amx_gemm.py [--rows 2048 512 64] [--pairs 15] [--probes 10]

docs/performance-log.md, "Eleventh round", tried this kernel for the prompts' matmuls and did not keep it in
the engine; this script reproduces those figures. Each float32 (inputs and weights) splits exactly into
three bfloat16 parts ``h + m + l``; AMX forms the six largest of the nine part products exactly and sums
them in float32 (the five small ones first over all inputs, ``h*h`` last). The three dropped products
are at most ``2**-24 |x_k w_k|`` each.

What it prints:

1. The tile unit's rate, ``--probes`` times a second apart: one thread running only tile products on
   L1 data. On this project's host it is 1.9-2.4 TFLOPS bfloat16 alone and about half that while the
   other vCPU also runs tile products: the two share one physical core's tile unit, at least at times.
2. Per row count: the model's four matmul shapes (the throughput benchmark's layer: [1024|512|3072 x
   512] and [512 x 1536]) on AMX and on MKL's packed float32 GEMM, alternating ``--pairs`` times. It
   prints the median time a layer and the median of the per-pair ratios (MKL's time over AMX's). It
   also prints each kernel's largest error against a float64 product, relative to ``sum_k |x_k w_k|``.

Needs x86 with AMX-BF16 and AVX512-BF16 and Linux's tile permission; elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

from asyncllm.backends.cpu import _native as native
from asyncllm.models import _linear as linear

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SLICE 32          /* inputs per tile: 16 rows of bfloat16 pairs */
#define BLOCK 32          /* output columns per block (two tiles) and rows per row block (two tiles) */
#define PARTS 3           /* bfloat16 parts per float32: h, m, l */
#define TILE_ELEMENTS 512 /* bfloat16 values in a 1 KB tile */
#define PASS_BYTES (1 << 20) /* split input rows per pass: about half of a core's L2 */

int asyncllm_amx_permit(void) {
    /* Linux hands out AMX's 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

static void configure_tiles(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; ++t) { config.rows[t] = 16; config.colsb[t] = 64; }
    _tile_loadconfig(&config);
}

static inline __m512 widen(__m256i parts) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(parts), 16));
}

/* Split 16 floats into h + m + l, each the nearest bfloat16 to what the previous parts leave. */
static inline void split16(__m512 v, __m256i *h, __m256i *m, __m256i *l) {
    *h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 rest = _mm512_sub_ps(v, widen(*h));
    *m = (__m256i)_mm512_cvtneps_pbh(rest);
    *l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(rest, widen(*m)));
}

static inline int64_t slices_of(int64_t in_features) { return (in_features + SLICE - 1) / SLICE; }

int64_t asyncllm_amx_packed_elements(int64_t out_features, int64_t in_features) {
    return (out_features + BLOCK - 1) / BLOCK * slices_of(in_features) * PARTS * 2 * TILE_ELEMENTS;
}

/* Rows per pass over the weight: a multiple of BLOCK whose split copy takes about PASS_BYTES. */
static int64_t pass_rows(int64_t in_features) {
    const int64_t per_row = PARTS * slices_of(in_features) * SLICE * 2;
    const int64_t rows = PASS_BYTES / per_row / BLOCK * BLOCK;
    return rows < BLOCK ? BLOCK : rows;
}

int64_t asyncllm_amx_scratch_bytes(int64_t rows, int64_t in_features) {
    int64_t pass = pass_rows(in_features);
    const int64_t padded = (rows + BLOCK - 1) / BLOCK * BLOCK;
    if (padded < pass) pass = padded;
    return PARTS * pass * slices_of(in_features) * SLICE * 2;
}

void asyncllm_amx_pack(const float *weight, uint16_t *packed, int64_t out_features, int64_t in_features) {
    const int64_t blocks = (out_features + BLOCK - 1) / BLOCK, slices = slices_of(in_features);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t s = 0; s < slices; ++s) {
            uint16_t *tiles = packed + (b * slices + s) * PARTS * 2 * TILE_ELEMENTS;
            for (int64_t c = 0; c < BLOCK; ++c) {
                const int64_t column = b * BLOCK + c;
                float values[SLICE];
                for (int64_t k = 0; k < SLICE; ++k) {
                    const int64_t input = s * SLICE + k;
                    const int inside = column < out_features && input < in_features;
                    values[k] = inside ? weight[column * in_features + input] : 0.0f;
                }
                for (int half = 0; half < 2; ++half) {
                    __m256i parts[PARTS];
                    split16(_mm512_loadu_ps(values + 16 * half), &parts[0], &parts[1], &parts[2]);
                    for (int p = 0; p < PARTS; ++p) {
                        uint16_t lanes[16];
                        _mm256_storeu_si256((__m256i *)lanes, parts[p]);
                        for (int k = 0; k < 16; ++k) {
                            const int input = 16 * half + k; /* row input/2 of the tile, element 2c + input%2 */
                            const int64_t at = (input / 2) * 32 + (c % 16) * 2 + input % 2;
                            tiles[(p * 2 + c / 16) * TILE_ELEMENTS + at] = lanes[k];
                        }
                    }
                }
            }
        }
}

/* Rows [first, first + count) of x, split into the three part planes of `split` (row stride
   slices * SLICE); rows past `rows` and inputs past in_features are zeros. */
static void split_rows(const float *x, int64_t x_stride, int64_t rows, int64_t first, int64_t count,
                       int64_t in_features, int64_t slices, uint16_t *split) {
    const int64_t width = slices * SLICE, plane = count * width;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < count; ++r) {
        const float *row = x + (first + r) * x_stride;
        for (int64_t k = 0; k < width; k += 16) {
            const int64_t left = first + r < rows ? in_features - k : 0;
            const __mmask16 lanes = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
            __m256i h, m, l;
            split16(_mm512_maskz_loadu_ps(lanes, row + k), &h, &m, &l);
            _mm256_storeu_si256((__m256i *)(split + r * width + k), h);
            _mm256_storeu_si256((__m256i *)(split + plane + r * width + k), m);
            _mm256_storeu_si256((__m256i *)(split + 2 * plane + r * width + k), l);
        }
    }
}

/* Tiles 0-3: the 32 x 32 block's accumulators (2 x 2); 4-5: two row tiles of x; 6-7: two column tiles of w. */
#define PRODUCTS4 do { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); \
                         _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); } while (0)
#define LOAD_X(plane) do { _tile_loadd(4, (plane) + a, stride); \
                           _tile_loadd(5, (plane) + a + 16 * width, stride); } while (0)
#define LOAD_W(part) do { _tile_loadd(6, w + (part) * 2 * TILE_ELEMENTS, 64); \
                          _tile_loadd(7, w + ((part) * 2 + 1) * TILE_ELEMENTS, 64); } while (0)

/* out[r, 0:out_features] = x[r, :] . weight for r < rows, from a packed weight. */
void asyncllm_amx_matmul(const float *x, int64_t x_stride, const uint16_t *packed, float *out, int64_t out_stride,
                         int64_t rows, int64_t out_features, int64_t in_features, uint16_t *scratch) {
    const int64_t slices = slices_of(in_features), width = slices * SLICE, stride = width * 2;
    const int64_t blocks = (out_features + BLOCK - 1) / BLOCK, pass = pass_rows(in_features);
#pragma omp parallel
    {
        configure_tiles();
        float edge[BLOCK * BLOCK]; /* a block that overhangs the output, stored here first */
        for (int64_t first = 0; first < rows; first += pass) {
            const int64_t left = rows - first, count = (left < pass ? (left + BLOCK - 1) / BLOCK * BLOCK : pass);
            const int64_t plane = count * width;
            split_rows(x, x_stride, rows, first, count, in_features, slices, scratch);  /* ends with a barrier */
            const uint16_t *xh = scratch, *xm = scratch + plane, *xl = scratch + 2 * plane;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; ++b) {
                const uint16_t *weights = packed + b * slices * PARTS * 2 * TILE_ELEMENTS;
                for (int64_t r = 0; r < count; r += BLOCK) {
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    for (int64_t s = 0; s < slices; ++s) {  /* the five small products */
                        const uint16_t *w = weights + s * PARTS * 2 * TILE_ELEMENTS;
                        const int64_t a = r * width + s * SLICE;
                        LOAD_X(xh); LOAD_W(2); PRODUCTS4;  /* h*l */
                        LOAD_W(1); PRODUCTS4;              /* h*m */
                        LOAD_X(xm); PRODUCTS4;             /* m*m */
                        LOAD_W(0); PRODUCTS4;              /* m*h */
                        LOAD_X(xl); PRODUCTS4;             /* l*h */
                    }
                    for (int64_t s = 0; s < slices; ++s) {  /* then h*h, the large one */
                        const uint16_t *w = weights + s * PARTS * 2 * TILE_ELEMENTS;
                        const int64_t a = r * width + s * SLICE;
                        LOAD_X(xh); LOAD_W(0); PRODUCTS4;
                    }
                    const int64_t row0 = first + r, col0 = b * BLOCK;
                    if (row0 + BLOCK <= rows && col0 + BLOCK <= out_features) {
                        float *o = out + row0 * out_stride + col0;
                        _tile_stored(0, o, out_stride * 4);
                        _tile_stored(1, o + 16, out_stride * 4);
                        _tile_stored(2, o + 16 * out_stride, out_stride * 4);
                        _tile_stored(3, o + 16 * out_stride + 16, out_stride * 4);
                    } else {
                        _tile_stored(0, edge, BLOCK * 4);
                        _tile_stored(1, edge + 16, BLOCK * 4);
                        _tile_stored(2, edge + 16 * BLOCK, BLOCK * 4);
                        _tile_stored(3, edge + 16 * BLOCK + 16, BLOCK * 4);
                        const int64_t n_rows = rows - row0 < BLOCK ? rows - row0 : BLOCK;
                        const int64_t n_cols = out_features - col0 < BLOCK ? out_features - col0 : BLOCK;
                        for (int64_t i = 0; i < n_rows; ++i)
                            memcpy(out + (row0 + i) * out_stride + col0, edge + i * BLOCK, n_cols * 4);
                    }
                }
            }  /* the barrier here keeps the scratch until every thread is done with this pass */
        }
        _tile_release();
    }
}

/* Tile products alone on L1 data (four independent accumulators): the tile unit's rate, seconds for n rounds. */
double asyncllm_amx_probe(int64_t n) {
    static uint16_t data[4 * 512] __attribute__((aligned(64)));
    struct timespec t0, t1;
    configure_tiles();
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, data, 64); _tile_loadd(5, data + 512, 64);
    _tile_loadd(6, data + 1024, 64); _tile_loadd(7, data + 1536, 64);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int64_t i = 0; i < n; ++i) PRODUCTS4;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    _tile_release();
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
"""


SHAPES = {"qkv": (1024, 512), "o": (512, 512), "gate_up": (3072, 512), "down": (512, 1536)}


def _library() -> ctypes.CDLL | None:
    if not {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f"} <= native.cpu_flags():
        return None
    path = native.build("amx_gemm_experiment", _SOURCE)
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.asyncllm_amx_packed_elements.argtypes = [i64, i64]
    library.asyncllm_amx_packed_elements.restype = i64
    library.asyncllm_amx_scratch_bytes.argtypes = [i64, i64]
    library.asyncllm_amx_scratch_bytes.restype = i64
    library.asyncllm_amx_pack.argtypes = [pointer, pointer, i64, i64]
    library.asyncllm_amx_matmul.argtypes = [pointer, i64, pointer, pointer, i64, i64, i64, i64, pointer]
    library.asyncllm_amx_probe.argtypes = [i64]
    library.asyncllm_amx_probe.restype = ctypes.c_double
    return library if library.asyncllm_amx_permit() else None


class AmxMatmul:
    """One weight packed as bfloat16 parts, and ``x @ weight.T`` from it."""

    def __init__(self, library: ctypes.CDLL, weight: torch.Tensor) -> None:
        self.library = library
        self.out_features, self.in_features = weight.shape
        self.packed = torch.empty(library.asyncllm_amx_packed_elements(*weight.shape), dtype=torch.int16)
        library.asyncllm_amx_pack(weight.data_ptr(), self.packed.data_ptr(), *weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features)
        scratch = torch.empty(self.library.asyncllm_amx_scratch_bytes(rows, self.in_features), dtype=torch.uint8)
        self.library.asyncllm_amx_matmul(
            x.data_ptr(), self.in_features, self.packed.data_ptr(), out.data_ptr(), self.out_features,
            rows, self.out_features, self.in_features, scratch.data_ptr(),
        )  # fmt: skip
        return out


def _largest_error(result: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> float:
    exact = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    return float(((result.double() - exact).abs() / scale).max())


def main(argv: list[str] | None = None) -> int:
    """Run the experiment and print its figures. Returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 512, 64])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--probes", type=int, default=10)
    args = parser.parse_args(argv)
    library = _library()
    if library is None or not linear.packed_gemm_available():
        print("needs x86 with AMX-BF16, Linux's tile permission, a C compiler and MKL's packed GEMM", file=sys.stderr)
        return 2
    rounds = 200_000
    for probe in range(args.probes):
        seconds = library.asyncllm_amx_probe(rounds)
        rate = rounds * 4 * 16 * 16 * 32 * 2 / seconds / 1e12
        print(f"tile unit, probe {probe + 1}: {rate:.2f} TFLOPS bfloat16 (one thread)")
        if probe + 1 < args.probes:
            time.sleep(1.0)  # spaced out in time: the rate is what changes between probes
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator) / shape[1] ** 0.5 for name, shape in SHAPES.items()}
    amx = {name: AmxMatmul(library, w) for name, w in weights.items()}
    mkl = {name: linear.PackedWeight(w) for name, w in weights.items()}
    for rows in args.rows:
        inputs = {name: torch.randn(rows, shape[1], generator=generator) for name, shape in SHAPES.items()}
        errors = {
            "amx": max(_largest_error(amx[n](inputs[n]), inputs[n], weights[n]) for n in SHAPES),
            "mkl": max(_largest_error(mkl[n].linear(inputs[n]), inputs[n], weights[n]) for n in SHAPES),
        }
        times: dict[str, list[float]] = {"amx": [], "mkl": []}
        for pair in range(args.pairs):
            for kind in ("amx", "mkl") if pair % 2 == 0 else ("mkl", "amx"):
                start = time.perf_counter()
                for name in SHAPES:
                    amx[name](inputs[name]) if kind == "amx" else mkl[name].linear(inputs[name])
                times[kind].append(time.perf_counter() - start)
        ratios = [m / a for m, a in zip(times["mkl"], times["amx"])]
        print(
            f"{rows} rows: a layer's matmuls AMX {statistics.median(times['amx']) * 1e3:.2f} ms, MKL "
            f"{statistics.median(times['mkl']) * 1e3:.2f} ms; MKL / AMX per pair: median "
            f"{statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}; "
            f"largest error / sum|x w|: AMX {errors['amx']:.1e}, MKL {errors['mkl']:.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
