/* 5-bit weights times int8 activations for the CPU: y[M, N] = x[M, K] W[N, K]^T, x and y
 * bf16, W in int5_matmul.c's tiled layout (the same bytes: a layer can run on either).
 *
 * Each row of x is rounded to int8 on entry (int8_rows.h), as llama.cpp does for a Q5_0
 * layer, so a group's sum of q * xq is exact in int32: AVX-512 VNNI's vpdpbusd takes 64
 * such multiply-adds per instruction where the bf16 kernel's vdpbf16ps takes 32. Per
 * (row, group): sum w x = scale d (sum q xq - 16 sum xq), q in 0..31 unsigned as vpdpbusd
 * wants its first operand.
 *
 * A step's byte 2 i + e holds K offsets e (low nibble) and 2 + e (high nibble) of column
 * i; spread to bytes in place, with the fifth bits added, a 32-bit lane holds column i's K
 * offsets 0, 2, 1, 3, and the quantised x is stored in that order. AVX2 has no vpdpbusd:
 * vpmaddubsw sums byte products in 16-bit pairs, on x in K order. Other CPUs take a
 * portable loop.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "int8_rows.h"
#include "tiles.h"

#define GROUP_BYTES 320 /* int5_matmul.c's layout: 256 bytes of nibbles, then fifth bits */
#define HIGH_BITS 256

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

/* Blocks take two tiles from this many rows on, and from UNPACKED_ROWS on each pair of
 * tiles is unpacked once for all blocks of rows, as int5_avx512.h does. */
#define PAIRED_ROWS 8
#define UNPACKED_ROWS 32

/* Step s of a tile's group as q (0..31) in bytes: column i's K offsets 0, 2, 1, 3 in lane
 * i. The nibbles spread to 16-bit lanes, then each lane's fifth bits (bit j of the two
 * words: the low nibble's, the high one's) added as 16 under a mask. */
static inline __attribute__((always_inline)) __m512i unpack_step(const uint8_t *wg, int s) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wg + 32 * s)));
    __m512i q = _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi16(v, 4)),
                                 _mm512_set1_epi16(0x0F0F));
    uint32_t fifth[2];
    memcpy(fifth, wg + HIGH_BITS + 8 * s, 8);
    q = _mm512_mask_add_epi16(q, (__mmask32)fifth[0], q, _mm512_set1_epi16(0x0010));
    return _mm512_mask_add_epi16(q, (__mmask32)fifth[1], q, _mm512_set1_epi16(0x1000));
}

/* `tiles` adjacent tiles unpacked whole into `out` as tile_block_from reads them. */
static void unpack_tiles(const uint8_t *w, int64_t tile_bytes, int64_t groups, int tiles,
                         __m512i *out) {
    for (int64_t g = 0; g < groups; g++)
        for (int s = 0; s < GROUP / 4; s++)
            for (int j = 0; j < tiles; j++)
                out[(g * (GROUP / 4) + s) * 2 + j] = unpack_step(w + j * tile_bytes + g * GROUP_BYTES, s);
}

/* `rows` rows against `tiles` tiles, their weights unpacked here step by step, or read from
 * `unpacked` (NULL: unpack). Both give the same products in the same order. */
static inline __attribute__((always_inline)) void tile_block_from(
    const int8_t *xq, int64_t k, const group_constants *c, int64_t groups, const uint8_t *w,
    int64_t tile_bytes, const uint16_t *scales, int64_t tile_scales, uint16_t *y,
    int64_t y_stride, const int rows, const int tiles, const __m512i *unpacked) {
    __m512 total[ROW_BLOCK][2];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < tiles; j++) total[m][j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (unpacked == NULL && rows >= PREFETCH_ROWS)
            for (int j = 0; j < tiles; j++)
                prefetch_ahead(w + j * tile_bytes, g * GROUP_BYTES, GROUP_BYTES,
                               groups * GROUP_BYTES);
        __m512i dot[ROW_BLOCK][2];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < tiles; j++) dot[m][j] = _mm512_setzero_si512();
        for (int s = 0; s < GROUP / 4; s++) {
            __m512i q[2];
            for (int j = 0; j < tiles; j++)
                q[j] = unpacked != NULL ? unpacked[(g * (GROUP / 4) + s) * 2 + j]
                                        : unpack_step(w + j * tile_bytes + g * GROUP_BYTES, s);
            for (int m = 0; m < rows; m++) {
                int32_t four;
                memcpy(&four, xq + m * k + g * GROUP + 4 * s, 4);
                const __m512i x4 = _mm512_set1_epi32(four);
                for (int j = 0; j < tiles; j++) dot[m][j] = _mm512_dpbusd_epi32(dot[m][j], q[j], x4);
            }
        }
        for (int j = 0; j < tiles; j++) {
            const __m512 scale = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(scales + j * tile_scales + g * TILE)));
            for (int m = 0; m < rows; m++) {
                const group_constants *cg = c + m * groups + g;
                const __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][j]),
                                                    _mm512_set1_ps(cg->d),
                                                    _mm512_set1_ps(-16.0f * cg->dsum));
                total[m][j] = _mm512_fmadd_ps(part, scale, total[m][j]);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < tiles; j++)
            _mm256_storeu_si256((__m256i *)(y + m * y_stride + j * TILE),
                                (__m256i)_mm512_cvtneps_pbh(total[m][j]));
}

