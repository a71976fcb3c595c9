/* mxfp4_matmul.c's loop for bf16 rows with AVX-512 BF16 and VBMI (the C decoder layer's and
 * experts' calls): a block's 32 nibbles become 32 bf16 weights, its scale included, in
 * three instructions, summed against x by one dpbf16 a row.
 *
 * Decoding: the block's 16 bytes broadcast to the four 128-bit lanes, vpmultishiftqb puts
 * one nibble in each byte (the nibble of both bytes of a bf16 lane), a ternary logic keeps
 * the nibble and tells the high byte from the low one, and vpermb looks both bytes up in
 * the 32-byte table of the block's scale byte (BH_SCALED). The weights then lie in another
 * order than K's (ORDER below), so each row of x is put in that order once per call.
 *
 * Prefill: dpbf16 (one a cycle) bounds the loop once a block's decoding is shared by
 * enough rows, so a tile of rows decodes four columns once into a buffer and passes over
 * it three rows by four columns at a time (bh_tile). Up to three rows (a decode's
 * experts) a block is decoded in registers and used at once by each row.
 *
 * Exactness: an E2M1 value doubled (0, 1, 2, 3, 4, 6, 8 or 12) times the scale 2^(e - 128)
 * is exact in bf16 for scales in [BH_EXACT_MIN, BH_EXACT_MAX], and so is a bf16 x: their
 * product is exact in fp32 and dpbf16 sums it in fp32. The result is the dequantised
 * weight's product within fp32 rounding of the sums (dpbf16 treats bf16 subnormals, below
 * 1.2e-38, as zero); a column with a scale outside that range (no trained weight has one)
 * is summed by bh_exact_total instead. Each row is summed alone, in the same order
 * whatever the number of rows and whichever path it takes. Included by mxfp4_matmul.c
 * alone. */
#ifndef LLAMASERVE_MXFP4_DPBF16_H
#define LLAMASERVE_MXFP4_DPBF16_H

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "mxfp4_block.h"

/* Columns decoded together into a buffer of bf16 weights (4 x 2880 weights: 23 KB, within
 * L1), and the rows a pass over that buffer multiplies by all of them, their totals in
 * registers (two a row and column: even and odd blocks, so that the chains of dpbf16
 * overlap). Up to BH_IN_REGISTERS rows decode each block in registers instead, one column
 * at a time, in tiles of two rows, or three where three are left: at one row (a decode's
 * experts) that streams the weights as fast as memory gives them, where the buffer's store
 * and reload cost 15-20% more (and interleaving the columns twice that); at three rows it
 * took 1.4 ms an expert against the buffer's 2.0, at four (2 + 2) 2.6 against 2.4. */
#define BH_COLS 4
#define BH_ROWS 3
#define BH_IN_REGISTERS 3
_Static_assert(BH_IN_REGISTERS <= BH_ROWS, "a tile's totals are held for BH_ROWS rows");
#define BH_AHEAD 2048 /* bytes of a column's blocks prefetched ahead of their decoding */

/* bf16 of the doubled E2M1 values: the low bytes (entries 0-15), then the high ones. */
static const uint8_t BH_TABLE[64] = {
    0x00, 0x80, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x40, 0x00, 0x80, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x40,
    0x00, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41, 0x00, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0, 0xC1, 0xC1};

/* The same table per scale byte e, each value times 2^(e - 128): exact in bf16 (a power of
 * two only moves the exponent) for e in [BH_EXACT_MIN, BH_EXACT_MAX], where the smallest
 * nonzero value (1 x 2^-126) stays normal and the largest (12 x 2^124) finite. A block's
 * scale then costs no instruction at all: dpbf16 sums its scaled products straight into
 * the row's total. 32 bytes a scale (a 64-byte load reads the next scale's table too, whose
 * entries no index reaches). Filled once, when the library is loaded. */
#define BH_EXACT_MIN 2
#define BH_EXACT_MAX 252
static uint8_t BH_SCALED[256 * 64] __attribute__((aligned(64)));

