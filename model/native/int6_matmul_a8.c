/* 6-bit weights times int8 activations for the CPU: y[M, N] = x[M, K] W[N, K]^T, x bf16,
 * y bf16 (a decoder layer) or fp32 (the logits), W in int6_matmul.c's tiled layout (the
 * same bytes: a layer can run on either).
 *
 * Each row of x is rounded to int8 in groups of 32 on entry (int8_rows.h), as llama.cpp
 * rounds a Q6_K layer's activations (to Q8_K, one scale per 256; a scale per 32 here keeps
 * more). Per (row, column, group h of 32, sub-blocks 2h and 2h + 1 of 16):
 * t = sum_b c_b sum (q - 32) xq, exact in int32 (|t| < 2^24, so exact in fp32 too); then
 * part += t dx_h over the super-block's groups, total += part d, in that order whatever the
 * number of rows.
 *
 * AVX2: vpmaddubsw multiplies a step's unsigned q (0..63) by a broadcast pair of xq into
 * 16-bit sums, the -32 offset added as -32 times the eight xq's sum of two steps at once
 * (the sum's start: one broadcast where each step took one and an add); two steps' sums
 * stay within 2 * 4 * 32 * 127 = 32512 < 2^15, and 16-bit adds wrap, so the order of the
 * terms leaves the sum's bits as they were. vpmaddwd by c, masked to the even (odd) 16-bit
 * lanes, widens them to 32 bits and applies c at once: lane j holds column 2 j (2 j + 1).
 * AVX-512 builds without VNNI take the same loop; other CPUs a portable one.
 *
 * AVX-512 VNNI: a step's low and high nibble pairs of column i, 6 bits each, are put side
 * by side in 32-bit lane i (vpermt2w), four K in order, and vpdpbusd adds their products
 * with four xq to a sum that starts at -32 times the sub-block's xq sum; vpmulld applies c.
 * The sums are the AVX2 loop's, exact, and scaled in the same order: the two loops give
 * the same bits. From UNPACKED_ROWS rows on, each pair of tiles is unpacked once for all
 * blocks of rows (128 rows of [1536 x 8960]: 9.4 ms with bf16 products, 7.2 here).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "int8_rows.h"
#include "tiles.h"

#define SUPER 256
#define SUB 16
#define SUBS (SUPER / SUB)
#define SUB_BYTES 208
#define HIGH_BITS 128
#define SUB_SCALES 192
#define SUPER_BYTES (SUBS * SUB_BYTES)
#define STEPS_PER_SUPER (SUPER / 4)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

/* Word i of `lo` then word i of `hi` (i = 0..15, from word `first` of each): a step's
 * low-nibble pair and high-nibble pair of column i side by side, so that 32-bit lane i
 * holds column i's four K in order. */
static inline __m512i column_fours(const __m512i lo, const __m512i hi, const int first) {
    const __m512i order = _mm512_set_epi16(
        first + 47, first + 15, first + 46, first + 14, first + 45, first + 13, first + 44,
        first + 12, first + 43, first + 11, first + 42, first + 10, first + 41, first + 9,
        first + 40, first + 8, first + 39, first + 7, first + 38, first + 6, first + 37,
        first + 5, first + 36, first + 4, first + 35, first + 3, first + 34, first + 2,
        first + 33, first + 1, first + 32, first);
    return _mm512_permutex2var_epi16(lo, order, hi);
}

/* A sub-block's operands: q[s] (32-bit lane i: column i's four K of step s, unsigned) and
 * q[4] (lane i: column i's c). */
#define UNPACKED_PER_SUB 5

