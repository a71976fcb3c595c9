/* Weight-only int4 matrix multiply for the CPU: y[M, N] = x[M, K] W[N, K]^T, x and y bf16.
 *
 * W is stored in groups of 32 along K: w = (q - 8) * scale + zero, with q in 0..15 and one
 * bf16 scale and zero per (output column, group). The layout (written by int4_pack in
 * model/quantized_linear.py) is tiled for this loop: tiles of 16 output columns, each with
 * its whole K contiguous, so one tile of weights (at most a few kB) is expanded once per
 * block of 8 rows and stays in L1 for the next block. A row's sums are taken in the same
 * order whatever the number of rows, so its result does not depend on its batch. Three
 * loops: AVX-512 BF16 (dpbf16 on bf16 pairs), AVX2 + FMA (the nibbles widened to fp32,
 * products by FMA) and a portable one the compiler vectorises.
 *
 * Packed bytes of tile t, group g, step s (0..7, four K values each): 32 bytes; byte
 * 2 i + e holds q[16 t + i][32 g + 4 s + e] in its low nibble and q[16 t + i][32 g + 4 s +
 * 2 + e] in its high one. Scales of tile t, group g: 16 bf16 scales, then 16 bf16 zeros.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "int4_scales.h"
#include "tiles.h"

/* The entry points' names: int4k_ for the superblock layout (int4k_matmul.c). */
#ifdef INT4_SUPERBLOCKS
#define INT4_MATMUL_KIND int4k_matmul_kind
#define INT4_MATMUL_BF16 int4k_matmul_bf16
#define INT4_MATMUL_AROUND_BF16 int4k_matmul_around_bf16
#else
#define INT4_MATMUL_KIND int4_matmul_kind
#define INT4_MATMUL_BF16 int4_matmul_bf16
#define INT4_MATMUL_AROUND_BF16 int4_matmul_around_bf16
#endif

/* Blocks take two tiles from this many rows on. */
#define PAIRED_ROWS 16


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "int4_one_row.h"

/* `rows` (1..ROW_BLOCK) rows of x against `tiles` (1 or 2) adjacent tiles, both
 * constants in each caller, so the accumulators live in registers; each broadcast pair of
 * x serves both tiles (4-5% faster than a tile at a time at 1 to 2048 rows). Per group,
 * the products (q - 8) x are exact in fp32 and summed by dpbf16; scale and zero are
 * applied once per group. A (row, column)'s operations and their order are the same
 * whatever the block's shape, and the same as one_row_tile's for a lone row. */
static inline __attribute__((always_inline)) void tile_block(
    const uint16_t *x, int64_t x_stride, const float *xf, const float *xsum, int64_t groups,
    const uint8_t *w, int64_t tile_bytes, const uint16_t *sz, int64_t tile_scales,
    uint16_t *y, int64_t y_stride, const int rows, const int tiles) {
    (void)xf;
    __m512 total[ROW_BLOCK][2];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < tiles; j++) total[m][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        for (int j = 0; j < tiles && rows >= PREFETCH_ROWS; j++)
            prefetch_ahead(w + j * tile_bytes, g * (TILE * GROUP / 2), TILE * GROUP / 2,
                           groups * (TILE * GROUP / 2));
        __m512 part[ROW_BLOCK][2];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < tiles; j++) part[m][j] = _mm512_setzero_ps();
        for (int s = 0; s < GROUP / 4; s++) {
            __m512bh lo[2], hi[2];
            for (int j = 0; j < tiles; j++) {
                const uint8_t *wg = w + j * tile_bytes + g * (TILE * GROUP / 2);
                int4_step_bf16(wg + 32 * s, &lo[j], &hi[j]);
            }
            const int64_t k = g * GROUP + 4 * s;
            for (int m = 0; m < rows; m++) {
                int32_t pair0, pair1;
                memcpy(&pair0, x + m * x_stride + k, 4);
                memcpy(&pair1, x + m * x_stride + k + 2, 4);
                const __m512bh x0 = as_bh(_mm512_set1_epi32(pair0));
                const __m512bh x1 = as_bh(_mm512_set1_epi32(pair1));
                for (int j = 0; j < tiles; j++) {
                    part[m][j] = _mm512_dpbf16_ps(part[m][j], x0, lo[j]);
                    part[m][j] = _mm512_dpbf16_ps(part[m][j], x1, hi[j]);
                }
            }
        }
        for (int j = 0; j < tiles; j++) {
            __m512 scale, zero;
            int4_scale_zero16(sz + j * tile_scales, g, &scale, &zero);
            for (int m = 0; m < rows; m++) {
                total[m][j] = _mm512_fmadd_ps(part[m][j], scale, total[m][j]);
                total[m][j] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[m * groups + g]), zero,
                                              total[m][j]);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < tiles; j++)
            _mm256_storeu_si256((__m256i *)(y + m * y_stride + j * TILE),
                                (__m256i)_mm512_cvtneps_pbh(total[m][j]));
}
#define INT4_KERNEL "avx512_bf16"
#define ONE_ROW 1

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The fp32 copy of x the FMA loop broadcasts from (one load per value, where a bf16 value
 * would take a load, a shift and a broadcast). */
