/* int4 weights times int8 activations for the CPU: y[M, N] = x[M, K] W[N, K]^T, x and y
 * bf16, W in int4_matmul.c's tiled layout (the same bytes: a layer can run on either).
 *
 * Each row of x is rounded to int8 on entry (int8_rows.h). A group's sum of q * xq is then
 * exact in int32, and AVX-512 VNNI's vpdpbusd takes 64 such multiply-adds per
 * instruction, twice vdpbf16ps's 32: the products run at up to twice the bf16 kernel's
 * speed once a block is compute-bound, at the cost of rounding x to 8 bits. Per (row,
 * group): sum w x = scale d (sum q xq - 8 sum xq) + zero sum x, with sum x taken from the
 * bf16 x itself.
 *
 * vpdpbusd sums four byte products per 32-bit lane, one lane per output column. The
 * packed byte 2 i + e of a step holds K offsets e (low nibble) and 2 + e (high nibble) of
 * column i, so a lane's four nibbles, spread to bytes in place, hold K offsets 0, 2, 1, 3:
 * the quantised x is stored in that order. AVX2 (below) has no vpdpbusd and takes
 * vpmaddubsw (byte products summed in 16-bit pairs) on its own layout; other CPUs take a
 * portable loop.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "int4_scales.h"
#include "int8_rows.h"
#include "tiles.h"

/* The entry points' names: int4k_ for the superblock layout (int4k_matmul_a8.c). */
#ifdef INT4_SUPERBLOCKS
#define INT4_A8_KIND int4k_matmul_a8_kind
#define INT4_A8_BF16 int4k_matmul_a8_bf16
#else
#define INT4_A8_KIND int4_matmul_a8_kind
#define INT4_A8_BF16 int4_matmul_a8_bf16
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

/* Each row's sum of q xq over group g of the tile, q in 0..15 (exact in int32). */
static inline __attribute__((always_inline)) void group_dots(
    const int8_t *xq, int64_t k, int64_t g, int64_t groups, const uint8_t *w, const int rows,
    __m512i dot[ROW_BLOCK]) {
    const __m512i nibbles = _mm512_set1_epi16(0x0F0F);
    if (rows >= PREFETCH_ROWS)
        prefetch_ahead(w, g * (TILE * GROUP / 2), TILE * GROUP / 2, groups * (TILE * GROUP / 2));
    for (int m = 0; m < rows; m++) dot[m] = _mm512_setzero_si512();
    const uint8_t *wg = w + g * (TILE * GROUP / 2);
    for (int s = 0; s < GROUP / 4; s++) {
        /* byte b of the step as a 16-bit lane, then (b & 15) | (b >> 4) << 8. */
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wg + 32 * s)));
        __m512i q = _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi16(v, 4)), nibbles);
        for (int m = 0; m < rows; m++) {
            int32_t four;
            memcpy(&four, xq + m * k + g * GROUP + 4 * s, 4);
            dot[m] = _mm512_dpbusd_epi32(dot[m], q, _mm512_set1_epi32(four));
        }
    }
}

#ifdef INT4_SUPERBLOCKS
/* Q4_K's own form, w = d sc q - dmin m = d sc (q - 8) + 8 d sc - dmin m: per group a row
 * adds (dx sum (q - 8) xq + 8 sum(x)) d sc to its total and takes sum(x) dmin m off it. d sc
 * is exact in fp32 (11 and 6 significant bits) and shared by the block's rows; no (q - 8)
 * offset. (Summing a superblock's groups by sc apart and scaling by d once held eight more
 * accumulators and was 4% slower at 128 rows.) */