static inline __attribute__((always_inline)) void unpack_sub(const uint8_t *ws,
                                                             __m512i q[UNPACKED_PER_SUB]) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    /* The high bits of an even step sit 4 bits lower than an odd one's (int6_matmul.c). */
    const __m512i even_shift = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_setzero_si256(), 1);
    for (int u = 0; u < 2; u++) { /* steps 2 u and 2 u + 1 */
        const __m512i bytes = _mm512_loadu_si512((const void *)(ws + 64 * u));
        const __m512i tb = _mm512_sllv_epi16(
            _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(ws + HIGH_BITS + 32 * u))),
            even_shift);
        const __m512i lo =
            _mm512_or_si512(_mm512_and_si512(bytes, nibble), _mm512_and_si512(tb, top));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble),
                                           _mm512_and_si512(_mm512_srli_epi16(tb, 2), top));
        q[2 * u] = column_fours(lo, hi, 0);
        q[2 * u + 1] = column_fours(lo, hi, 16);
    }
    q[4] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ws + SUB_SCALES)));
}

/* `unpacked`: the tile's operands, unpack_sub's for each sub-block in order, or NULL to
 * unpack them here. */
static inline __attribute__((always_inline)) void tile_block_from(
    const int8_t *xq, const int16_t *offsets, int64_t k, const group_constants *c,
    int64_t supers, const uint8_t *w, const float *scales, void *y, int64_t y_stride,
    const int rows, const int f32_out, const __m512i *unpacked) {
    __m512 total[ROW_BLOCK];
    for (int m = 0; m < rows; m++) total[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < supers; g++) {
        __m512 part[ROW_BLOCK];
        __m512i t[ROW_BLOCK];
        for (int m = 0; m < rows; m++) part[m] = _mm512_setzero_ps();
        for (int b = 0; b < SUBS; b++) {
            __m512i q[UNPACKED_PER_SUB];
            if (unpacked != NULL) {
                for (int s = 0; s < UNPACKED_PER_SUB; s++)
                    q[s] = _mm512_load_si512(unpacked + (g * SUBS + b) * UNPACKED_PER_SUB + s);
            } else {
                const uint8_t *ws = w + g * SUPER_BYTES + b * SUB_BYTES;
                if (rows >= PREFETCH_ROWS)
                    prefetch_ahead(w, ws - w, SUB_BYTES, supers * SUPER_BYTES);
                unpack_sub(ws, q);
            }
            const int64_t at = g * SUPER + b * SUB; /* the sub-block's first K */
            for (int m = 0; m < rows; m++) {
                const int8_t *xs = xq + m * k + at;
                const int16_t *os = offsets + m * (k / 8) + at / 8;
                /* Starting from -32 times the sum of xq: the sum of (q - 32) xq, exact. */
                __m512i acc = _mm512_set1_epi32((int32_t)os[0] + os[1]);
                for (int s = 0; s < 4; s++) {
                    int32_t four;
                    memcpy(&four, xs + 4 * s, 4);
                    acc = _mm512_dpbusd_epi32(acc, q[s], _mm512_set1_epi32(four));
                }
                acc = _mm512_mullo_epi32(acc, q[4]);
                if (b % 2 == 0) {
                    t[m] = acc;
                } else {
                    const __m512 dx = _mm512_set1_ps(c[m * (k / GROUP) + at / GROUP].d);
                    part[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t[m], acc)),
                                              dx, part[m]);
                }
            }
        }
        const __m512 d = _mm512_loadu_ps(scales + g * TILE);
        for (int m = 0; m < rows; m++) total[m] = _mm512_fmadd_ps(part[m], d, total[m]);
    }
    for (int m = 0; m < rows; m++) {
        float out[TILE];
        _mm512_storeu_ps(out, total[m]);
        for (int i = 0; i < TILE; i++) store(y, m * y_stride + i, out[i], !f32_out);
    }
}

static inline __attribute__((always_inline)) void tile_block(
    const int8_t *xq, const int16_t *offsets, int64_t k, const group_constants *c,
    int64_t supers, const uint8_t *w, const float *scales, void *y, int64_t y_stride,
    const int rows, const int f32_out) {
    tile_block_from(xq, offsets, k, c, supers, w, scales, y, y_stride, rows, f32_out, NULL);
}

