/* Weight-only 6-bit matrix multiply for the CPU: y[M, N] = x[M, K] W[N, K]^T, x bf16, y
 * bf16 (a decoder layer) or fp32 (the logits).
 *
 * W is GGUF's Q6_K held exactly: along K, super-blocks of 256, each of 16 sub-blocks of 16
 * weights w = d c (q - 32), q in 0..63, c an int8 per (column, sub-block), d an fp32 per
 * (column, super-block): 6.625 bits a weight where grouped int8 (int8_matmul.c) takes 9
 * and rounds (model/int6_linear.py says where Q6_K is found). The layout, int5_matmul.c's
 * with two top bits in place of one, is written by int6_pack (int6_grid.c). A row's sums
 * are taken in the same order whatever the number of rows: per sub-block, scaled by d c.
 *
 * Bytes of tile t (16 columns), super-block g, sub-block b (208): steps s = 0..3 of 32
 * bytes, byte 2 i + e holding the low four bits of q[16 t + i][256 g + 16 b + 4 s + e] in
 * its low nibble and of q[..][.. + 4 s + 2 + e] in its high one; then for each pair of
 * steps (2 u, 2 u + 1) 32 bytes, byte 2 i + e holding the top two bits of those four q,
 * in that order (step 2 u's low nibble's in bits 0-1, its high nibble's in 2-3, step 2 u
 * + 1's in 4-5 and 6-7); then c of columns 16 t .. 16 t + 15. Scales of tile t,
 * super-block g: d of its 16 columns, fp32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "tiles.h"

#define SUPER 256
#define SUB 16
#define SUBS (SUPER / SUB)
#define SUB_BYTES 208
#define HIGH_BITS 128  /* where a sub-block's top bits start */
#define SUB_SCALES 192 /* where its c start */
#define SUPER_BYTES (SUBS * SUB_BYTES)

/* Blocks take two tiles from this many rows on (as in int4_matmul.c). */
#define PAIRED_ROWS 16

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "int6_avx512.h"
#define INT6_KERNEL "avx512_bf16"

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The fp32 copy of x the FMA loop broadcasts from. */
#define X_FP32 1

/* Eight columns (`half` of a tile) for `rows` rows, as int5_matmul.c's AVX2 loop: each
 * step's q widened to fp32 in registers once for all the rows, each row's products summed
 * by FMA in K order, d c applied once per sub-block. */
