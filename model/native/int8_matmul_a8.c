/* Grouped int8 weights times int8 activations for the CPU: y[M, N] = x[M, K] W[N, K]^T, x
 * bf16, y bf16 (a decoder layer) or fp32 (the logits), W in int8_matmul.c's tiled layout
 * (the same bytes: a layer can run on either).
 *
 * Each row of x is rounded to int8 in groups of 32 on entry (int8_rows.h), as llama.cpp
 * rounds a Q8_0 layer's activations. Per (row, column, group): dot = sum q xq, exact in
 * int32 (|dot| < 32 127 127 < 2^19, so exact in fp32 too); total += (dot dx) s, group by
 * group, in that order whatever the number of rows.
 *
 * A step's 32 bytes hold 16 columns' two K values each: widened to 16-bit, a broadcast
 * pair of xq (as two int16) multiplies them and vpmaddwd adds each column's two products
 * into its 32-bit lane, exactly, with no sign trick and no saturation (vpmaddubsw's
 * unsigned operand would need one: 2 127 127 fits 16 bits, 2 255 127 does not). AVX-512
 * VNNI's vpdpwssd does the multiply and the add for a whole step in one instruction; AVX2
 * (and AVX-512 builds without VNNI) take vpmaddwd and vpaddd per half step, against the
 * 3-5 instructions a weight the fp32 loop of int8_matmul.c spends widening it; other CPUs
 * a portable loop.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "int8_rows.h"
#include "tiles.h"

#define STEP_BYTES 32 /* a step: 16 columns, two K values each */

/* Each row's xq as int16 pairs: pair p of a row is its K values 2 p and 2 p + 1. */
static int32_t *pairs_of(const int8_t *xq, int64_t n) {
    int32_t *pairs = malloc(sizeof(int32_t) * (n > 1 ? n / 2 : 1));
    if (pairs != NULL)
        for (int64_t j = 0; j < n / 2; j++)
            pairs[j] = (int32_t)((uint32_t)(uint16_t)(int16_t)xq[2 * j] |
                                 (uint32_t)(uint16_t)(int16_t)xq[2 * j + 1] << 16);
    return pairs;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void tile_block(
    const int32_t *xp, int64_t k, const group_constants *c, int64_t groups, const uint8_t *w,
    const uint16_t *scales, void *y, int64_t y_stride, const int rows, const int f32_out) {
    __m512 total[ROW_BLOCK];
    for (int m = 0; m < rows; m++) total[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = w + g * TILE * GROUP;
        if (rows >= PREFETCH_ROWS) prefetch_ahead(w, g * TILE * GROUP, TILE * GROUP, groups * TILE * GROUP);
        __m512i dot[ROW_BLOCK];
        for (int m = 0; m < rows; m++) dot[m] = _mm512_setzero_si512();
        for (int p = 0; p < GROUP / 2; p++) {
            const __m512i w16 =
                _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wg + STEP_BYTES * p)));
            for (int m = 0; m < rows; m++)
                dot[m] = _mm512_dpwssd_epi32(
                    dot[m], w16, _mm512_set1_epi32(xp[m * (k / 2) + g * (GROUP / 2) + p]));
        }
        const __m512 scale =
            _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * TILE)));
        for (int m = 0; m < rows; m++) {
            const __m512 part =
                _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(c[m * groups + g].d));
            total[m] = _mm512_fmadd_ps(part, scale, total[m]);
        }
    }
    for (int m = 0; m < rows; m++) {
        float out[TILE];
        _mm512_storeu_ps(out, total[m]);
        for (int i = 0; i < TILE; i++) store(y, m * y_stride + i, out[i], !f32_out);
    }
}
#define INT8_A8_KERNEL "avx512_vnni"

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* The whole tile in one pass for up to WHOLE_TILE_ROWS rows: per step, 32 bytes widened to
 * 16-bit once for all the rows, then each row's broadcast pair of xq serves both halves
 * (one vpmaddwd and one add a half). One-row products of 2048 x 1536 took 0.25 -> 0.18 ms
 * against two passes of half a tile each (one thread, weights from memory), three rows
 * 0.39 -> 0.29, four about the same; at 5 and 8 rows in one pass, whose accumulators no
 * longer fit in registers, half tiles were 10% and 6% faster, and passes of three rows
 * (tile_block) faster still. With `prefetch`, asks for the weights ahead as tiles.h says. */