__attribute__((constructor)) static void bh_fill_scaled(void) {
    for (int e = 0; e < 256; e++)
        for (int j = 0; j < 16; j++) {
            const uint16_t lo = BH_TABLE[j], hi = BH_TABLE[16 + j];
            const float value = from_bf16((uint16_t)(hi << 8 | lo)) * half_scale((uint8_t)e);
            uint32_t bits;
            memcpy(&bits, &value, sizeof bits);
            BH_SCALED[e * 64 + j] = (uint8_t)(bits >> 16);
            BH_SCALED[e * 64 + 16 + j] = (uint8_t)(bits >> 24);
        }
}

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

/* A block's 32 weights as bf16 in ORDER, looked up in `table`: (nibble & 15) | 16 in the
 * high byte of each lane (0xEA is (A & B) | C), vpermb for both bytes. */
static inline __attribute__((always_inline)) __m512bh bh_decode(const uint8_t *block,
                                                                __m512i offsets,
                                                                const uint8_t *table) {
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(block + 1)));
    const __m512i index = _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(offsets, bytes),
                                                    _mm512_set1_epi8(0x0F),
                                                    _mm512_set1_epi16(0x1000), 0xEA);
    return (__m512bh)_mm512_permutexvar_epi8(index, _mm512_loadu_si512(table));
}

/* One (row, column) total as the loop before the scaled tables summed it: each block's
 * products by one dpbf16, that sum times the block's scale. For a column with a scale
 * outside the tables' exact range (no trained weight has one: its values would lie below
 * 1e-38 or above 1e38). */
static float bh_exact_total(const uint16_t *xo, const uint8_t *w, int64_t blocks) {
    const __m512i offsets = _mm512_loadu_si512(NIBBLE_OFFSETS);
    __m512 total = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = w + b * MX_BYTES;
        const __m512bh wv = bh_decode(block, offsets, BH_TABLE);
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xo + b * MX_BLOCK);
        total = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv, wv),
                                _mm512_set1_ps(half_scale(block[0])), total);
    }
    return _mm512_reduce_add_ps(total);
}

/* A column's blocks decoded, scale included, into `out` [blocks][32] bf16 (in ORDER).
 * Returns whether a scale lies outside the tables' exact range. */
static int bh_decode_column(const uint8_t *w, int64_t blocks, uint16_t *out) {
    const __m512i offsets = _mm512_loadu_si512(NIBBLE_OFFSETS);
    unsigned outside = 0;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = w + b * MX_BYTES;
        _mm_prefetch((const char *)block + BH_AHEAD, _MM_HINT_T0);
        outside |= (uint8_t)(block[0] - BH_EXACT_MIN) > BH_EXACT_MAX - BH_EXACT_MIN;
        _mm512_storeu_si512(out + b * MX_BLOCK,
                            (__m512i)bh_decode(block, offsets, BH_SCALED + block[0] * 64));
    }
    return outside != 0;
}

/* Block b's weights of `cols` columns: decoded in `wd` (k apart), or with wd NULL decoded
 * here from `w` (row_bytes apart), `outside` noting a scale outside the exact range. */
static inline __attribute__((always_inline)) void bh_weights(const uint16_t *wd, const uint8_t *w,
                                                             int64_t k, int64_t row_bytes,
                                                             int64_t b, __m512i offsets,
                                                             __m512bh *wv, unsigned *outside,
                                                             const int cols) {
    for (int c = 0; c < cols; c++) {
        if (wd != NULL) {
            wv[c] = (__m512bh)_mm512_loadu_si512(wd + c * k + b * MX_BLOCK);
        } else {
            const uint8_t *block = w + c * row_bytes + b * MX_BYTES;
            outside[c] |= (uint8_t)(block[0] - BH_EXACT_MIN) > BH_EXACT_MAX - BH_EXACT_MIN;
            wv[c] = bh_decode(block, offsets, BH_SCALED + block[0] * 64);
        }
    }
}

/* One block of `rows` rows (x at xb, k apart) against `cols` weights, into `total`. */
static inline __attribute__((always_inline)) void bh_step(const uint16_t *xb, int64_t k,
                                                          const __m512bh *wv,
                                                          __m512 total[][BH_COLS],
                                                          const int rows, const int cols) {
    for (int m = 0; m < rows; m++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * k);
        for (int c = 0; c < cols; c++) total[m][c] = _mm512_dpbf16_ps(total[m][c], xv, wv[c]);
    }
}

