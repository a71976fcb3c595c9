/* mxfp4_matmul.c's loop for bf16 rows with AVX-512 BF16 and VBMI (the C decoder layer's and
 * experts' calls): a block's 32 nibbles become 32 bf16 E2M1 values in three instructions,
 * summed against x by one dpbf16 a row, the block's scale applied once to that sum.
 *
 * The fp32 loop spends two vpermps, two multiplies by the scale and two FMAs on each block
 * of a row; at one row (a decode's experts) that compute, not memory, bounded it. Here:
 * the block's 16 bytes broadcast to the four 128-bit lanes, vpmultishiftqb puts one
 * nibble in each byte (the nibble of both bytes of a bf16 lane), a ternary logic keeps the
 * nibble and tells the high byte from the low one, and vpermb looks both bytes up in one
 * 32-byte table. The weights then lie in another order than K's (ORDER below), so each
 * row of x is put in that order once per call, for all the columns.
 *
 * Exactness: an E2M1 value doubled (0, 1, 2, 3, 4, 6, 8 or 12) is exact in bf16, and so is
 * a bf16 x: their product is exact in fp32 and dpbf16 sums it in fp32; the block's sum is
 * multiplied by 2^(e - 128) (exact) and added to the row's total. The result is the
 * dequantised weight's product within fp32 rounding of the sums (dpbf16 treats bf16
 * subnormals, below 1.2e-38, as zero). Each row is summed alone, in the same order
 * whatever the number of rows. Included by mxfp4_matmul.c alone. */
#ifndef LLAMASERVE_MXFP4_DPBF16_H
#define LLAMASERVE_MXFP4_DPBF16_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "mxfp4_block.h"

/* Rows per pass over a column's blocks (their totals in registers: two each). */
#define BH_ROWS 8

/* bf16 of the doubled E2M1 values: the low bytes (entries 0-15), then the high ones. */
static const uint8_t BH_TABLE[64] = {
    0x00, 0x80, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x40, 0x00, 0x80, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x40,
    0x00, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41, 0x00, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0, 0xC1, 0xC1};

/* Lane p (0-31) of the decoded block holds weight ORDER[p]: quadword q takes the bytes of
 * the block's half q % 2 (8 bytes: weights 8 (q % 2) + j, low nibble, and that + 16,
 * high), its four lanes weights 2 r, 2 r + 1, 2 r + 16, 2 r + 17 of that half, r = q / 2. */
static const uint8_t ORDER[MX_BLOCK] = {
    0,  1,  16, 17, 8,  9,  24, 25, 2,  3,  18, 19, 10, 11, 26, 27,
    4,  5,  20, 21, 12, 13, 28, 29, 6,  7,  22, 23, 14, 15, 30, 31};

/* The bit offset (within its quadword) of lane p's nibble, for both of its bytes: per
 * quadword q, bytes 2 (q / 2) and 2 (q / 2) + 1 of its half, low nibbles then high. */
static const uint8_t NIBBLE_OFFSETS[64] = {
     0,  0,  8,  8,  4,  4, 12, 12,
     0,  0,  8,  8,  4,  4, 12, 12,
    16, 16, 24, 24, 20, 20, 28, 28,
    16, 16, 24, 24, 20, 20, 28, 28,
    32, 32, 40, 40, 36, 36, 44, 44,
    32, 32, 40, 40, 36, 36, 44, 44,
    48, 48, 56, 56, 52, 52, 60, 60,
    48, 48, 56, 56, 52, 52, 60, 60,
};

/* One block of `rows` rows (x in ORDER, k apart) added into `total`, a total per row. */
static inline __attribute__((always_inline)) void bh_block(const uint16_t *xo, int64_t k,
                                                           const uint8_t *block, const float *scales,
                                                           __m512 *total, const int rows) {
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(block + 1)));
    /* (nibble & 15) | 16 in high bytes: 0xEA is (A & B) | C. */
    const __m512i index = _mm512_ternarylogic_epi32(
        _mm512_multishift_epi64_epi8(_mm512_loadu_si512(NIBBLE_OFFSETS), bytes),
        _mm512_set1_epi8(0x0F), _mm512_set1_epi16(0x1000), 0xEA);
    const __m512bh wv = (__m512bh)_mm512_permutexvar_epi8(index, _mm512_loadu_si512(BH_TABLE));
    const __m512 scale = _mm512_set1_ps(scales[block[0]]);
    for (int m = 0; m < rows; m++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xo + m * k);
        total[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv, wv), scale, total[m]);
    }
}

