/* int6_matmul.c's loop with AVX-512 BF16: each step's nibbles and top bits looked up as
 * bf16 q - 32 (vpermt2w), products summed by dpbf16, d c applied once per sub-block. From
 * UNPACKED_ROWS rows on each pair of tiles is unpacked once, into a buffer, for all the
 * blocks of rows. Included by int6_matmul.c alone (its layout constants), where the
 * compiler targets AVX-512 BF16. */
#ifndef LLAMASERVE_INT6_AVX512_H
#define LLAMASERVE_INT6_AVX512_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "tiles.h"

/* The output projection takes two tiles a block from 8 rows here: Qwen2.5-Coder-1.5B's
 * (151,936 x 1536) at 8 / 9 rows 14.7-14.8 / 17.8-18.3 ms against 16.0-17.0 / 19.7-20.9 a
 * tile at a time; the layers' shapes gained nothing at 8 and keep PAIRED_ROWS. */
#define PAIRED_LOGITS_ROWS 8


static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

/* bf16 of q - 32 for the six bits of each 16-bit lane of idx: the nibble in bits 0-3,
 * the top bits in 4-5 (from `top`, whose bits 4-5 are taken), the rest ignored. */
static inline __attribute__((always_inline)) __m512bh six_bits(__m512i nibble, __m512i top,
                                                               __m512i low_mask, __m512i below,
                                                               __m512i above) {
    /* 0xE4: a where the mask bit is set, else b. */
    const __m512i idx = _mm512_ternarylogic_epi32(nibble, top, low_mask, 0xE4);
    return as_bh(_mm512_permutex2var_epi16(below, idx, above));
}

/* The tables six_bits looks up: bf16 of q - 32 for q 0..31 (-32..-1), then 32..63
 * (0..31); exact. */
typedef struct {
    __m512i below, above, low_mask;
} six_bit_tables;

static inline __attribute__((always_inline)) six_bit_tables make_tables(void) {
    const __m512 iota = _mm512_cvtepi32_ps(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512 sixteen = _mm512_set1_ps(16.0f);
    six_bit_tables t;
    t.below = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(iota, sixteen),
                                           _mm512_sub_ps(iota, _mm512_add_ps(sixteen, sixteen)));
    t.above = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(iota, sixteen), iota);
    t.low_mask = _mm512_set1_epi16(0x0F);
    return t;
}

/* Half u of a tile's sub-block (eight K values of each of its 16 columns) as four vectors
 * of bf16 q - 32, a pair of K values per column each. */
static inline __attribute__((always_inline)) void unpack_half(const uint8_t *ws, int u,
                                                              six_bit_tables t, __m512bh *wv) {
    const __m512i top =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ws + HIGH_BITS + 32 * u)));
    const __m512i b0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ws + 64 * u)));
    const __m512i b1 =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ws + 64 * u + 32)));
    wv[0] = six_bits(b0, _mm512_slli_epi16(top, 4), t.low_mask, t.below, t.above);
    wv[1] = six_bits(_mm512_srli_epi16(b0, 4), _mm512_slli_epi16(top, 2), t.low_mask, t.below,
                     t.above);
    wv[2] = six_bits(b1, top, t.low_mask, t.below, t.above);
    wv[3] = six_bits(_mm512_srli_epi16(b1, 4), _mm512_srli_epi16(top, 2), t.low_mask, t.below,
                     t.above);
}

/* Where tile_block_from reads the unpacked half u of sub-block b of super-block g: per
 * half, the first tile's four vectors, then the second's. */
#define UNPACKED_AT(g, b, u) ((((g) * SUBS + (b)) * 2 + (u)) * 8)

/* `tiles` adjacent tiles unpacked whole into `out`. */
static void unpack_tiles(const uint8_t *w, int64_t tile_bytes, int64_t supers, int tiles,
                         __m512bh *out) {
    const six_bit_tables t = make_tables();
    for (int64_t g = 0; g < supers; g++)
        for (int b = 0; b < SUBS; b++)
            for (int u = 0; u < 2; u++)
                for (int j = 0; j < tiles; j++)
                    unpack_half(w + j * tile_bytes + g * SUPER_BYTES + b * SUB_BYTES, u, t,
                                out + UNPACKED_AT(g, b, u) + 4 * j);
}

/* `rows` rows against `tiles` tiles, their weights unpacked here or read from `unpacked`
 * (unpack_tiles' output; NULL: unpack): the same products in the same order either way. */