/* n tiles' operands into `buffer`, one tile after the other. */
static void unpack_tiles(const uint8_t *w, int64_t tile_bytes, int64_t supers, int n,
                         __m512i *buffer) {
    for (int i = 0; i < n; i++)
        for (int64_t sub = 0; sub < supers * SUBS; sub++) {
            if (sub % 4 == 0)
                prefetch_ahead(w + i * tile_bytes, sub * SUB_BYTES, 4 * SUB_BYTES, tile_bytes);
            unpack_sub(w + i * tile_bytes + sub * SUB_BYTES,
                       buffer + (i * supers * SUBS + sub) * UNPACKED_PER_SUB);
        }
}

/* From this many rows on, each pair of tiles is unpacked once, into a buffer of its own
 * thread, for all the blocks of rows. */
#define UNPACKED_ROWS 32
#define INT6_A8_KERNEL "avx512_vnni"

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Even (0x88) or odd (0xDD) columns of a tile's 16 fp32 in lane order j = 0..7. */
static inline __m256 split_columns(const float *p, const int odd) {
    const __m256 lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
    const __m256 mixed = odd ? _mm256_shuffle_ps(lo, hi, 0xDD) : _mm256_shuffle_ps(lo, hi, 0x88);
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(mixed), 0xD8));
}

static inline __attribute__((always_inline)) void tile_block(
    const int8_t *xq, const int16_t *offsets, int64_t k, const group_constants *c,
    int64_t supers, const uint8_t *w, const float *scales, void *y, int64_t y_stride,
    const int rows, const int f32_out) {
    const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const __m256i even_mask = _mm256_set1_epi32(0xFFFF);
    __m256 total[ROW_BLOCK][2];
    for (int m = 0; m < rows; m++) total[m][0] = total[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < supers; g++) {
        __m256 part[ROW_BLOCK][2];
        for (int m = 0; m < rows; m++) part[m][0] = part[m][1] = _mm256_setzero_ps();
        __m256i t[ROW_BLOCK][2];
        for (int b = 0; b < SUBS; b++) {
            const uint8_t *ws = w + g * SUPER_BYTES + b * SUB_BYTES;
            if (rows >= PREFETCH_ROWS) prefetch_ahead(w, ws - w, SUB_BYTES, supers * SUPER_BYTES);
            __m256i lo[4], hi[4];
            for (int u = 0; u < 2; u++) {
                const __m256i tb = _mm256_loadu_si256((const __m256i *)(ws + HIGH_BITS + 32 * u));
                for (int odd = 0; odd < 2; odd++) {
                    const int s = 2 * u + odd;
                    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(ws + 32 * s));
                    const __m256i lo_top = odd ? tb : _mm256_slli_epi16(tb, 4);
                    const __m256i hi_top = odd ? _mm256_srli_epi16(tb, 2) : _mm256_slli_epi16(tb, 2);
                    lo[s] = _mm256_or_si256(_mm256_and_si256(bytes, nibble),
                                            _mm256_and_si256(lo_top, top));
                    hi[s] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble),
                                            _mm256_and_si256(hi_top, top));
                }
            }
            const __m256i c16 = _mm256_cvtepi8_epi16(
                _mm_loadu_si128((const __m128i *)(ws + SUB_SCALES)));
            const __m256i c_even = _mm256_and_si256(c16, even_mask);
            const __m256i c_odd = _mm256_andnot_si256(even_mask, c16);
            const int64_t at = g * SUPER + b * SUB; /* the sub-block's first K */
            for (int m = 0; m < rows; m++) {
                const int8_t *xs = xq + m * k + at;
                const int16_t *os = offsets + m * (k / 8) + at / 8;
                __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
                for (int two = 0; two < 2; two++) {
                    __m256i acc = _mm256_set1_epi16(os[two]);
                    for (int s = 2 * two; s < 2 * two + 2; s++) {
                        int16_t pair01, pair23;
                        memcpy(&pair01, xs + 4 * s, 2);
                        memcpy(&pair23, xs + 4 * s + 2, 2);
                        const __m256i sum = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo[s], _mm256_set1_epi16(pair01)),
                            _mm256_maddubs_epi16(hi[s], _mm256_set1_epi16(pair23)));
                        acc = _mm256_add_epi16(acc, sum);
                    }
                    even = _mm256_add_epi32(even, _mm256_madd_epi16(acc, c_even));
                    odd = _mm256_add_epi32(odd, _mm256_madd_epi16(acc, c_odd));
                }
                if (b % 2 == 0) {
                    t[m][0] = even, t[m][1] = odd;
                } else {
                    const __m256 dx = _mm256_set1_ps(c[m * (k / GROUP) + at / GROUP].d);
                    part[m][0] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(_mm256_add_epi32(t[m][0], even)), dx, part[m][0]);
                    part[m][1] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(_mm256_add_epi32(t[m][1], odd)), dx, part[m][1]);
                }
            }
        }
        const __m256 d_even = split_columns(scales + g * TILE, 0);
        const __m256 d_odd = split_columns(scales + g * TILE, 1);
        for (int m = 0; m < rows; m++) {
            total[m][0] = _mm256_fmadd_ps(part[m][0], d_even, total[m][0]);
            total[m][1] = _mm256_fmadd_ps(part[m][1], d_odd, total[m][1]);
        }
    }
    for (int m = 0; m < rows; m++) {
        float even[8], odd[8];
        _mm256_storeu_ps(even, total[m][0]);
        _mm256_storeu_ps(odd, total[m][1]);
        for (int j = 0; j < 8; j++) {
            store(y, m * y_stride + 2 * j, even[j], !f32_out);
            store(y, m * y_stride + 2 * j + 1, odd[j], !f32_out);
        }
    }
}
#define INT6_A8_KERNEL "avx2"