/* `rows` rows of x (in ORDER, k apart) against `cols` columns (bh_weights' sources): one
 * total a (row, column) for its even blocks and one for its odd ones, each summed in order
 * by one dpbf16 a block, the scale in the weights; the two added and rounded to bf16 once.
 * The same instructions in the same order for every (row, column), whatever `rows` and
 * `cols` are and whichever source the weights come from: a row's result does not depend
 * on its neighbours. */
static inline __attribute__((always_inline)) void bh_tile(
    const uint16_t *xo, const uint16_t *wd, const uint8_t *w, int64_t k, int64_t row_bytes,
    uint16_t *y, int64_t y_stride, unsigned *outside, const int rows, const int cols) {
    const __m512i offsets = _mm512_loadu_si512(NIBBLE_OFFSETS);
    const int64_t blocks = k / MX_BLOCK;
    __m512 even[BH_ROWS][BH_COLS], odd[BH_ROWS][BH_COLS];
    __m512bh wv[BH_COLS];
    for (int m = 0; m < rows; m++)
        for (int c = 0; c < cols; c++) even[m][c] = odd[m][c] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        bh_weights(wd, w, k, row_bytes, b, offsets, wv, outside, cols);
        bh_step(xo + b * MX_BLOCK, k, wv, even, rows, cols);
        bh_weights(wd, w, k, row_bytes, b + 1, offsets, wv, outside, cols);
        bh_step(xo + (b + 1) * MX_BLOCK, k, wv, odd, rows, cols);
    }
    if (b < blocks) {
        bh_weights(wd, w, k, row_bytes, b, offsets, wv, outside, cols);
        bh_step(xo + b * MX_BLOCK, k, wv, even, rows, cols);
    }
    for (int m = 0; m < rows; m++)
        for (int c = 0; c < cols; c++)
            y[m * y_stride + c] =
                to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(even[m][c], odd[m][c])));
}

/* Rows first..end against the BH_COLS columns decoded in `wd`, BH_ROWS rows at a time. */
static void bh_decoded_rows(const uint16_t *xo, const uint16_t *wd, int64_t k, uint16_t *y,
                            int64_t n_out, int64_t first, int64_t end) {
    for (int64_t m0 = first; m0 < end; m0 += BH_ROWS) {
        const uint16_t *xm = xo + m0 * k;
        uint16_t *ym = y + m0 * n_out;
        switch (end - m0 < BH_ROWS ? end - m0 : BH_ROWS) {
        case 1: bh_tile(xm, wd, NULL, k, 0, ym, n_out, NULL, 1, BH_COLS); break;
        case 2: bh_tile(xm, wd, NULL, k, 0, ym, n_out, NULL, 2, BH_COLS); break;
        default: bh_tile(xm, wd, NULL, k, 0, ym, n_out, NULL, BH_ROWS, BH_COLS);
        }
    }
}

/* Rows first..end against columns n..n + cols (row_bytes apart): past BH_IN_REGISTERS rows
 * the columns are decoded into `wd` [BH_COLS, k] once; fewer decode them in registers. A
 * column with a scale outside the exact range is summed again alone, whatever the rows. */