static inline __attribute__((always_inline)) void half_tile(
    const float *xf, int64_t k, int64_t supers, const uint8_t *w, const float *scales,
    void *y, int64_t y_at, int64_t y_stride, const int rows, const int half, const int f32_out) {
    const __m256i nibble = _mm256_set1_epi32(15), two_bits = _mm256_set1_epi32(3);
    const __m256i offset = _mm256_set1_epi32(32);
    __m256 total[ROW_BLOCK];
    for (int m = 0; m < rows; m++) total[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < supers; g++) {
        const __m256 d = _mm256_loadu_ps(scales + g * TILE + 8 * half);
        for (int b = 0; b < SUBS; b++) {
            if (rows >= PREFETCH_ROWS && half == 0)
                prefetch_ahead(w, g * SUPER_BYTES + b * SUB_BYTES, SUB_BYTES,
                               supers * SUPER_BYTES);
            const uint8_t *ws = w + g * SUPER_BYTES + b * SUB_BYTES;
            __m256 part[ROW_BLOCK];
            for (int m = 0; m < rows; m++) part[m] = _mm256_setzero_ps();
            for (int s = 0; s < 4; s++) {
                /* 32-bit lane i: bytes 2 i and 2 i + 1 of the step's half; its nibbles from
                 * the lowest hold K offsets 0, 2, 1, 3, and so do the top bits' pairs from
                 * bit 4 (s & 1) on. */
                const __m256i words = _mm256_cvtepu16_epi32(
                    _mm_loadu_si128((const __m128i *)(ws + 32 * s + 16 * half)));
                const __m256i tops = _mm256_srli_epi32(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(
                        (const __m128i *)(ws + HIGH_BITS + 32 * (s / 2) + 16 * half))),
                    4 * (s & 1));
                const __m256i q[4] = {
                    _mm256_and_si256(words, nibble),
                    _mm256_and_si256(_mm256_srli_epi32(words, 8), nibble),
                    _mm256_and_si256(_mm256_srli_epi32(words, 4), nibble),
                    _mm256_srli_epi32(words, 12),
                };
                const __m256i top[4] = {
                    _mm256_and_si256(tops, two_bits),
                    _mm256_and_si256(_mm256_srli_epi32(tops, 8), two_bits),
                    _mm256_and_si256(_mm256_srli_epi32(tops, 2), two_bits),
                    _mm256_and_si256(_mm256_srli_epi32(tops, 10), two_bits),
                };
                for (int e = 0; e < 4; e++) {
                    const __m256i value = _mm256_or_si256(q[e], _mm256_slli_epi32(top[e], 4));
                    const __m256 wv = _mm256_cvtepi32_ps(_mm256_sub_epi32(value, offset));
                    const float *xk = xf + g * SUPER + b * SUB + 4 * s + e;
                    for (int m = 0; m < rows; m++)
                        part[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + m * k), wv, part[m]);
                }
            }
            const __m256 scale = _mm256_mul_ps(
                d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                       _mm_loadl_epi64((const __m128i *)(ws + SUB_SCALES + 8 * half)))));
            for (int m = 0; m < rows; m++) total[m] = _mm256_fmadd_ps(part[m], scale, total[m]);
        }
    }
    for (int m = 0; m < rows; m++) {
        float out[8];
        _mm256_storeu_ps(out, total[m]);
        for (int j = 0; j < 8; j++) store(y, y_at + m * y_stride + 8 * half + j, out[j], !f32_out);
    }
}

static inline __attribute__((always_inline)) void tile_block(
    const uint16_t *x, int64_t x_stride, const float *xf, int64_t supers, const uint8_t *w,
    int64_t tile_bytes, const float *scales, int64_t tile_scales, void *y, int64_t y_stride,
    const int rows, const int tiles, const int f32_out) {
    (void)x, (void)x_stride;
    const int64_t k = supers * SUPER; /* the length of xf's rows */
    for (int j = 0; j < tiles; j++)
        for (int half = 0; half < 2; half++)
            half_tile(xf, k, supers, w + j * tile_bytes, scales + j * tile_scales, y, j * TILE,
                      y_stride, rows, half, f32_out);
}
#define INT6_KERNEL "avx2"

#else

/* One row's sum over a sub-block against its 16 columns expanded to fp32, scaled by d c:
 * a call of its own per row, so that fast math cannot order a row's sums differently for
 * blocks of a different size. */
static __attribute__((noinline)) void row_sub(const float wq[SUB][TILE], const uint16_t *xs,
                                              const float *scale, float total[TILE]) {
    float part[TILE] = {0};
    for (int k = 0; k < SUB; k++) {
        const float xv = from_bf16(xs[k]);
        for (int i = 0; i < TILE; i++) part[i] += xv * wq[k][i];
    }
    for (int i = 0; i < TILE; i++) total[i] += part[i] * scale[i];
}

static inline void one_tile(const uint16_t *x, int64_t x_stride, int64_t supers,
                            const uint8_t *w, const float *scales, void *y, int64_t y_at,
                            int64_t y_stride, const int rows, const int f32_out) {
    float total[ROW_BLOCK][TILE] = {{0}};
    for (int64_t g = 0; g < supers; g++)
        for (int b = 0; b < SUBS; b++) {
            const uint8_t *ws = w + g * SUPER_BYTES + b * SUB_BYTES;
            float wq[SUB][TILE], scale[TILE];
            for (int s = 0; s < 4; s++)
                for (int i = 0; i < TILE; i++)
                    for (int e = 0; e < 2; e++) {
                        const int j = 2 * i + e;
                        const uint8_t byte = ws[32 * s + j];
                        const uint8_t top = ws[HIGH_BITS + 32 * (s / 2) + j] >> (4 * (s & 1));
                        const int low = (byte & 15) | (top & 3) << 4;
                        const int high = (byte >> 4) | ((top >> 2) & 3) << 4;
                        wq[4 * s + e][i] = (float)(low - 32);
                        wq[4 * s + 2 + e][i] = (float)(high - 32);
                    }
            for (int i = 0; i < TILE; i++)
                scale[i] = scales[g * TILE + i] * (float)(int8_t)ws[SUB_SCALES + i];
            for (int m = 0; m < rows; m++)
                row_sub(wq, x + m * x_stride + g * SUPER + b * SUB, scale, total[m]);
        }
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < TILE; i++) store(y, y_at + m * y_stride + i, total[m][i], !f32_out);
}

