/* Weight-only 5-bit matrix multiply for the CPU: y[M, N] = x[M, K] W[N, K]^T, x and y bf16.
 *
 * W is symmetric in groups of 32 along K: w = (q - 16) * scale, q in 0..31, one fp16 scale
 * per (output column, group): GGUF's Q5_0 held exactly, in 5.5 bits a weight where grouped
 * int8 (int8_matmul.c) takes 8.5. Small models' Q4_K_M files store most layers in Q5_0 (the
 * K-quants need rows of 256). The layout (written by NativeInt5Matmul.pack in
 * model/native/ops.py) is int4_matmul.c's, tile by tile, with each group's fifth bits
 * after its nibbles; the loops are int4_matmul.c's too, the fifth bit joining the nibble
 * before the lookup. A row's sums are taken in the same order whatever the number of rows.
 *
 * Bytes of tile t, group g (320): steps s = 0..7 of 32 bytes, byte 2 i + e holding the low
 * four bits of q[16 t + i][32 g + 4 s + e] in its low nibble and of q[16 t + i][32 g + 4 s
 * + 2 + e] in its high one; then per step two little-endian 32-bit words whose bit 2 i + e
 * is the fifth bit of the low nibble's q, then of the high nibble's. Scales of tile t,
 * group g: 16 fp16.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "tiles.h"

#define GROUP_BYTES 320
#define HIGH_BITS 256 /* where a group's fifth bits start */



#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "int5_avx512.h"
#define INT5_KERNEL "avx512_bf16"

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* The fp32 copy of x the FMA loop broadcasts from. */
#define X_FP32 1

/* Eight columns (`half` of a tile) for `rows` rows, as int4_matmul.c's AVX2 loop: each
 * step's q widened to fp32 in registers once for all the rows, each row's products summed
 * by FMA in K order, the scale applied once per group. */
static inline __attribute__((always_inline)) void half_tile(
    const float *xf, int64_t k, int64_t groups, const uint8_t *w, const uint16_t *scales,
    uint16_t *y, int64_t y_stride, const int rows, const int half) {
    const __m256i nibble = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
    const __m256i sixteen = _mm256_set1_epi32(16);
    /* Lane i is column 8 half + i, whose fifth bits sit at 2 (8 half + i) + e. */
    const __m256i shift = _mm256_add_epi32(_mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14),
                                           _mm256_set1_epi32(16 * half));
    const __m256i shift1 = _mm256_add_epi32(shift, one);
    __m256 total[ROW_BLOCK];
    for (int m = 0; m < rows; m++) total[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 part[ROW_BLOCK];
        for (int m = 0; m < rows; m++) part[m] = _mm256_setzero_ps();
        const uint8_t *wg = w + g * GROUP_BYTES;
        for (int s = 0; s < GROUP / 4; s++) {
            /* 32-bit lane i: bytes 2 i and 2 i + 1 of the step's half; its nibbles from
             * the lowest hold K offsets 0, 2, 1, 3. */
            const __m256i words = _mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)(wg + 32 * s + 16 * half)));
            int32_t fifth[2];
            memcpy(fifth, wg + HIGH_BITS + 8 * s, 8);
            const __m256i low_bits = _mm256_set1_epi32(fifth[0]);
            const __m256i high_bits = _mm256_set1_epi32(fifth[1]);
            const __m256i bit[4] = {
                _mm256_and_si256(_mm256_srlv_epi32(low_bits, shift), one),
                _mm256_and_si256(_mm256_srlv_epi32(low_bits, shift1), one),
                _mm256_and_si256(_mm256_srlv_epi32(high_bits, shift), one),
                _mm256_and_si256(_mm256_srlv_epi32(high_bits, shift1), one),
            };
            const __m256i q[4] = {
                _mm256_and_si256(words, nibble),
                _mm256_and_si256(_mm256_srli_epi32(words, 8), nibble),
                _mm256_and_si256(_mm256_srli_epi32(words, 4), nibble),
                _mm256_srli_epi32(words, 12),
            };
            for (int e = 0; e < 4; e++) {
                const __m256i value = _mm256_or_si256(q[e], _mm256_slli_epi32(bit[e], 4));
                const __m256 wv = _mm256_cvtepi32_ps(_mm256_sub_epi32(value, sixteen));
                const float *xk = xf + g * GROUP + 4 * s + e;
                for (int m = 0; m < rows; m++)
                    part[m] = _mm256_fmadd_ps(_mm256_broadcast_ss(xk + m * k), wv, part[m]);
            }
        }
        const __m256 scale =
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g * TILE + 8 * half)));
        for (int m = 0; m < rows; m++) total[m] = _mm256_fmadd_ps(part[m], scale, total[m]);
    }
    for (int m = 0; m < rows; m++) {
        float out[8];
        _mm256_storeu_ps(out, total[m]);
        for (int j = 0; j < 8; j++) y[m * y_stride + 8 * half + j] = to_bf16(out[j]);
    }
}

static inline __attribute__((always_inline)) void tile_block(
    const uint16_t *x, int64_t x_stride, const float *xf, int64_t groups, const uint8_t *w,
    int64_t tile_bytes, const uint16_t *scales, int64_t tile_scales, uint16_t *y,
    int64_t y_stride, const int rows, const int tiles) {
    (void)x, (void)x_stride;
    const int64_t k = groups * GROUP; /* the length of xf's rows */
    for (int j = 0; j < tiles; j++)
        for (int half = 0; half < 2; half++)
            half_tile(xf, k, groups, w + j * tile_bytes, scales + j * tile_scales,
                      y + j * TILE, y_stride, rows, half);
}
#define INT5_KERNEL "avx2"

