/* Weight-only int8 matrix multiply for the CPU, for the output projection: y[M, N] =
 * x[M, K] W[N, K]^T with x bf16 and y fp32 (the logits).
 *
 * W is symmetric int8 in groups of 32 along K, one fp16 scale per (output column, group):
 * GGUF's Q8_0, the type of most GGUF files' embedding and output weights, held exactly.
 * The layout (written by NativeInt8Matmul.pack in model/native/ops.py) is tiled like
 * int4_matmul.c's: tiles of 16 output columns with their whole K contiguous, each tile's
 * weights converted to bf16 (exact for |q| <= 127) once per block of 8 rows, summed by
 * dpbf16 with AVX-512 BF16; with AVX2 + FMA converted to fp32 and summed by FMA; elsewhere
 * by a portable loop. A row's sums are taken in the same order whatever the number of rows.
 *
 * Bytes of tile t, group g, step p (0..15, two K values each): 32 bytes; byte 2 i + e is
 * q[16 t + i][32 g + 2 p + e]. Scales of tile t, group g: 16 fp16.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "tiles.h"


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

/* 32 int8 as 32 bf16, in order. */
static inline __m512bh int8_to_bf16(const uint8_t *p) {
    __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 high =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    return _mm512_cvtne2ps_pbh(high, low);
}

/* `tiles` adjacent tiles (tile_bytes apart) whole as bf16, as tile_block_from reads them:
 * per group and pair of K values, the first tile's, then the second's. */
static void unpack_tiles(const uint8_t *w, int64_t tile_bytes, int64_t groups, int tiles,
                         __m512bh *out) {
    for (int64_t i = 0; i < groups * (GROUP / 2); i++)
        for (int j = 0; j < tiles; j++) out[2 * i + j] = int8_to_bf16(w + j * tile_bytes + 32 * i);
}

/* `rows` rows against `tiles` (1 or 2) adjacent tiles, `tile_bytes` apart, each broadcast
 * pair of x serving both; the weights converted here, pair by pair, or read from
 * `unpacked` (unpack_tiles' output; NULL: convert). A (row, column)'s products
 * and their order are the same whatever the block's shape, and either way. */
static inline __attribute__((always_inline)) void tile_block_from(
    const uint16_t *x, int64_t x_stride, int64_t groups, const uint8_t *w, int64_t tile_bytes,
    const uint16_t *scales, int64_t tile_scales, float *y, int64_t y_stride, const int rows,
    const int tiles, const __m512bh *unpacked) {
    __m512 total[ROW_BLOCK][2];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < tiles; j++) total[m][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (unpacked == NULL && rows >= PREFETCH_ROWS)
            for (int j = 0; j < tiles; j++)
                prefetch_ahead(w + j * tile_bytes, g * TILE * GROUP, TILE * GROUP,
                               groups * TILE * GROUP);
        __m512 part[ROW_BLOCK][2];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < tiles; j++) part[m][j] = _mm512_setzero_ps();
        for (int p = 0; p < GROUP / 2; p++) {
            __m512bh wp[2];
            for (int j = 0; j < tiles; j++)
                wp[j] = unpacked != NULL
                            ? unpacked[2 * (g * (GROUP / 2) + p) + j]
                            : int8_to_bf16(w + j * tile_bytes + g * TILE * GROUP + 32 * p);
            const int64_t k = g * GROUP + 2 * p;
            for (int m = 0; m < rows; m++) {
                int32_t pair;
                memcpy(&pair, x + m * x_stride + k, 4);
                const __m512bh xp = as_bh(_mm512_set1_epi32(pair));
                for (int j = 0; j < tiles; j++)
                    part[m][j] = _mm512_dpbf16_ps(part[m][j], xp, wp[j]);
            }
        }
        for (int j = 0; j < tiles; j++) {
            const __m512 scale = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(scales + j * tile_scales + g * TILE)));
            for (int m = 0; m < rows; m++)
                total[m][j] = _mm512_fmadd_ps(part[m][j], scale, total[m][j]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < tiles; j++)
            _mm512_storeu_ps(y + m * y_stride + j * TILE, total[m][j]);
}