#else

/* One row's sub-block against a tile's 16 columns: the integer sums of (q - 32) xq. A call
 * of its own, so that its sums are ordered the same for blocks of any size. */
static __attribute__((noinline)) void row_sub(const int32_t wq[SUB][TILE], const int8_t *xs,
                                              int32_t dot[TILE]) {
    for (int i = 0; i < TILE; i++) dot[i] = 0;
    for (int j = 0; j < SUB; j++)
        for (int i = 0; i < TILE; i++) dot[i] += wq[j][i] * xs[j];
}

static inline void tile_block(const int8_t *xq, const int16_t *offsets, int64_t k,
                              const group_constants *c, int64_t supers, const uint8_t *w,
                              const float *scales, void *y, int64_t y_stride, const int rows,
                              const int f32_out) {
    (void)offsets;
    float total[ROW_BLOCK][TILE] = {{0}};
    for (int64_t g = 0; g < supers; g++) {
        float part[ROW_BLOCK][TILE] = {{0}};
        int32_t t[ROW_BLOCK][TILE];
        for (int b = 0; b < SUBS; b++) {
            const uint8_t *ws = w + g * SUPER_BYTES + b * SUB_BYTES;
            int32_t wq[SUB][TILE];
            for (int s = 0; s < 4; s++)
                for (int i = 0; i < TILE; i++)
                    for (int e = 0; e < 2; e++) {
                        const int j = 2 * i + e;
                        const uint8_t byte = ws[32 * s + j];
                        const uint8_t tb = ws[HIGH_BITS + 32 * (s / 2) + j] >> (4 * (s & 1));
                        wq[4 * s + e][i] = ((byte & 15) | (tb & 3) << 4) - 32;
                        wq[4 * s + 2 + e][i] = ((byte >> 4) | ((tb >> 2) & 3) << 4) - 32;
                    }
            const int64_t at = g * SUPER + b * SUB;
            for (int m = 0; m < rows; m++) {
                int32_t dot[TILE];
                row_sub(wq, xq + m * k + at, dot);
                for (int i = 0; i < TILE; i++) {
                    const int32_t scaled = dot[i] * (int8_t)ws[SUB_SCALES + i];
                    if (b % 2 == 0) {
                        t[m][i] = scaled;
                    } else {
                        const float dx = c[m * (k / GROUP) + at / GROUP].d;
                        part[m][i] += (float)(t[m][i] + scaled) * dx;
                    }
                }
            }
        }
        for (int m = 0; m < rows; m++)
            for (int i = 0; i < TILE; i++) total[m][i] += part[m][i] * scales[g * TILE + i];
    }
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < TILE; i++) store(y, m * y_stride + i, total[m][i], !f32_out);
}
#define INT6_A8_KERNEL "portable"