static inline void tile_block(const uint16_t *x, int64_t x_stride, const float *xf,
                              int64_t supers, const uint8_t *w, int64_t tile_bytes,
                              const float *scales, int64_t tile_scales, void *y,
                              int64_t y_stride, const int rows, const int tiles,
                              const int f32_out) {
    (void)xf;
    for (int j = 0; j < tiles; j++)
        one_tile(x, x_stride, supers, w + j * tile_bytes, scales + j * tile_scales, y, j * TILE,
                 y_stride, rows, f32_out);
}
#define INT6_KERNEL "portable"

#endif
#ifndef X_FP32
#define X_FP32 0
#endif
#ifndef PAIRED_LOGITS_ROWS
#define PAIRED_LOGITS_ROWS PAIRED_ROWS
#endif

const char *int6_matmul_kind(void) { return INT6_KERNEL; }
const char *int6_logits_kind(void) { return INT6_KERNEL; }

/* x [rows, x_stride] bf16 (k contiguous); w, scales as above for n_out columns; y [rows,
 * n_out], bf16 or (f32_out) fp32. n_out % 16 == 0 and k % 256 == 0, checked by the
 * caller. Returns 0, or 2 when out of memory (the AVX2 loop's fp32 copy of x). */
static int int6_matmul(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                       const float *scales, void *y, int64_t rows, int64_t n_out, int64_t k,
                       const int f32_out) {
    const int64_t supers = k / SUPER, tiles = n_out / TILE;
#ifdef UNPACKED_ROWS
    if (rows >= UNPACKED_ROWS)
        return unpacked_matmul(x, x_stride, w, scales, y, rows, n_out, supers, f32_out);
#endif
    float *xf = X_FP32 ? fp32_rows(x, x_stride, rows, k) : NULL;
    if (X_FP32 && xf == NULL) return 2;
    const int64_t tile_bytes = supers * SUPER_BYTES, tile_scales = supers * TILE;
    const int64_t width = f32_out ? 4 : 2;
#define BLOCK(n, pair)                                                                     \
    tile_block(x + m0 * x_stride, x_stride, X_FP32 ? xf + m0 * k : NULL, supers,            \
               w + t * tile_bytes, tile_bytes, scales + t * tile_scales, tile_scales,       \
               (char *)y + (m0 * n_out + t * TILE) * width, n_out, n, pair, f32_out)
#define PAIR(n) BLOCK(n, 2)
#define SINGLE(n) BLOCK(n, 1)
    if (rows >= (f32_out ? PAIRED_LOGITS_ROWS : PAIRED_ROWS)) {
        FOR_TILE_PAIRS_AND_ROW_BLOCKS(tiles, rows, PAIR, SINGLE)
    } else {
        FOR_TILES_AND_ROW_BLOCKS(tiles, rows, SINGLE)
    }
    free(xf);
    return 0;
}

int int6_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, const float *scales,
                     uint16_t *y, int64_t rows, int64_t n_out, int64_t k) {
    return int6_matmul(x, x_stride, w, scales, y, rows, n_out, k, 0);
}

int int6_logits_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, const float *scales,
                     float *y, int64_t rows, int64_t n_out, int64_t k) {
    return int6_matmul(x, x_stride, w, scales, y, rows, n_out, k, 1);
}