#define INT5_A8_KERNEL "avx512_vnni"

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define XQ_IN_K_ORDER 1

/* Bit j of `word` as 16 in byte j. */
static inline __m256i bits_to_sixteens(uint32_t word) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    const __m256i bytes = _mm256_and_si256(
        _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)word), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, bit), _mm256_set1_epi8(16));
}

/* Rows whose fp32 totals one pass over a tile's groups keeps (4 KB): each group is
 * unpacked once per pass, for all of them (unpacking costs about what 2.5 rows' products
 * do). */
#define ROWS_PER_PASS 64

/* Up to ROWS_PER_PASS rows against one tile; each group's steps are unpacked once: 16-bit
 * lane i of lo (hi) holds column i's q at K offsets 0 and 1 (2 and 3). Two steps' 16-bit
 * sums stay within 2 * 2 * 2 * 31 * 127 = 31496 < 2^15. */
static void tile_rows(const int8_t *xq, int64_t k, const group_constants *c, int64_t groups,
                      const uint8_t *w, const uint16_t *scales, uint16_t *y, int64_t y_stride,
                      const int rows) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 total[ROWS_PER_PASS][2];
    for (int m = 0; m < rows; m++) total[m][0] = total[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = w + g * GROUP_BYTES;
        __m256i lo[GROUP / 4], hi[GROUP / 4];
        for (int s = 0; s < GROUP / 4; s++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(wg + 32 * s));
            uint32_t fifth[2];
            memcpy(fifth, wg + HIGH_BITS + 8 * s, 8);
            lo[s] = _mm256_or_si256(_mm256_and_si256(bytes, nibble), bits_to_sixteens(fifth[0]));
            hi[s] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble),
                                    bits_to_sixteens(fifth[1]));
        }
        const __m256 scale_low =
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g * TILE)));
        const __m256 scale_high =
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g * TILE + 8)));
        for (int m = 0; m < rows; m++) {
            const int8_t *xs = xq + m * k + g * GROUP;
            __m256i low = _mm256_setzero_si256(), high = _mm256_setzero_si256();
            for (int two = 0; two < GROUP / 8; two++) {
                __m256i acc = _mm256_setzero_si256();
                for (int s = 2 * two; s < 2 * two + 2; s++) {
                    int16_t pair01, pair23;
                    memcpy(&pair01, xs + 4 * s, 2);
                    memcpy(&pair23, xs + 4 * s + 2, 2);
                    acc = _mm256_add_epi16(
                        acc, _mm256_add_epi16(
                                 _mm256_maddubs_epi16(lo[s], _mm256_set1_epi16(pair01)),
                                 _mm256_maddubs_epi16(hi[s], _mm256_set1_epi16(pair23))));
                }
                low = _mm256_add_epi32(low, _mm256_cvtepi16_epi32(_mm256_castsi256_si128(acc)));
                high = _mm256_add_epi32(high,
                                        _mm256_cvtepi16_epi32(_mm256_extracti128_si256(acc, 1)));
            }
            const group_constants *cg = c + m * groups + g;
            const __m256 d = _mm256_set1_ps(cg->d), offset = _mm256_set1_ps(-16.0f * cg->dsum);
            total[m][0] = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(low), d, offset),
                                          scale_low, total[m][0]);
            total[m][1] = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(high), d, offset),
                                          scale_high, total[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) {
        float out[TILE];
        _mm256_storeu_ps(out, total[m][0]);
        _mm256_storeu_ps(out + 8, total[m][1]);
        for (int i = 0; i < TILE; i++) y[m * y_stride + i] = to_bf16(out[i]);
    }
}
#define INT5_A8_KERNEL "avx2"

#else

/* Portable version: one row's group is a call of its own, so that its sums are ordered the
 * same for blocks of any size. */
static __attribute__((noinline)) void row_group(const int32_t wq[GROUP][TILE], const int8_t *xg,
                                                const group_constants *cg,
                                                const uint16_t *scale, float total[TILE]) {
    int32_t dot[TILE] = {0};
    for (int j = 0; j < GROUP; j++)
        for (int i = 0; i < TILE; i++) dot[i] += wq[j][i] * xg[j];
    for (int i = 0; i < TILE; i++)
        total[i] += ((float)dot[i] * cg->d - 16.0f * cg->dsum) * from_fp16(scale[i]);
}