#else

/* Portable version: each group of the tile is expanded to fp32 once per block of rows,
 * each row summed by portable_group.h's row_group. */
#include "portable_group.h"

static inline void one_tile(const uint16_t *x, int64_t x_stride, int64_t groups,
                            const uint8_t *w, const uint16_t *scales, uint16_t *y,
                            int64_t y_stride, const int rows) {
    float total[ROW_BLOCK][TILE] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        float wq[GROUP][TILE];
        const uint8_t *wg = w + g * GROUP_BYTES;
        for (int s = 0; s < GROUP / 4; s++) {
            uint32_t fifth[2];
            memcpy(fifth, wg + HIGH_BITS + 8 * s, 8);
            for (int i = 0; i < TILE; i++)
                for (int e = 0; e < 2; e++) {
                    const int j = 2 * i + e;
                    const uint8_t byte = wg[32 * s + j];
                    const int low = (byte & 15) | (int)((fifth[0] >> j) & 1) << 4;
                    const int high = (byte >> 4) | (int)((fifth[1] >> j) & 1) << 4;
                    wq[4 * s + e][i] = (float)(low - 16);
                    wq[4 * s + 2 + e][i] = (float)(high - 16);
                }
        }
        for (int m = 0; m < rows; m++)
            row_group(wq, x + m * x_stride + g * GROUP, scales + g * TILE, total[m]);
    }
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < TILE; i++) y[m * y_stride + i] = to_bf16(total[m][i]);
}

static inline void tile_block(const uint16_t *x, int64_t x_stride, const float *xf,
                              int64_t groups, const uint8_t *w, int64_t tile_bytes,
                              const uint16_t *scales, int64_t tile_scales, uint16_t *y,
                              int64_t y_stride, const int rows, const int tiles) {
    (void)xf;
    for (int j = 0; j < tiles; j++)
        one_tile(x, x_stride, groups, w + j * tile_bytes, scales + j * tile_scales,
                 y + j * TILE, y_stride, rows);
}
#define INT5_KERNEL "portable"

#endif
#ifndef X_FP32
#define X_FP32 0
#endif
/* Blocks take two tiles from this many rows on (as in int4_matmul.c). */
#ifndef PAIRED_ROWS
#define PAIRED_ROWS 16
#endif

const char *int5_matmul_kind(void) { return INT5_KERNEL; }

/* x [rows, x_stride] bf16 (k contiguous); w, scales as above for n_out columns; y [rows,
 * n_out] bf16. n_out % 16 == 0 and k % 32 == 0, checked by the caller. Returns 0, or 2
 * when out of memory (the AVX2 loop's fp32 copy of x). */
int int5_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                     const uint16_t *scales, uint16_t *y, int64_t rows, int64_t n_out, int64_t k) {
    const int64_t groups = k / GROUP, tiles = n_out / TILE;
#ifdef UNPACKED_ROWS
    if (rows >= UNPACKED_ROWS) return unpacked_matmul(x, x_stride, w, scales, y, rows, n_out, groups);
#endif
    float *xf = X_FP32 ? fp32_rows(x, x_stride, rows, k) : NULL;
    if (X_FP32 && xf == NULL) return 2;
    const int64_t tile_bytes = groups * GROUP_BYTES, tile_scales = groups * TILE;
#define BLOCK(n, pair)                                                                     \
    tile_block(x + m0 * x_stride, x_stride, X_FP32 ? xf + m0 * k : NULL, groups,            \
               w + t * tile_bytes, tile_bytes, scales + t * tile_scales, tile_scales,       \
               y + m0 * n_out + t * TILE, n_out, n, pair)
#define PAIR(n) BLOCK(n, 2)
#define SINGLE(n) BLOCK(n, 1)
    if (rows >= PAIRED_ROWS) {
        FOR_TILE_PAIRS_AND_ROW_BLOCKS(tiles, rows, PAIR, SINGLE)
    } else {
        FOR_TILES_AND_ROW_BLOCKS(tiles, rows, SINGLE)
    }
#undef SINGLE
#undef PAIR
#undef BLOCK
    free(xf);
    return 0;
}

/* The layout above from q [n_out, k] (0..31, a row per output column) and scales [n_out,
 * k / 32] fp16: w receives k n_out 5 / 8 bytes, tiled_scales n_out k / 32 fp16. In C: the
 * same reordering by tensor ops took a second per 100M weights. */
void int5_pack(const uint8_t *q, const uint16_t *scales, int64_t n_out, int64_t k, uint8_t *w,
               uint16_t *tiled_scales) {
    const int64_t groups = k / GROUP, tiles = n_out / TILE;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *out = w + (t * groups + g) * GROUP_BYTES;
            memset(out + HIGH_BITS, 0, GROUP_BYTES - HIGH_BITS);
            for (int s = 0; s < GROUP / 4; s++)
                for (int i = 0; i < TILE; i++)
                    for (int e = 0; e < 2; e++) {
                        const uint8_t *row = q + (t * TILE + i) * k + g * GROUP + 4 * s;
                        const uint8_t low = row[e], high = row[2 + e];
                        const int j = 2 * i + e;
                        out[32 * s + j] = (uint8_t)((low & 15) | (high & 15) << 4);
                        out[HIGH_BITS + 8 * s + j / 8] |= (uint8_t)(((low >> 4) & 1) << (j % 8));
                        out[HIGH_BITS + 8 * s + 4 + j / 8] |= (uint8_t)(((high >> 4) & 1) << (j % 8));
                    }
            for (int i = 0; i < TILE; i++)
                tiled_scales[(t * groups + g) * TILE + i] = scales[(t * TILE + i) * groups + g];
        }
}