static inline __attribute__((always_inline)) void tile_block(
    const uint16_t *x, int64_t x_stride, const float *xf, int64_t groups, const uint8_t *w,
    const uint16_t *scales, float *y, int64_t y_stride, const int rows) {
    (void)xf;
    tile_block_from(x, x_stride, groups, w, 0, scales, 0, y, y_stride, rows, 1, NULL);
}

/* Blocks take two tiles from this many rows on: an output projection of 8 rows took 7.7-8.3
 * ms in pairs against 10.3-11.2 a tile at a time (151,936 x 896, 2 threads); below 6 rows,
 * where the weights stream from memory, pairs were slower. */
#define PAIRED_ROWS 8

/* From this many rows on, each pair of tiles is converted to bf16 once, into a buffer of
 * its thread, for all the blocks of rows, instead of once per block of 8 rows (at 32 rows
 * it was no faster). */
#define UNPACKED_ROWS 64

/* The matmul from UNPACKED_ROWS rows on. Returns 0, or 2 when out of memory. */
static int unpacked_matmul(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                           const uint16_t *scales, float *y, int64_t rows, int64_t n_out,
                           int64_t groups) {
    const int64_t tiles = n_out / TILE, tile_bytes = groups * GROUP * TILE;
    const int64_t tile_scales = groups * TILE;
    int status = 0;
#define UNPACK unpack_tiles(w + t * tile_bytes, tile_bytes, groups, n, buffer)
#define BLOCK(r, n)                                                                        \
    tile_block_from(x + m0 * x_stride, x_stride, groups, w + t * tile_bytes, tile_bytes,   \
                    scales + t * tile_scales, tile_scales, y + m0 * n_out + t * TILE, n_out, \
                    r, n, buffer)
#define PAIR(r) BLOCK(r, 2)
#define SINGLE(r) BLOCK(r, 1)
    FOR_UNPACKED_TILE_PAIRS(tiles, rows, sizeof(__m512bh) * groups * GROUP, status, UNPACK,
                            PAIR, SINGLE);
#undef SINGLE
#undef PAIR
#undef BLOCK
#undef UNPACK
    return status;
}
#define INT8_KERNEL "avx512_bf16"

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* The fp32 copy of x the FMA loop broadcasts from. */
#define X_FP32 1

/* Eight columns (`half` of a tile) for `rows` rows (constants in each caller): each
 * step's 16 bytes widened to fp32 in registers once for all the rows, each row's products
 * summed by FMA in K order, the scale applied once per group. A (row, column)'s operations
 * and their order are the same whatever the block's shape. */
static inline __attribute__((always_inline)) void half_tile(
    const float *xf, int64_t k, int64_t groups, const uint8_t *w, const uint16_t *scales,
    float *y, int64_t y_stride, const int rows, const int half) {
    __m256 total[ROW_BLOCK];
    for (int m = 0; m < rows; m++) total[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (rows >= PREFETCH_ROWS && half == 0)
            prefetch_ahead(w, g * TILE * GROUP, TILE * GROUP, groups * TILE * GROUP);
        __m256 part[ROW_BLOCK];
        for (int m = 0; m < rows; m++) part[m] = _mm256_setzero_ps();
        const uint8_t *wg = w + g * TILE * GROUP;
        for (int p = 0; p < GROUP / 2; p++) {
            /* 32-bit lane i: bytes 2 i (K offset 0) and 2 i + 1 (K offset 1) of column
             * 8 half + i, each sign-extended by shifting it to the top and back. */
            const __m256i words = _mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)(wg + 32 * p + 16 * half)));
            const __m256 wv[2] = {
                _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 24), 24)),
                _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 16), 24)),
            };
            for (int e = 0; e < 2; e++) {
                const float *xk = xf + g * GROUP + 2 * p + e;
                for (int m = 0; m < rows; m++)
                    part[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + m * k), wv[e], part[m]);
            }
        }
        const __m256 scale =
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g * TILE + 8 * half)));
        for (int m = 0; m < rows; m++) total[m] = _mm256_fmadd_ps(part[m], scale, total[m]);
    }
    for (int m = 0; m < rows; m++) _mm256_storeu_ps(y + m * y_stride + 8 * half, total[m]);
}