static inline __attribute__((always_inline)) void tile_block_from(
    const uint16_t *x, int64_t x_stride, int64_t supers, const uint8_t *w, int64_t tile_bytes,
    const float *scales, int64_t tile_scales, void *y, int64_t y_stride, const int rows,
    const int tiles, const int f32_out, const __m512bh *unpacked) {
    const six_bit_tables tables = make_tables();
    __m512 total[ROW_BLOCK][2];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < tiles; j++) total[m][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < supers; g++) {
        __m512 d[2];
        for (int j = 0; j < tiles; j++) d[j] = _mm512_loadu_ps(scales + j * tile_scales + g * TILE);
        for (int b = 0; b < SUBS; b++) {
            if (unpacked == NULL && rows >= PREFETCH_ROWS)
                for (int j = 0; j < tiles; j++)
                    prefetch_ahead(w + j * tile_bytes, g * SUPER_BYTES + b * SUB_BYTES, SUB_BYTES,
                                   tile_bytes);
            __m512 part[ROW_BLOCK][2];
            for (int m = 0; m < rows; m++)
                for (int j = 0; j < tiles; j++) part[m][j] = _mm512_setzero_ps();
            for (int u = 0; u < 2; u++) {
                __m512bh wv[2][4];
                for (int j = 0; j < tiles; j++) {
                    if (unpacked != NULL) {
                        for (int p = 0; p < 4; p++)
                            wv[j][p] = unpacked[UNPACKED_AT(g, b, u) + 4 * j + p];
                    } else {
                        unpack_half(w + j * tile_bytes + g * SUPER_BYTES + b * SUB_BYTES, u,
                                    tables, wv[j]);
                    }
                }
                const int64_t k = g * SUPER + b * SUB + 8 * u;
                for (int m = 0; m < rows; m++) {
                    for (int p = 0; p < 4; p++) {
                        int32_t pair; /* broadcast from memory: no shuffle */
                        memcpy(&pair, x + m * x_stride + k + 2 * p, 4);
                        const __m512bh xp = as_bh(_mm512_set1_epi32(pair));
                        for (int j = 0; j < tiles; j++)
                            part[m][j] = _mm512_dpbf16_ps(part[m][j], xp, wv[j][p]);
                    }
                }
            }
            for (int j = 0; j < tiles; j++) {
                const uint8_t *c =
                    w + j * tile_bytes + g * SUPER_BYTES + b * SUB_BYTES + SUB_SCALES;
                const __m512 scale = _mm512_mul_ps(
                    d[j], _mm512_cvtepi32_ps(
                              _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))));
                for (int m = 0; m < rows; m++)
                    total[m][j] = _mm512_fmadd_ps(part[m][j], scale, total[m][j]);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < tiles; j++) {
            if (f32_out)
                _mm512_storeu_ps((float *)y + m * y_stride + j * TILE, total[m][j]);
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + m * y_stride + j * TILE),
                                    (__m256i)_mm512_cvtneps_pbh(total[m][j]));
        }
}

static inline __attribute__((always_inline)) void tile_block(
    const uint16_t *x, int64_t x_stride, const float *xf, int64_t supers, const uint8_t *w,
    int64_t tile_bytes, const float *scales, int64_t tile_scales, void *y, int64_t y_stride,
    const int rows, const int tiles, const int f32_out) {
    (void)xf;
    tile_block_from(x, x_stride, supers, w, tile_bytes, scales, tile_scales, y, y_stride, rows,
                    tiles, f32_out, NULL);
}

/* From this many rows on, each pair of tiles is unpacked once, into a buffer of its own
 * thread, for all the blocks of rows, instead of once per block of 8 rows: at 8 rows a
 * block, unpacking six bits takes as many instructions as the products. */
#define UNPACKED_ROWS 32

/* The matmul from UNPACKED_ROWS rows on. Returns 0, or 2 when out of memory. */
static int unpacked_matmul(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                           const float *scales, void *y, int64_t rows, int64_t n_out,
                           int64_t supers, const int f32_out) {
    const int64_t tiles = n_out / TILE, tile_bytes = supers * SUPER_BYTES;
    const int64_t tile_scales = supers * TILE, width = f32_out ? 4 : 2;
    int status = 0;
#define UNPACK unpack_tiles(w + t * tile_bytes, tile_bytes, supers, n, buffer)
#define BLOCK(r, n)                                                                        \
    tile_block_from(x + m0 * x_stride, x_stride, supers, w + t * tile_bytes, tile_bytes,   \
                    scales + t * tile_scales, tile_scales,                                 \
                    (char *)y + (m0 * n_out + t * TILE) * width, n_out, r, n, f32_out, buffer)
#define PAIR(r) BLOCK(r, 2)
#define SINGLE(r) BLOCK(r, 1)
    FOR_UNPACKED_TILE_PAIRS(tiles, rows, sizeof(__m512bh) * UNPACKED_AT(supers, 0, 0), status,
                            UNPACK, PAIR, SINGLE);
#undef SINGLE
#undef PAIR
#undef BLOCK
#undef UNPACK
    return status;
}

#endif