static void bh_columns(const uint16_t *xo, int64_t k, const uint8_t *w, int64_t row_bytes,
                       uint16_t *wd, uint16_t *y, int64_t n_out, int64_t first, int64_t end,
                       int cols) {
    const int64_t blocks = k / MX_BLOCK, rows = end - first;
    unsigned outside[BH_COLS] = {0};
    if (rows > BH_IN_REGISTERS && cols == BH_COLS) {
        for (int c = 0; c < cols; c++)
            outside[c] = bh_decode_column(w + c * row_bytes, blocks, wd + c * k);
        bh_decoded_rows(xo, wd, k, y, n_out, first, end);
    } else {
        for (int c = 0; c < cols; c++)
            for (int64_t m = first; m < end; m += 2) {
                const uint8_t *wc = w + c * row_bytes;
                uint16_t *ym = y + m * n_out + c;
                if (end - m == 3) {
                    bh_tile(xo + m * k, NULL, wc, k, 0, ym, n_out, outside + c, 3, 1);
                    break;
                }
                if (end - m == 1)
                    bh_tile(xo + m * k, NULL, wc, k, 0, ym, n_out, outside + c, 1, 1);
                else
                    bh_tile(xo + m * k, NULL, wc, k, 0, ym, n_out, outside + c, 2, 1);
            }
    }
    for (int c = 0; c < cols; c++)
        if (outside[c])
            for (int64_t m = first; m < end; m++)
                y[m * n_out + c] = to_bf16(bh_exact_total(xo + m * k, w + c * row_bytes, blocks));
}

/* Item i of a product: its tile of ROW_TILE rows against its group of BH_COLS columns. */
static inline void bh_item(const uint16_t *xo, const uint8_t *w, uint16_t *wd, uint16_t *y,
                           int64_t rows, int64_t n_out, int64_t k, int64_t groups, int64_t i) {
    const int64_t row_bytes = k / MX_BLOCK * MX_BYTES, t = i / groups, n = i % groups * BH_COLS;
    const int64_t end = (t + 1) * ROW_TILE < rows ? (t + 1) * ROW_TILE : rows;
    const int cols = n_out - n < BH_COLS ? (int)(n_out - n) : BH_COLS;
    bh_columns(xo, k, w + n * row_bytes, row_bytes, wd, y + n, n_out, t * ROW_TILE, end, cols);
}

/* bf16 x [rows, x_stride] times the MXFP4 weight, y [rows, n_out] bf16. Returns 0, or 2
 * when out of memory. */
static int mxfp4_dpbf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, uint16_t *y,
                        int64_t rows, int64_t n_out, int64_t k) {
    const int64_t blocks = k / MX_BLOCK;
    uint16_t *xo = malloc(sizeof(uint16_t) * (rows > 0 ? rows : 1) * k);
    if (xo == NULL) return 2;
    /* One vpermw a block: the experts' calls take a few columns of a product each, so
     * this runs once per few hundred columns, where the scalar copy cost a few percent. */
    uint16_t order16[MX_BLOCK];
    for (int p = 0; p < MX_BLOCK; p++) order16[p] = ORDER[p];
    const __m512i order = _mm512_loadu_si512(order16);
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < blocks; b++)
            _mm512_storeu_si512(xo + m * k + b * MX_BLOCK,
                                _mm512_permutexvar_epi16(
                                    order, _mm512_loadu_si512(x + m * x_stride + b * MX_BLOCK)));
    const int64_t groups = (n_out + BH_COLS - 1) / BH_COLS;
    const int64_t items = (rows + ROW_TILE - 1) / ROW_TILE * groups;
    int status = 0;
    /* A call from inside a team (a piece of the experts' products, moe_experts.c) or too
     * small to share runs here: an inactive nested region still builds a team of one. */
    if (omp_in_parallel() || rows * n_out * k < (1 << 18)) {
        uint16_t *wd = rows > BH_IN_REGISTERS ? malloc(sizeof(uint16_t) * BH_COLS * k) : NULL;
        if (rows > BH_IN_REGISTERS && wd == NULL) status = 2;
        for (int64_t i = 0; i < items && !status; i++)
            bh_item(xo, w, wd, y, rows, n_out, k, groups, i);
        free(wd);
        free(xo);
        return status;
    }
#pragma omp parallel reduction(max : status)
    {
        /* Only tiles of more than BH_IN_REGISTERS rows decode into it. */
        uint16_t *wd = rows > BH_IN_REGISTERS ? malloc(sizeof(uint16_t) * BH_COLS * k) : NULL;
        const int failed = rows > BH_IN_REGISTERS && wd == NULL;
        status = failed ? 2 : 0; /* the reduction's own copy starts at INT_MIN */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < items; i++)
            if (!failed) bh_item(xo, w, wd, y, rows, n_out, k, groups, i);
        free(wd);
    }
    free(xo);
    return status;
}

#endif