#define X_FP32 1

/* Eight columns (`half` of a tile) for `rows` rows (both constants in each caller): per
 * group, each step's 32 bytes widened to fp32 (q - 8) in registers once for all the rows,
 * each row's products summed by FMA in K order; scale and zero applied once per group, as
 * the AVX-512 path does. A (row, column)'s operations and their order are the same
 * whatever the block's shape. */
static inline __attribute__((always_inline)) void half_tile(
    const float *xf, int64_t k, const float *xsum, int64_t groups, const uint8_t *w,
    const uint16_t *sz, uint16_t *y, int64_t y_stride, const int rows, const int half) {
    const __m256i nibble = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    __m256 total[ROW_BLOCK];
    for (int m = 0; m < rows; m++) total[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 part[ROW_BLOCK];
        for (int m = 0; m < rows; m++) part[m] = _mm256_setzero_ps();
        const uint8_t *wg = w + g * (TILE * GROUP / 2);
        for (int s = 0; s < GROUP / 4; s++) {
            /* 32-bit lane i: bytes 2 i and 2 i + 1 of the step, column 8 half + i; its
             * nibbles from the lowest hold K offsets 0, 2, 1, 3. */
            const __m256i words = _mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)(wg + 32 * s + 16 * half)));
            const __m256i q[4] = {
                _mm256_and_si256(words, nibble),
                _mm256_and_si256(_mm256_srli_epi32(words, 8), nibble),
                _mm256_and_si256(_mm256_srli_epi32(words, 4), nibble),
                _mm256_srli_epi32(words, 12),
            };
            for (int e = 0; e < 4; e++) {
                const __m256 wv = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[e], eight));
                const float *xk = xf + g * GROUP + 4 * s + e;
                for (int m = 0; m < rows; m++)
                    part[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + m * k), wv, part[m]);
            }
        }
        __m256 scale, zero;
        int4_scale_zero8(sz, g, half, &scale, &zero);
        for (int m = 0; m < rows; m++) {
            total[m] = _mm256_fmadd_ps(part[m], scale, total[m]);
            total[m] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[m * groups + g]), zero, total[m]);
        }
    }
    for (int m = 0; m < rows; m++) {
        float out[8];
        _mm256_storeu_ps(out, total[m]);
        for (int j = 0; j < 8; j++) y[m * y_stride + 8 * half + j] = to_bf16(out[j]);
    }
}

static inline __attribute__((always_inline)) void tile_block(
    const uint16_t *x, int64_t x_stride, const float *xf, const float *xsum, int64_t groups,
    const uint8_t *w, int64_t tile_bytes, const uint16_t *sz, int64_t tile_scales,
    uint16_t *y, int64_t y_stride, const int rows, const int tiles) {
    (void)x, (void)x_stride;
    const int64_t k = groups * GROUP; /* the length of xf's rows */
    for (int j = 0; j < tiles; j++)
        for (int half = 0; half < 2; half++)
            half_tile(xf, k, xsum, groups, w + j * tile_bytes, sz + j * tile_scales,
                      y + j * TILE, y_stride, rows, half);
}
#define INT4_KERNEL "avx2"

#else
#include "int4_portable.h"
#define INT4_KERNEL "portable"

#endif
#ifndef X_FP32
#define X_FP32 0
#endif

const char *INT4_MATMUL_KIND(void) { return INT4_KERNEL; }

/* Sum of each row's x over each group, for the zeros (w x summed = scale (q - 8) x summed +
 * zero x summed), and the fp32 copy of x where the loop reads one. Returns 2 when out of
 * memory, with nothing to free. */