#endif

const char *int6_matmul_a8_kind(void) { return INT6_A8_KERNEL; }
const char *int6_logits_a8_kind(void) { return INT6_A8_KERNEL; }

/* -32 times each eight xq's sum (|.| <= 32512), the offset of the q two steps' products
 * take. */
static void step_offsets(const int8_t *xq, int64_t n, int16_t *offsets) {
    for (int64_t j = 0; j < n / 8; j++) {
        int sum = 0;
        for (int i = 0; i < 8; i++) sum += xq[8 * j + i];
        offsets[j] = (int16_t)(-32 * sum);
    }
}

/* x [rows, x_stride] bf16; w, scales as int6_matmul.c's for n_out columns; y [rows, n_out]
 * bf16 or (f32_out) fp32. n_out % 16 == 0 and k % 256 == 0, checked by the caller.
 * Returns 0, or 2 when out of memory. */
static int int6_matmul_a8(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                          const float *scales, void *y, int64_t rows, int64_t n_out, int64_t k,
                          const int f32_out) {
    const int64_t supers = k / SUPER, tiles = n_out / TILE;
    const int64_t tile_bytes = supers * SUPER_BYTES, tile_scales = supers * TILE;
    const int64_t width = f32_out ? 4 : 2;
    int8_t *xq;
    group_constants *c;
    if (quantise_rows(x, x_stride, rows, k, 1, &xq, &c)) return 2;
    int16_t *offsets = malloc(sizeof(int16_t) * (rows > 0 ? rows : 1) * (k / 8));
    if (offsets == NULL) {
        free(xq);
        free(c);
        return 2;
    }
    step_offsets(xq, rows * k, offsets);
#ifdef UNPACKED_ROWS
    if (rows >= UNPACKED_ROWS) {
        int status = 0;
        const int64_t per_tile = supers * SUBS * UNPACKED_PER_SUB;
#define UNPACK unpack_tiles(w + t * tile_bytes, tile_bytes, supers, n, buffer)
#define FROM(r, i)                                                                          \
    tile_block_from(xq + m0 * k, offsets + m0 * (k / 8), k, c + m0 * (k / GROUP), supers,   \
                    w + (t + i) * tile_bytes, scales + (t + i) * tile_scales,               \
                    (char *)y + (m0 * n_out + (t + i) * TILE) * width, n_out, r, f32_out,    \
                    (const __m512i *)buffer + i * per_tile)
#define PAIR(r) FROM(r, 0); FROM(r, 1)
#define SINGLE(r) FROM(r, 0)
        FOR_UNPACKED_TILE_PAIRS(tiles, rows, sizeof(__m512i) * 2 * per_tile, status, UNPACK, PAIR,
                                SINGLE);
#undef SINGLE
#undef PAIR
#undef FROM
#undef UNPACK
        free(offsets);
        free(xq);
        free(c);
        return status;
    }
#endif
#define SINGLE(r)                                                                           \
    tile_block(xq + m0 * k, offsets + m0 * (k / 8), k, c + m0 * (k / GROUP), supers,         \
               w + t * tile_bytes, scales + t * tile_scales,                                 \
               (char *)y + (m0 * n_out + t * TILE) * width, n_out, r, f32_out)
    FOR_TILES_AND_ROW_BLOCKS(tiles, rows, SINGLE)
#undef SINGLE
    free(offsets);
    free(xq);
    free(c);
    return 0;
}

int int6_matmul_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                        const float *scales, uint16_t *y, int64_t rows, int64_t n_out,
                        int64_t k) {
    return int6_matmul_a8(x, x_stride, w, scales, y, rows, n_out, k, 0);
}

int int6_logits_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                        const float *scales, float *y, int64_t rows, int64_t n_out, int64_t k) {
    return int6_matmul_a8(x, x_stride, w, scales, y, rows, n_out, k, 1);
}