static inline __attribute__((always_inline)) void tile_block(
    const int8_t *xq, int64_t k, const group_constants *c, int64_t groups, const uint8_t *w,
    const uint16_t *sz, uint16_t *y, int64_t y_stride, const int rows) {
    __m512 total[ROW_BLOCK];
    for (int m = 0; m < rows; m++) total[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < groups / 8; b++) {
        const uint16_t *super = sz + b * INT4_SUPER_UNITS;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)super));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(super + TILE)));
        for (int j = 0; j < 8; j++) {
            const int64_t g = 8 * b + j;
            __m512i dot[ROW_BLOCK];
            group_dots(xq, k, g, groups, w, rows, dot);
            const uint8_t *sub = int4_sub(sz, g);
            const __m512 dsc = _mm512_mul_ps(
                d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sub))));
            const __m512 low = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                       _mm_loadu_si128((const __m128i *)(sub + TILE)))));
            for (int m = 0; m < rows; m++) {
                const group_constants *cg = c + m * groups + g;
                /* dx sum (q - 8) xq + 8 sum(x): the rounding of x to xq weighs by q - 8,
                 * as in the plain loop, not by q. */
                const __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(cg->d),
                                                    _mm512_set1_ps(cg->offset8));
                total[m] = _mm512_fmadd_ps(part, dsc, total[m]);
                total[m] = _mm512_fnmadd_ps(_mm512_set1_ps(cg->sum), low, total[m]);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        _mm256_storeu_si256((__m256i *)(y + m * y_stride), (__m256i)_mm512_cvtneps_pbh(total[m]));
}
#else
static inline __attribute__((always_inline)) void tile_block(
    const int8_t *xq, int64_t k, const group_constants *c, int64_t groups, const uint8_t *w,
    const uint16_t *sz, uint16_t *y, int64_t y_stride, const int rows) {
    __m512 total[ROW_BLOCK];
    for (int m = 0; m < rows; m++) total[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i dot[ROW_BLOCK];
        group_dots(xq, k, g, groups, w, rows, dot);
        __m512 scale, zero;
        int4_scale_zero16(sz, g, &scale, &zero);
        for (int m = 0; m < rows; m++) {
            const group_constants *cg = c + m * groups + g;
            __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(cg->d),
                                          _mm512_set1_ps(-8.0f * cg->dsum));
            total[m] = _mm512_fmadd_ps(part, scale, total[m]);
            total[m] = _mm512_fmadd_ps(_mm512_set1_ps(cg->sum), zero, total[m]);
        }
    }
    for (int m = 0; m < rows; m++)
        _mm256_storeu_si256((__m256i *)(y + m * y_stride), (__m256i)_mm512_cvtneps_pbh(total[m]));
}
#endif
#define INT4_A8_KERNEL "avx512_vnni"

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* AVX2 has no vpdpbusd; vpmaddubsw multiplies the unsigned nibbles by the signed xq in
 * pairs into 16-bit sums, as llama.cpp's AVX2 loops do. Lane i of a step's 32 bytes holds
 * column i's K offsets 0 and 1 in its low nibbles and 2 and 3 in its high ones, so the
 * quantised x is stored in K order and broadcast a pair at a time. */
#define XQ_IN_K_ORDER 1
/* Rows per pass: each holds a 16-bit and two 32-bit sums and two fp32 totals in
 * registers. */
#define A8_PASS 4

static inline __attribute__((always_inline)) void rows_pass(
    const int8_t *xq, int64_t k, const group_constants *c, int64_t groups, const uint8_t *w,
    const uint16_t *sz, uint16_t *y, int64_t y_stride, const int rows) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    /* 16-bit lane i is column i: the even columns are the low halves of the 32-bit lanes,
     * the odd ones the high halves, and each is summed and scaled on its own. */
    __m256 even_total[A8_PASS], odd_total[A8_PASS];
    for (int m = 0; m < rows; m++) even_total[m] = odd_total[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        if (rows >= PREFETCH_ROWS)
            prefetch_ahead(w, g * (TILE * GROUP / 2), TILE * GROUP / 2,
                           groups * (TILE * GROUP / 2));
        __m256i even[A8_PASS], odd[A8_PASS];
        for (int m = 0; m < rows; m++) even[m] = odd[m] = _mm256_setzero_si256();
        const uint8_t *wg = w + g * (TILE * GROUP / 2);
        /* Four steps' 16-bit sums stay within 4 * 4 * 15 * 127 = 30480 < 2^15. */
        for (int four = 0; four < 2; four++) {
            __m256i acc[A8_PASS];
            for (int m = 0; m < rows; m++) acc[m] = _mm256_setzero_si256();
            for (int s = 4 * four; s < 4 * four + 4; s++) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(wg + 32 * s));
                const __m256i lo = _mm256_and_si256(bytes, nibble);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
                const int8_t *xs = xq + g * GROUP + 4 * s;
                for (int m = 0; m < rows; m++) {
                    int16_t pair01, pair23;
                    memcpy(&pair01, xs + m * k, 2);
                    memcpy(&pair23, xs + m * k + 2, 2);
                    const __m256i sum = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_set1_epi16(pair01)),
                        _mm256_maddubs_epi16(hi, _mm256_set1_epi16(pair23)));
                    acc[m] = _mm256_add_epi16(acc[m], sum);
                }
            }
            for (int m = 0; m < rows; m++) {
                even[m] = _mm256_add_epi32(even[m], _mm256_srai_epi32(_mm256_slli_epi32(acc[m], 16), 16));
                odd[m] = _mm256_add_epi32(odd[m], _mm256_srai_epi32(acc[m], 16));
            }
        }
        __m256 scale_even, scale_odd, zero_even, zero_odd;
        int4_scale_zero_even_odd(sz, g, &scale_even, &scale_odd, &zero_even, &zero_odd);
        for (int m = 0; m < rows; m++) {
            const group_constants *cg = c + m * groups + g;
            const __m256 d = _mm256_set1_ps(cg->d), offset = _mm256_set1_ps(-8.0f * cg->dsum);
            const __m256 sum = _mm256_set1_ps(cg->sum);
            const __m256 part_even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(even[m]), d, offset);
            const __m256 part_odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(odd[m]), d, offset);
            even_total[m] = _mm256_fmadd_ps(part_even, scale_even, even_total[m]);
            even_total[m] = _mm256_fmadd_ps(sum, zero_even, even_total[m]);
            odd_total[m] = _mm256_fmadd_ps(part_odd, scale_odd, odd_total[m]);
            odd_total[m] = _mm256_fmadd_ps(sum, zero_odd, odd_total[m]);
        }
    }
    for (int m = 0; m < rows; m++) {
        float e[8], o[8];
        _mm256_storeu_ps(e, even_total[m]);
        _mm256_storeu_ps(o, odd_total[m]);
        for (int j = 0; j < 8; j++) {
            y[m * y_stride + 2 * j] = to_bf16(e[j]);
            y[m * y_stride + 2 * j + 1] = to_bf16(o[j]);
        }
    }
}