static int row_sums(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k, float **sums,
                    float **fp32) {
    const int64_t groups = k / GROUP;
    float *xsum = malloc(sizeof(float) * (rows > 0 ? rows : 1) * groups);
    float *xf = X_FP32 ? fp32_rows(x, x_stride, rows, k) : NULL;
    if (xsum == NULL || (X_FP32 && xf == NULL)) {
        free(xsum);
        free(xf);
        return 2;
    }
    for (int64_t m = 0; m < rows; m++)
        for (int64_t g = 0; g < groups; g++) {
            float total = 0.0f;
            for (int64_t j = 0; j < GROUP; j++) total += from_bf16(x[m * x_stride + g * GROUP + j]);
            xsum[m * groups + g] = total;
        }
    *sums = xsum;
    *fp32 = xf;
    return 0;
}

/* int4_matmul_bf16 at fewer than PAIRED_ROWS rows (tile by tile, each thread its share in
 * order), with optional work around it in its parallel region: `before` (worksharing loops
 * without a barrier) first, then each thread's tiles, one barrier, then `after` over the
 * columns [c0, c1) of the calling thread's tiles, still in its cache. Returns 1 for more
 * rows (nothing computed). */
int INT4_MATMUL_AROUND_BF16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                            const uint16_t *sz, uint16_t *y, int64_t rows, int64_t n_out,
                            int64_t k, void (*before)(const void *),
                            void (*after)(const void *, int64_t, int64_t), const void *context) {
    const int64_t groups = k / GROUP, tiles = n_out / TILE;
    if (rows >= PAIRED_ROWS) return 1;
    float *xsum, *xf;
    if (row_sums(x, x_stride, rows, k, &xsum, &xf)) return 2;
    const int64_t tile_bytes = k * TILE / 2, tile_scales = groups * INT4_SCALE_UNITS;
#define SINGLE(n)                                                                          \
    tile_block(x + m0 * x_stride, x_stride, X_FP32 ? xf + m0 * k : NULL, xsum + m0 * groups,   \
               groups, w + t * tile_bytes, tile_bytes, sz + t * tile_scales, tile_scales,      \
               y + m0 * n_out + t * TILE, n_out, n, 1)
#pragma omp parallel
    {
        if (before != NULL) before(context);
        const int64_t id = omp_get_thread_num(), team = omp_get_num_threads();
        const int64_t t0 = tiles * id / team, t1 = tiles * (id + 1) / team;
        for (int64_t t = t0; t < t1; t++) {
#ifdef ONE_ROW
            if (rows == 1) {
                one_row_tile(x, xsum, groups, w + t * tile_bytes, sz + t * tile_scales,
                             y + t * TILE);
                continue;
            }
#endif
            for (int64_t m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
                FOR_ROW_BLOCK(rows - m0, SINGLE)
            }
        }
        if (after != NULL) {
#pragma omp barrier
            after(context, t0 * TILE, t1 * TILE);
        }
    }
#undef SINGLE
    free(xsum);
    free(xf);
    return 0;
}

/* x [rows, x_stride] bf16 (k contiguous); w, sz as above for n_out columns; y [rows,
 * n_out] bf16. n_out % 16 == 0 and k % 32 == 0, checked by the caller. Returns 0, or 2
 * when out of memory. */
int INT4_MATMUL_BF16(const uint16_t *x, int64_t x_stride, const uint8_t *w, const uint16_t *sz,
                     uint16_t *y, int64_t rows, int64_t n_out, int64_t k) {
    if (rows < PAIRED_ROWS)
        return INT4_MATMUL_AROUND_BF16(x, x_stride, w, sz, y, rows, n_out, k, NULL, NULL, NULL);
    const int64_t groups = k / GROUP, tiles = n_out / TILE;
    float *xsum, *xf;
    if (row_sums(x, x_stride, rows, k, &xsum, &xf)) return 2;
    const int64_t tile_bytes = k * TILE / 2, tile_scales = groups * INT4_SCALE_UNITS;
#define BLOCK(n, pair)                                                                     \
    tile_block(x + m0 * x_stride, x_stride, X_FP32 ? xf + m0 * k : NULL, xsum + m0 * groups,   \
               groups, w + t * tile_bytes, tile_bytes, sz + t * tile_scales, tile_scales,      \
               y + m0 * n_out + t * TILE, n_out, n, pair)
#define PAIR(n) BLOCK(n, 2)
#define SINGLE(n) BLOCK(n, 1)
    /* Pairs pay where the products are the cost; a few rows stream the weights from
     * memory, one tile after the next (a step of one row took 2.45 ms of int4 products
     * for the default model tile by tile, 3.40 ms in pairs). */
    FOR_TILE_PAIRS_AND_ROW_BLOCKS(tiles, rows, PAIR, SINGLE)
#undef SINGLE
#undef PAIR
#undef BLOCK
    free(xsum);
    free(xf);
    return 0;
}