/* `rows` rows of x against one column's weight row: two totals a row (even and odd
 * blocks, so that two chains of FMAs overlap), added and rounded to bf16 at the end. */
static inline __attribute__((always_inline)) void bh_column_rows(
    const uint16_t *xo, int64_t k, const uint8_t *w, int64_t blocks, const float *scales,
    uint16_t *y, int64_t y_stride, const int rows) {
    __m512 even[BH_ROWS], odd[BH_ROWS];
    for (int m = 0; m < rows; m++) even[m] = odd[m] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        bh_block(xo + b * MX_BLOCK, k, w + b * MX_BYTES, scales, even, rows);
        bh_block(xo + (b + 1) * MX_BLOCK, k, w + (b + 1) * MX_BYTES, scales, odd, rows);
    }
    if (b < blocks) bh_block(xo + b * MX_BLOCK, k, w + b * MX_BYTES, scales, even, rows);
    for (int m = 0; m < rows; m++)
        y[m * y_stride] = to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])));
}

/* Rows first..end against one column, BH_ROWS at a time. */
static void bh_column(const uint16_t *xo, int64_t k, const uint8_t *wn, int64_t blocks,
                      const float *scales, uint16_t *y, int64_t n_out, int64_t first,
                      int64_t end) {
    for (int64_t m0 = first; m0 < end; m0 += BH_ROWS) {
        const uint16_t *xm = xo + m0 * k;
        uint16_t *ym = y + m0 * n_out;
        switch (end - m0 < BH_ROWS ? end - m0 : BH_ROWS) {
        case 1: bh_column_rows(xm, k, wn, blocks, scales, ym, n_out, 1); break;
        case 2: bh_column_rows(xm, k, wn, blocks, scales, ym, n_out, 2); break;
        case 3: bh_column_rows(xm, k, wn, blocks, scales, ym, n_out, 3); break;
        case 4: bh_column_rows(xm, k, wn, blocks, scales, ym, n_out, 4); break;
        case 5: bh_column_rows(xm, k, wn, blocks, scales, ym, n_out, 5); break;
        case 6: bh_column_rows(xm, k, wn, blocks, scales, ym, n_out, 6); break;
        case 7: bh_column_rows(xm, k, wn, blocks, scales, ym, n_out, 7); break;
        default: bh_column_rows(xm, k, wn, blocks, scales, ym, n_out, BH_ROWS);
        }
    }
}

/* bf16 x [rows, x_stride] times the MXFP4 weight, y [rows, n_out] bf16. Returns 0, or 2
 * when out of memory. */
static int mxfp4_dpbf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, uint16_t *y,
                        int64_t rows, int64_t n_out, int64_t k) {
    const int64_t blocks = k / MX_BLOCK, row_bytes = blocks * MX_BYTES;
    uint16_t *xo = malloc(sizeof(uint16_t) * (rows > 0 ? rows : 1) * k);
    if (xo == NULL) return 2;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < blocks; b++)
            for (int p = 0; p < MX_BLOCK; p++)
                xo[m * k + b * MX_BLOCK + p] = x[m * x_stride + b * MX_BLOCK + ORDER[p]];
    float scales[256];
    for (int e = 0; e < 256; e++) scales[e] = half_scale((uint8_t)e);
    const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel for collapse(2) schedule(static) if (rows * n_out * k >= (1 << 18))
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t n = 0; n < n_out; n++) {
            const int64_t end = (t + 1) * ROW_TILE < rows ? (t + 1) * ROW_TILE : rows;
            bh_column(xo, k, w + n * row_bytes, blocks, scales, y + n, n_out, t * ROW_TILE, end);
        }
    free(xo);
    return 0;
}

#endif
