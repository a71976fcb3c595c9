/* int5_matmul.c's loop with AVX-512 BF16: each step's nibbles and fifth bits looked up as
 * bf16 q - 16 (vpermw), products summed by dpbf16, the scale applied once per group. From
 * UNPACKED_ROWS rows on each pair of tiles is unpacked once, into a buffer, for all the
 * blocks of rows. Included by int5_matmul.c alone (its GROUP_BYTES and HIGH_BITS), where
 * the compiler targets AVX-512 BF16. */
#ifndef LLAMASERVE_INT5_AVX512_H
#define LLAMASERVE_INT5_AVX512_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "tiles.h"

/* Blocks take two tiles from 8 rows on here: at 8 and 12 rows 3-8% faster than a tile at a
 * time on Qwen2.5-Coder-0.5B's shapes (int6 gained nothing at 8, int4 pairs from 16). */
#define PAIRED_ROWS 8


static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

/* bf16 of q - 16 for the low four bits of q, without the fifth bit (q - 16 = -16..-1)
 * and with it (0..15), each twice: vpermw reads five index bits, and the fifth is the
 * high nibble's lowest, ignored. Lanes whose fifth bit is set take the second table. */
static const uint16_t without_values[32] = {
    0xC180, 0xC170, 0xC160, 0xC150, 0xC140, 0xC130, 0xC120, 0xC110,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
    0xC180, 0xC170, 0xC160, 0xC150, 0xC140, 0xC130, 0xC120, 0xC110,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80};
static const uint16_t with_values[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* Step s (four K values of each of the 16 columns) of a tile's group, as two vectors of
 * bf16 q - 16: K offsets 0, 1 (lo) and 2, 3 (hi) of each column, pairs in column order. */
static inline __attribute__((always_inline)) void unpack_step(const uint8_t *wg, int s,
                                                              __m512i without, __m512i with,
                                                              __m512bh *lo, __m512bh *hi) {
    const __m512i bytes =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wg + 32 * s)));
    uint32_t fifth[2];
    memcpy(fifth, wg + HIGH_BITS + 8 * s, 8);
    const __m512i high = _mm512_srli_epi16(bytes, 4);
    *lo = as_bh(_mm512_mask_permutexvar_epi16(_mm512_permutexvar_epi16(bytes, without),
                                              (__mmask32)fifth[0], bytes, with));
    *hi = as_bh(_mm512_mask_permutexvar_epi16(_mm512_permutexvar_epi16(high, without),
                                              (__mmask32)fifth[1], high, with));
}

/* `tiles` adjacent tiles unpacked whole into `out` as tile_block reads them: per group and
 * step, lo and hi of the first tile, then of the second. */
static void unpack_tiles(const uint8_t *w, int64_t tile_bytes, int64_t groups, int tiles,
                         __m512bh *out) {
    const __m512i without = _mm512_loadu_si512(without_values);
    const __m512i with = _mm512_loadu_si512(with_values);
    for (int64_t g = 0; g < groups; g++)
        for (int s = 0; s < GROUP / 4; s++)
            for (int j = 0; j < tiles; j++) {
                __m512bh *at = out + (g * (GROUP / 4) + s) * 4 + 2 * j;
                unpack_step(w + j * tile_bytes + g * GROUP_BYTES, s, without, with, at, at + 1);
            }
}

/* `rows` rows against `tiles` tiles, their weights unpacked here, step by step, or read
 * from `unpacked` (unpack_tiles' output; NULL: unpack). Both give the same products in the
 * same order. */
static inline __attribute__((always_inline)) void tile_block_from(
    const uint16_t *x, int64_t x_stride, int64_t groups, const uint8_t *w, int64_t tile_bytes,
    const uint16_t *scales, int64_t tile_scales, uint16_t *y, int64_t y_stride, const int rows,
    const int tiles, const __m512bh *unpacked) {
    const __m512i without = _mm512_loadu_si512(without_values);
    const __m512i with = _mm512_loadu_si512(with_values);
    __m512 total[ROW_BLOCK][2];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < tiles; j++) total[m][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 part[ROW_BLOCK][2];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < tiles; j++) part[m][j] = _mm512_setzero_ps();
        for (int s = 0; s < GROUP / 4; s++) {
            __m512bh lo[2], hi[2];
            for (int j = 0; j < tiles; j++) {
                if (unpacked != NULL) {
                    lo[j] = unpacked[(g * (GROUP / 4) + s) * 4 + 2 * j];
                    hi[j] = unpacked[(g * (GROUP / 4) + s) * 4 + 2 * j + 1];
                } else {
                    unpack_step(w + j * tile_bytes + g * GROUP_BYTES, s, without, with, &lo[j],
                                &hi[j]);
                }
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
            const __m512 scale = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(scales + j * tile_scales + g * TILE)));
            for (int m = 0; m < rows; m++)
                total[m][j] = _mm512_fmadd_ps(part[m][j], scale, total[m][j]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < tiles; j++)
            _mm256_storeu_si256((__m256i *)(y + m * y_stride + j * TILE),
                                (__m256i)_mm512_cvtneps_pbh(total[m][j]));
}

static inline __attribute__((always_inline)) void tile_block(
    const uint16_t *x, int64_t x_stride, const float *xf, int64_t groups, const uint8_t *w,
    int64_t tile_bytes, const uint16_t *scales, int64_t tile_scales, uint16_t *y,
    int64_t y_stride, const int rows, const int tiles) {
    (void)xf;
    tile_block_from(x, x_stride, groups, w, tile_bytes, scales, tile_scales, y, y_stride, rows,
                    tiles, NULL);
}

/* From this many rows on, each pair of tiles is unpacked once, into a buffer of its own
 * thread, for all the blocks of rows, instead of once per block of 8 rows: unpacking took
 * a quarter of the instructions at 8 rows a block. */
#define UNPACKED_ROWS 32

/* The matmul from UNPACKED_ROWS rows on. Returns 0, or 2 when out of memory. */
static int unpacked_matmul(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                           const uint16_t *scales, uint16_t *y, int64_t rows, int64_t n_out,
                           int64_t groups) {
    const int64_t tiles = n_out / TILE, tile_bytes = groups * GROUP_BYTES;
    const int64_t tile_scales = groups * TILE;
    int status = 0;
#define UNPACK unpack_tiles(w + t * tile_bytes, tile_bytes, groups, n, buffer)
#define BLOCK(r, n)                                                                        \
    tile_block_from(x + m0 * x_stride, x_stride, groups, w + t * tile_bytes, tile_bytes,   \
                    scales + t * tile_scales, tile_scales, y + m0 * n_out + t * TILE, n_out, \
                    r, n, buffer)
#define PAIR(r) BLOCK(r, 2)
#define SINGLE(r) BLOCK(r, 1)
    FOR_UNPACKED_TILE_PAIRS(tiles, rows, sizeof(__m512bh) * groups * (GROUP / 4) * 4, status,
                            UNPACK, PAIR, SINGLE);
#undef SINGLE
#undef PAIR
#undef BLOCK
#undef UNPACK
    return status;
}

#endif