#define WHOLE_TILE_ROWS 4

static inline __attribute__((always_inline)) void whole_tile(
    const int32_t *xp, int64_t k, const group_constants *c, int64_t groups, const uint8_t *w,
    const uint16_t *scales, void *y, int64_t y_stride, const int rows, const int f32_out,
    const int prefetch) {
    __m256 total[WHOLE_TILE_ROWS][2];
    for (int m = 0; m < rows; m++) total[m][0] = total[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = w + g * TILE * GROUP;
        if (prefetch) prefetch_ahead(w, g * TILE * GROUP, TILE * GROUP, groups * TILE * GROUP);
        __m256i dot[WHOLE_TILE_ROWS][2];
        for (int m = 0; m < rows; m++) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
        for (int p = 0; p < GROUP / 2; p++) {
            const __m256i lo =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + STEP_BYTES * p)));
            const __m256i hi = _mm256_cvtepi8_epi16(
                _mm_loadu_si128((const __m128i *)(wg + STEP_BYTES * p + 16)));
            for (int m = 0; m < rows; m++) {
                const __m256i pair = _mm256_set1_epi32(xp[m * (k / 2) + g * (GROUP / 2) + p]);
                dot[m][0] = _mm256_add_epi32(dot[m][0], _mm256_madd_epi16(lo, pair));
                dot[m][1] = _mm256_add_epi32(dot[m][1], _mm256_madd_epi16(hi, pair));
            }
        }
        for (int half = 0; half < 2; half++) {
            const __m256 scale = _mm256_cvtph_ps(
                _mm_loadu_si128((const __m128i *)(scales + g * TILE + 8 * half)));
            for (int m = 0; m < rows; m++) {
                const __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[m][half]),
                                                  _mm256_set1_ps(c[m * groups + g].d));
                total[m][half] = _mm256_fmadd_ps(part, scale, total[m][half]);
            }
        }
    }
    for (int m = 0; m < rows; m++) {
        float out[TILE];
        _mm256_storeu_ps(out, total[m][0]);
        _mm256_storeu_ps(out + 8, total[m][1]);
        for (int i = 0; i < TILE; i++) store(y, m * y_stride + i, out[i], !f32_out);
    }
}

/* Whole tiles for rows m0 .. m0 + rows - 1 of a block; the first pass prefetches. */
static inline __attribute__((always_inline)) void whole_tile_from(
    const int32_t *xp, int64_t k, const group_constants *c, int64_t groups, const uint8_t *w,
    const uint16_t *scales, void *y, int64_t y_stride, const int m0, const int rows,
    const int f32_out) {
    whole_tile(xp + m0 * (k / 2), k, c + m0 * groups, groups, w, scales,
               (char *)y + m0 * y_stride * (f32_out ? 4 : 2), y_stride, rows, f32_out, m0 == 0);
}

/* Five to eight rows in whole-tile passes of three (3 + 2, 3 + 3, 3 + 3 + 1, 3 + 3 + 2): the
 * weights widened once a pass and each broadcast pair of xq serving both halves beat half
 * tiles, whose accumulators fit for all eight rows but which broadcast each pair twice. One
 * thread, 2048 x 1536 from cache, AVX-512 EPYC in the AVX2 build: 8 rows 0.56 -> 0.39 ms,
 * 128 rows 9.0 -> 6.4 ms, 5 rows 0.27 -> 0.25; passes of four (spilling) and of two were
 * slower than of three. */
static inline __attribute__((always_inline)) void tile_block(
    const int32_t *xp, int64_t k, const group_constants *c, int64_t groups, const uint8_t *w,
    const uint16_t *scales, void *y, int64_t y_stride, const int rows, const int f32_out) {
    if (rows <= WHOLE_TILE_ROWS) {
        whole_tile(xp, k, c, groups, w, scales, y, y_stride, rows, f32_out, 0);
        return;
    }
    whole_tile_from(xp, k, c, groups, w, scales, y, y_stride, 0, 3, f32_out);
    if (rows <= 6) {
        whole_tile_from(xp, k, c, groups, w, scales, y, y_stride, 3, rows - 3, f32_out);
        return;
    }
    whole_tile_from(xp, k, c, groups, w, scales, y, y_stride, 3, 3, f32_out);
    whole_tile_from(xp, k, c, groups, w, scales, y, y_stride, 6, rows - 6, f32_out);
}
#define INT8_A8_KERNEL "avx2"