/* `rows` (a constant in each caller) in passes of at most A8_PASS; each row's operations
 * are the same in any pass. */
static inline __attribute__((always_inline)) void tile_block(
    const int8_t *xq, int64_t k, const group_constants *c, int64_t groups, const uint8_t *w,
    const uint16_t *sz, uint16_t *y, int64_t y_stride, const int rows) {
    if (rows <= A8_PASS) {
        rows_pass(xq, k, c, groups, w, sz, y, y_stride, rows);
    } else {
        rows_pass(xq, k, c, groups, w, sz, y, y_stride, A8_PASS);
        rows_pass(xq + A8_PASS * k, k, c + A8_PASS * groups, groups, w, sz,
                  y + A8_PASS * y_stride, y_stride, rows - A8_PASS);
    }
}
#define INT4_A8_KERNEL "avx2"

#else

/* Portable version: one row's group is a call of its own, so that its sums are ordered
 * the same for blocks of any size. */
static __attribute__((noinline)) void row_group(const int32_t wq[GROUP][TILE], const int8_t *xg,
                                                const group_constants *cg,
                                                const float scale[TILE], const float zero[TILE],
                                                float total[TILE]) {
    int32_t dot[TILE] = {0};
    for (int j = 0; j < GROUP; j++)
        for (int i = 0; i < TILE; i++) dot[i] += wq[j][i] * xg[j];
    for (int i = 0; i < TILE; i++) {
        const float part = (float)dot[i] * cg->d - 8.0f * cg->dsum;
        total[i] += part * scale[i] + cg->sum * zero[i];
    }
}

static inline void tile_block(const int8_t *xq, int64_t k, const group_constants *c,
                              int64_t groups, const uint8_t *w, const uint16_t *sz, uint16_t *y,
                              int64_t y_stride, const int rows) {
    float total[ROW_BLOCK][TILE] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        /* wq[j] pairs with xq's j-th stored value: K offsets 0, 2, 1, 3 in each four. */
        int32_t wq[GROUP][TILE];
        const uint8_t *wg = w + g * (TILE * GROUP / 2);
        for (int s = 0; s < GROUP / 4; s++)
            for (int i = 0; i < TILE; i++)
                for (int e = 0; e < 2; e++) {
                    const uint8_t byte = wg[32 * s + 2 * i + e];
                    wq[4 * s + 2 * e][i] = byte & 15;
                    wq[4 * s + 2 * e + 1][i] = byte >> 4;
                }
        float scale[TILE], zero[TILE];
        for (int i = 0; i < TILE; i++) int4_scale_zero_at(sz, g, i, &scale[i], &zero[i]);
        for (int m = 0; m < rows; m++)
            row_group(wq, xq + m * k + g * GROUP, c + m * groups + g, scale, zero, total[m]);
    }
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < TILE; i++) y[m * y_stride + i] = to_bf16(total[m][i]);
}
#define INT4_A8_KERNEL "portable"

#endif

#ifndef XQ_IN_K_ORDER
#define XQ_IN_K_ORDER 0
#endif

const char *INT4_A8_KIND(void) { return INT4_A8_KERNEL; }

/* x [rows, x_stride] bf16 (k contiguous); w, sz as int4_matmul.c's; y [rows, n_out] bf16.
 * n_out % 16 == 0 and k % 32 == 0, checked by the caller. Returns 0, or 2 when out of
 * memory. */
int INT4_A8_BF16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                        const uint16_t *sz, uint16_t *y, int64_t rows, int64_t n_out, int64_t k) {
    const int64_t groups = k / GROUP, tiles = n_out / TILE;
    int8_t *xq;
    group_constants *c;
    if (quantise_rows(x, x_stride, rows, k, XQ_IN_K_ORDER, &xq, &c)) return 2;
    const int64_t tile_bytes = k * TILE / 2, tile_scales = groups * INT4_SCALE_UNITS;
#define BLOCK(n)                                                                           \
    tile_block(xq + m0 * k, k, c + m0 * groups, groups, w + t * tile_bytes, sz + t * tile_scales, \
               y + m0 * n_out + t * TILE, n_out, n)
    FOR_TILES_AND_ROW_BLOCKS(tiles, rows, BLOCK)
#undef BLOCK
    free(xq);
    free(c);
    return 0;
}