static inline void tile_block(const int8_t *xq, int64_t k, const group_constants *c,
                              int64_t groups, const uint8_t *w, int64_t tile_bytes,
                              const uint16_t *scales, int64_t tile_scales, uint16_t *y,
                              int64_t y_stride, const int rows, const int tiles) {
    for (int t = 0; t < tiles; t++) {
        float total[ROW_BLOCK][TILE] = {{0}};
        for (int64_t g = 0; g < groups; g++) {
            /* wq[j] pairs with xq's j-th stored value: K offsets 0, 2, 1, 3 in each four. */
            int32_t wq[GROUP][TILE];
            const uint8_t *wg = w + t * tile_bytes + g * GROUP_BYTES;
            for (int s = 0; s < GROUP / 4; s++) {
                uint32_t fifth[2];
                memcpy(fifth, wg + HIGH_BITS + 8 * s, 8);
                for (int i = 0; i < TILE; i++)
                    for (int e = 0; e < 2; e++) {
                        const int b = 2 * i + e;
                        const uint8_t byte = wg[32 * s + b];
                        wq[4 * s + 2 * e][i] = (byte & 15) | (int)((fifth[0] >> b) & 1) << 4;
                        wq[4 * s + 2 * e + 1][i] = (byte >> 4) | (int)((fifth[1] >> b) & 1) << 4;
                    }
            }
            for (int m = 0; m < rows; m++)
                row_group(wq, xq + m * k + g * GROUP, c + m * groups + g,
                          scales + t * tile_scales + g * TILE, total[m]);
        }
        for (int m = 0; m < rows; m++)
            for (int i = 0; i < TILE; i++) y[m * y_stride + t * TILE + i] = to_bf16(total[m][i]);
    }
}
#define INT5_A8_KERNEL "portable"

#endif

#ifndef XQ_IN_K_ORDER
#define XQ_IN_K_ORDER 0
#endif

const char *int5_matmul_a8_kind(void) { return INT5_A8_KERNEL; }

/* x [rows, x_stride] bf16 (k contiguous); w, scales as int5_matmul.c's; y [rows, n_out]
 * bf16. n_out % 16 == 0 and k % 32 == 0, checked by the caller. Returns 0, or 2 when out
 * of memory. */
int int5_matmul_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                        const uint16_t *scales, uint16_t *y, int64_t rows, int64_t n_out,
                        int64_t k) {
    const int64_t groups = k / GROUP, tiles = n_out / TILE;
    const int64_t tile_bytes = groups * GROUP_BYTES, tile_scales = groups * TILE;
    int8_t *xq;
    group_constants *c;
    if (quantise_rows(x, x_stride, rows, k, XQ_IN_K_ORDER, &xq, &c)) return 2;
    int status = 0;
#if defined(ROWS_PER_PASS)
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t m0 = 0; m0 < rows; m0 += ROWS_PER_PASS)
            tile_rows(xq + m0 * k, k, c + m0 * groups, groups, w + t * tile_bytes,
                      scales + t * tile_scales, y + m0 * n_out + t * TILE, n_out,
                      (int)(rows - m0 < ROWS_PER_PASS ? rows - m0 : ROWS_PER_PASS));
#elif defined(UNPACKED_ROWS)
#define BLOCK(r, n, from)                                                                  \
    tile_block_from(xq + m0 * k, k, c + m0 * groups, groups, w + t * tile_bytes, tile_bytes, \
                    scales + t * tile_scales, tile_scales, y + m0 * n_out + t * TILE, n_out, \
                    r, n, from)
#define UNPACK unpack_tiles(w + t * tile_bytes, tile_bytes, groups, n, buffer)
#define PAIR(r) BLOCK(r, 2, buffer)
#define SINGLE(r) BLOCK(r, 1, buffer)
    if (rows >= UNPACKED_ROWS) {
        FOR_UNPACKED_TILE_PAIRS(tiles, rows, sizeof(__m512i) * groups * (GROUP / 4) * 2, status,
                                UNPACK, PAIR, SINGLE);
    } else {
#undef PAIR
#undef SINGLE
#define PAIR(r) BLOCK(r, 2, NULL)
#define SINGLE(r) BLOCK(r, 1, NULL)
        if (rows >= PAIRED_ROWS) {
            FOR_TILE_PAIRS_AND_ROW_BLOCKS(tiles, rows, PAIR, SINGLE)
        } else {
            FOR_TILES_AND_ROW_BLOCKS(tiles, rows, SINGLE)
        }
    }
#undef SINGLE
#undef PAIR
#undef UNPACK
#undef BLOCK
#else
#define SINGLE(r)                                                                          \
    tile_block(xq + m0 * k, k, c + m0 * groups, groups, w + t * tile_bytes, tile_bytes,     \
               scales + t * tile_scales, tile_scales, y + m0 * n_out + t * TILE, n_out, r, 1)
    FOR_TILES_AND_ROW_BLOCKS(tiles, rows, SINGLE)
#undef SINGLE
#endif
    free(xq);
    free(c);
    return status;
}