#else

/* One row's group against a tile's 16 columns: the integer sums of q xq, then the scales.
 * A call of its own, so that its sums are ordered the same for blocks of any size. */
static __attribute__((noinline)) void row_group(const int32_t wq[GROUP][TILE], const int32_t *xp,
                                                float dx, const uint16_t *scale,
                                                float total[TILE]) {
    int32_t dot[TILE] = {0};
    for (int p = 0; p < GROUP / 2; p++) {
        const int32_t x0 = (int16_t)(xp[p] & 0xFFFF), x1 = (int16_t)((uint32_t)xp[p] >> 16);
        for (int i = 0; i < TILE; i++) dot[i] += wq[2 * p][i] * x0 + wq[2 * p + 1][i] * x1;
    }
    for (int i = 0; i < TILE; i++) total[i] += (float)dot[i] * dx * from_fp16(scale[i]);
}

static inline void tile_block(const int32_t *xp, int64_t k, const group_constants *c,
                              int64_t groups, const uint8_t *w, const uint16_t *scales, void *y,
                              int64_t y_stride, const int rows, const int f32_out) {
    float total[ROW_BLOCK][TILE] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        int32_t wq[GROUP][TILE];
        const int8_t *wg = (const int8_t *)w + g * TILE * GROUP;
        for (int p = 0; p < GROUP / 2; p++)
            for (int i = 0; i < TILE; i++)
                for (int e = 0; e < 2; e++) wq[2 * p + e][i] = wg[STEP_BYTES * p + 2 * i + e];
        for (int m = 0; m < rows; m++)
            row_group(wq, xp + m * (k / 2) + g * (GROUP / 2), c[m * groups + g].d,
                      scales + g * TILE, total[m]);
    }
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < TILE; i++) store(y, m * y_stride + i, total[m][i], !f32_out);
}
#define INT8_A8_KERNEL "portable"

#endif

const char *int8_matmul_a8_kind(void) { return INT8_A8_KERNEL; }
const char *int8_logits_a8_kind(void) { return INT8_A8_KERNEL; }

/* x [rows, x_stride] bf16; w, scales as int8_matmul.c's for n_out columns; y [rows, n_out]
 * bf16 or (f32_out) fp32. n_out % 16 == 0 and k % 32 == 0, checked by the caller.
 * Returns 0, or 2 when out of memory. */
static int int8_matmul_a8(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                          const uint16_t *scales, void *y, int64_t rows, int64_t n_out, int64_t k,
                          const int f32_out) {
    const int64_t groups = k / GROUP, tiles = n_out / TILE;
    const int64_t tile_bytes = groups * TILE * GROUP, tile_scales = groups * TILE;
    const int64_t width = f32_out ? 4 : 2;
    int8_t *xq;
    group_constants *c;
    if (quantise_rows(x, x_stride, rows, k, 1, &xq, &c)) return 2;
    int32_t *xp = pairs_of(xq, rows * k);
    free(xq);
    if (xp == NULL) {
        free(c);
        return 2;
    }
#define SINGLE(r)                                                                           \
    tile_block(xp + m0 * (k / 2), k, c + m0 * groups, groups, w + t * tile_bytes,            \
               scales + t * tile_scales, (char *)y + (m0 * n_out + t * TILE) * width, n_out, r, \
               f32_out)
    FOR_TILES_AND_ROW_BLOCKS(tiles, rows, SINGLE)
#undef SINGLE
    free(xp);
    free(c);
    return 0;
}

int int8_matmul_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                        const uint16_t *scales, uint16_t *y, int64_t rows, int64_t n_out,
                        int64_t k) {
    return int8_matmul_a8(x, x_stride, w, scales, y, rows, n_out, k, 0);
}

int int8_logits_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                        const uint16_t *scales, float *y, int64_t rows, int64_t n_out, int64_t k) {
    return int8_matmul_a8(x, x_stride, w, scales, y, rows, n_out, k, 1);
}
