/* The AVX-512 BF16 int4 loop's nibble decoding, and its loop for a lone row (int4_matmul.c).
 *
 * A group's 16 dpbf16 form one chain, each waiting for the last. With several rows each
 * row's chain runs beside the others'; with one row nothing does, and the loop waited on
 * the chain (one thread, one row: 20 GB/s with the tile in L2, about what it streams from
 * memory). one_row_tile sums ONE_ROW_GROUPS groups at once, each exactly as tile_block sums
 * it for any row, and adds them to the total in group order: the same operations in the
 * same order, so a row's result is the same bits alone or in a batch. */
#ifndef LLAMASERVE_INT4_ONE_ROW_H
#define LLAMASERVE_INT4_ONE_ROW_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "int4_scales.h"
#include "tiles.h"

/* One row, one thread, the tile in L2 or L3: two groups at once gained 5-8%, four 15-25%,
 * six or eight no more than four. */
#define ONE_ROW_GROUPS 4

static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

/* One step's 32 bytes (see int4_matmul.c) as bf16 q - 8: low nibbles, high nibbles. The
 * table holds q - 8 for q = 0..15 twice: vpermw reads five index bits, and the fifth is
 * the high nibble's lowest one, so both halves must agree. (bf16 0x4300 | q = 128 + q by
 * an AND-OR instead, the 136 taken off with the zero, was faster on one row but 2-8%
 * slower on 2 to 32, and a row's sums must be the same in both loops.) */
static inline void int4_step_bf16(const uint8_t *step, __m512bh *lo, __m512bh *hi) {
    static const uint16_t table_values[32] = {
        0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
        0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
        0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
    const __m512i table = _mm512_loadu_si512(table_values);
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)step));
    *lo = as_bh(_mm512_permutexvar_epi16(bytes, table));
    *hi = as_bh(_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table));
}

/* `count` (a constant) groups from g of one tile into `total`, their chains interleaved. */
static inline __attribute__((always_inline)) __m512 one_row_groups(
    const uint16_t *x, const float *xsum, int64_t g, int64_t groups, const uint8_t *w,
    const uint16_t *sz, __m512 total, const int count) {
    prefetch_ahead(w, g * (TILE * GROUP / 2), count * (TILE * GROUP / 2),
                   groups * (TILE * GROUP / 2));
    __m512 part[ONE_ROW_GROUPS];
    for (int a = 0; a < count; a++) part[a] = _mm512_setzero_ps();
    for (int s = 0; s < GROUP / 4; s++)
        for (int a = 0; a < count; a++) {
            __m512bh lo, hi;
            int4_step_bf16(w + (g + a) * (TILE * GROUP / 2) + 32 * s, &lo, &hi);
            int32_t pair0, pair1;
            memcpy(&pair0, x + (g + a) * GROUP + 4 * s, 4);
            memcpy(&pair1, x + (g + a) * GROUP + 4 * s + 2, 4);
            part[a] = _mm512_dpbf16_ps(part[a], as_bh(_mm512_set1_epi32(pair0)), lo);
            part[a] = _mm512_dpbf16_ps(part[a], as_bh(_mm512_set1_epi32(pair1)), hi);
        }
    for (int a = 0; a < count; a++) {
        __m512 scale, zero;
        int4_scale_zero16(sz, g + a, &scale, &zero);
        total = _mm512_fmadd_ps(part[a], scale, total);
        total = _mm512_fmadd_ps(_mm512_set1_ps(xsum[g + a]), zero, total);
    }
    return total;
}

/* One row of x against one tile (16 columns) into y. */
static inline void one_row_tile(const uint16_t *x, const float *xsum, int64_t groups,
                                const uint8_t *w, const uint16_t *sz, uint16_t *y) {
    __m512 total = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + ONE_ROW_GROUPS <= groups; g += ONE_ROW_GROUPS)
        total = one_row_groups(x, xsum, g, groups, w, sz, total, ONE_ROW_GROUPS);
    for (; g < groups; g++) total = one_row_groups(x, xsum, g, groups, w, sz, total, 1);
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(total));
}

#endif