static inline __attribute__((always_inline)) void tile_block(
    const uint16_t *x, int64_t x_stride, const float *xf, int64_t groups, const uint8_t *w,
    const uint16_t *scales, float *y, int64_t y_stride, const int rows) {
    (void)x, (void)x_stride;
    for (int half = 0; half < 2; half++)
        half_tile(xf, groups * GROUP, groups, w, scales, y, y_stride, rows, half);
}
#define INT8_KERNEL "avx2"

#else

/* Portable version: each group of the tile widened to fp32 once per block of rows, each
 * row summed by portable_group.h's row_group. */
#include "portable_group.h"

static inline void tile_block(const uint16_t *x, int64_t x_stride, const float *xf,
                              int64_t groups, const uint8_t *w, const uint16_t *scales, float *y,
                              int64_t y_stride, const int rows) {
    (void)xf;
    float total[ROW_BLOCK][TILE] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        float wq[GROUP][TILE];
        const int8_t *wg = (const int8_t *)w + g * TILE * GROUP;
        for (int p = 0; p < GROUP / 2; p++)
            for (int i = 0; i < TILE; i++)
                for (int e = 0; e < 2; e++) wq[2 * p + e][i] = (float)wg[32 * p + 2 * i + e];
        for (int m = 0; m < rows; m++)
            row_group(wq, x + m * x_stride + g * GROUP, scales + g * TILE, total[m]);
    }
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < TILE; i++) y[m * y_stride + i] = total[m][i];
}
#define INT8_KERNEL "portable"

#endif
#ifndef X_FP32
#define X_FP32 0
#endif

const char *int8_matmul_kind(void) { return INT8_KERNEL; }

/* x [rows, x_stride] bf16; w, scales as above for n_out columns; y [rows, n_out] fp32.
 * n_out % 16 == 0 and k % 32 == 0, checked by the caller. Returns 0, or 2 when out of
 * memory (the AVX2 loop's fp32 copy of x). */
int int8_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                      const uint16_t *scales, float *y, int64_t rows, int64_t n_out, int64_t k) {
    const int64_t groups = k / GROUP, tiles = n_out / TILE;
#ifdef UNPACKED_ROWS
    if (rows >= UNPACKED_ROWS) return unpacked_matmul(x, x_stride, w, scales, y, rows, n_out, groups);
#endif
    float *xf = X_FP32 ? fp32_rows(x, x_stride, rows, k) : NULL;
    if (X_FP32 && xf == NULL) return 2;
#define BLOCK(n)                                                                           \
    tile_block(x + m0 * x_stride, x_stride, X_FP32 ? xf + m0 * k : NULL, groups,            \
               w + t * k * TILE, scales + t * groups * TILE, y + m0 * n_out + t * TILE, n_out, n)
#ifdef PAIRED_ROWS
#define PAIR(n)                                                                            \
    tile_block_from(x + m0 * x_stride, x_stride, groups, w + t * k * TILE, k * TILE,        \
                    scales + t * groups * TILE, groups * TILE, y + m0 * n_out + t * TILE,   \
                    n_out, n, 2, NULL)
    if (rows >= PAIRED_ROWS) {
        FOR_TILE_PAIRS_AND_ROW_BLOCKS(tiles, rows, PAIR, BLOCK)
        free(xf);
        return 0;
    }
#undef PAIR
#endif
    FOR_TILES_AND_ROW_BLOCKS(tiles, rows, BLOCK)
#undef BLOCK
    free(xf);
    return 0;
}
