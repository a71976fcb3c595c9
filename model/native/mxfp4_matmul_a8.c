/* MXFP4 weights times int8 activations for the CPU: y[M, N] = x[M, K] W[N, K]^T, W in
 * GGUF's MXFP4 blocks as mxfp4_matmul.c reads them (the same bytes: a layer can run on
 * either).
 *
 * Each row of x is rounded to int8 on entry, per block of 32 along K with one scale (as
 * llama.cpp's Q8_0: xq in -127..127, d = max |x| / 127). The E2M1 values doubled are the
 * integers 0, 1, 2, 3, 4, 6, 8, 12 with a sign, so a block's sum of w x is exactly the
 * int32 sum of xq times the doubled values, times d 2^(e - 128): integer dot products
 * (vpdpbusd takes 32 byte products per 256-bit instruction), where mxfp4_matmul.c's fp32
 * loop is compute-bound, at the cost of rounding x to 8 bits.
 *
 * vpdpbusd and vpmaddubsw multiply unsigned bytes by signed ones: the weights' magnitudes
 * are the unsigned side and their signs move to xq (vpsignb), as llama.cpp does. AVX-512
 * VNNI: vpdpbusd on 256-bit registers (one block). AVX2: vpmaddubsw, then vpmaddwd by
 * ones (the 16-bit pair sums stay within 2 * 12 * 127). Other CPUs: a portable loop. Each
 * row is quantised and summed alone, in the same order whatever the number of rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "mxfp4_block.h"

static const int8_t MX_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* One block of a row rounded to int8; returns its scale d. */
static inline float quantise_block(const float v[MX_BLOCK], int8_t *q) {
    float top = 0.0f;
    for (int j = 0; j < MX_BLOCK; j++) top = fmaxf(top, fabsf(v[j]));
    const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
    for (int j = 0; j < MX_BLOCK; j++) q[j] = (int8_t)nearbyintf(v[j] * inverse);
    return top / 127.0f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* A block's 32 doubled values as int8, in K order: low nibbles are weights 0-15. */
static inline __m256i block_weights(const uint8_t *block, __m128i table) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 1));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_shuffle_epi8(table, _mm_and_si128(bytes, nibble));
    const __m128i high = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    return _mm256_set_m128i(high, low);
}

static inline __m256i block_dot(__m256i magnitude, __m256i signed_x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), _mm256_set1_epi16(1));
}

/* One block of each row into its eight fp32 lanes (the AVX2 loop, and AVX-512's last
 * block when a row has an odd number). */
static inline __attribute__((always_inline)) void single_block(
    const int8_t *xq, const float *d, int64_t k, const uint8_t *block, int64_t b,
    int64_t blocks, __m256 *total, const int rows) {
    const __m128i table = _mm_loadu_si128((const __m128i *)MX_DOUBLED);
    const float scale = half_scale(block[0]);
    const __m256i wq = block_weights(block, table);
    const __m256i magnitude = _mm256_abs_epi8(wq);
    for (int m = 0; m < rows; m++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + m * k + b * MX_BLOCK));
        const __m256i dot = block_dot(magnitude, _mm256_sign_epi8(x, wq));
        const __m256 s = _mm256_set1_ps(d[m * blocks + b] * scale);
        total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, total[m]);
    }
}

static inline float sum_lanes(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
           ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* Two blocks a step: their 64 weights' magnitudes in K order in one register (nibbles
 * looked up by one vpshufb), their signs a mask that negates xq's bytes, one vpdpbusd;
 * lanes 0-7 sum the first block, 8-15 the second, each scaled by its own d 2^(e - 128). */
static inline __attribute__((always_inline)) void column_rows(
    const int8_t *xq, const float *d, int64_t k, const uint8_t *w, int64_t blocks, float *y,
    int64_t y_stride, const int rows) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX_DOUBLED));
    const __m512i nibble = _mm512_set1_epi8(0x0F), sign_bit = _mm512_set1_epi8(0x08);
    /* qwords of [low nibbles 0 | 1] and [high 0 | 1] to [low 0, high 0, low 1, high 1]. */
    const __m512i k_order = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 total[MX_ROWS];
    __m256 tail[MX_ROWS];
    for (int m = 0; m < rows; m++) total[m] = _mm512_setzero_ps(), tail[m] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < blocks; b += 2) {
        const uint8_t *first = w + b * MX_BYTES, *second = first + MX_BYTES;
        const __m256i bytes =
            _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(second + 1)),
                             _mm_loadu_si128((const __m128i *)(first + 1)));
        const __m512i wide = _mm512_castsi256_si512(bytes);
        const __m512i nibbles = _mm512_and_si512(
            _mm512_permutex2var_epi64(wide, k_order, _mm512_srli_epi16(wide, 4)), nibble);
        const __m512i magnitude = _mm512_shuffle_epi8(table, _mm512_and_si512(nibbles,
                                                      _mm512_set1_epi8(0x07)));
        const __mmask64 negative = _mm512_test_epi8_mask(nibbles, sign_bit);
        const __m128 scales = _mm_set_ps(0.0f, 0.0f, half_scale(second[0]), half_scale(first[0]));
        for (int m = 0; m < rows; m++) {
            const __m512i x = _mm512_loadu_si512(xq + m * k + b * MX_BLOCK);
            const __m512i signed_x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, signed_x);
            const __m128 dm = _mm_castpd_ps(_mm_load_sd((const double *)(d + m * blocks + b)));
            const __m512 s = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_mul_ps(dm, scales)));
            total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, total[m]);
        }
    }
    if (b < blocks) single_block(xq, d, k, w + b * MX_BYTES, b, blocks, tail, rows);
    for (int m = 0; m < rows; m++) {
        const __m256 folded = _mm256_add_ps(_mm512_castps512_ps256(total[m]),
                                            _mm512_extractf32x8_ps(total[m], 1));
        y[m * y_stride] = sum_lanes(_mm256_add_ps(folded, tail[m]));
    }
}
#define MXFP4_A8_KERNEL "avx512_vnni"

#else
static inline __attribute__((always_inline)) void column_rows(
    const int8_t *xq, const float *d, int64_t k, const uint8_t *w, int64_t blocks, float *y,
    int64_t y_stride, const int rows) {
    __m256 total[MX_ROWS];
    for (int m = 0; m < rows; m++) total[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++)
        single_block(xq, d, k, w + b * MX_BYTES, b, blocks, total, rows);
    for (int m = 0; m < rows; m++) y[m * y_stride] = sum_lanes(total[m]);
}
#define MXFP4_A8_KERNEL "avx2"
#endif

#else

/* One row's block: a call of its own, so that it is ordered the same for every row. */
static __attribute__((noinline)) int32_t block_dot(const int8_t wb[MX_BLOCK], const int8_t *xb) {
    int32_t sum = 0;
    for (int j = 0; j < MX_BLOCK; j++) sum += (int32_t)wb[j] * xb[j];
    return sum;
}

static inline void column_rows(const int8_t *xq, const float *d, int64_t k, const uint8_t *w,
                               int64_t blocks, float *y, int64_t y_stride, const int rows) {
    float total[MX_ROWS] = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = w + b * MX_BYTES;
        const float scale = half_scale(block[0]);
        int8_t wb[MX_BLOCK];
        for (int j = 0; j < MX_BLOCK / 2; j++) {
            wb[j] = MX_DOUBLED[block[1 + j] & 15];
            wb[j + MX_BLOCK / 2] = MX_DOUBLED[block[1 + j] >> 4];
        }
        for (int m = 0; m < rows; m++)
            total[m] += (float)block_dot(wb, xq + m * k + b * MX_BLOCK) * (d[m * blocks + b] * scale);
    }
    for (int m = 0; m < rows; m++) y[m * y_stride] = total[m];
}
#define MXFP4_A8_KERNEL "portable"

#endif

const char *mxfp4_matmul_a8_kind(void) { return MXFP4_A8_KERNEL; }

/* Rows first..end of the quantised x against one column's weight row, MX_ROWS at a time. */
static void column(const int8_t *xq, const float *d, int64_t k, const uint8_t *wn,
                   int64_t blocks, float *y, int64_t n_out, int64_t first, int64_t end) {
    for (int64_t m0 = first; m0 < end; m0 += MX_ROWS) {
        const int8_t *xm = xq + m0 * k;
        const float *dm = d + m0 * blocks;
        float *ym = y + m0 * n_out;
        switch (end - m0 < MX_ROWS ? end - m0 : MX_ROWS) {
        case 1: column_rows(xm, dm, k, wn, blocks, ym, n_out, 1); break;
        case 2: column_rows(xm, dm, k, wn, blocks, ym, n_out, 2); break;
        case 3: column_rows(xm, dm, k, wn, blocks, ym, n_out, 3); break;
        default: column_rows(xm, dm, k, wn, blocks, ym, n_out, MX_ROWS);
        }
    }
}

/* x quantised: xq [rows, k], d [rows, k / 32]; y [rows, n_out] fp32. */
static void quantised_matmul(const int8_t *xq, const float *d, const uint8_t *w, float *y,
                             int64_t rows, int64_t n_out, int64_t k) {
    const int64_t blocks = k / MX_BLOCK, row_bytes = blocks * MX_BYTES;
    const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE;
#pragma omp parallel for collapse(2) schedule(static) if (rows * n_out * k >= (1 << 18))
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t n = 0; n < n_out; n++) {
            const int64_t end = (t + 1) * ROW_TILE < rows ? (t + 1) * ROW_TILE : rows;
            column(xq, d, k, w + n * row_bytes, blocks, y + n, n_out, t * ROW_TILE, end);
        }
}

/* x [rows, x_stride] fp32 or bf16 (`bf16`), k contiguous; w [n_out, k / 32 * 17] GGUF
 * MXFP4 blocks; y [rows, n_out] fp32 or bf16 as x. k % 32 == 0, checked by the caller.
 * Returns 0, or 2 when out of memory. */
static int matmul_a8(const void *x, int64_t x_stride, int bf16, const uint8_t *w, void *y,
                     int64_t rows, int64_t n_out, int64_t k) {
    const int64_t blocks = k / MX_BLOCK, n = rows > 0 ? rows : 1;
    int8_t *xq = malloc((size_t)(n * k));
    float *d = malloc(sizeof(float) * n * blocks);
    float *yf = bf16 ? malloc(sizeof(float) * n * n_out) : y;
    if (xq == NULL || d == NULL || yf == NULL) {
        free(xq);
        free(d);
        if (bf16) free(yf);
        return 2;
    }
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < blocks; b++) {
            float v[MX_BLOCK];
            const int64_t at = m * x_stride + b * MX_BLOCK;
            for (int j = 0; j < MX_BLOCK; j++)
                v[j] = bf16 ? from_bf16(((const uint16_t *)x)[at + j]) : ((const float *)x)[at + j];
            d[m * blocks + b] = quantise_block(v, xq + m * k + b * MX_BLOCK);
        }
    quantised_matmul(xq, d, w, yf, rows, n_out, k);
    if (bf16) {
        for (int64_t i = 0; i < rows * n_out; i++) ((uint16_t *)y)[i] = to_bf16(yf[i]);
        free(yf);
    }
    free(xq);
    free(d);
    return 0;
}

int mxfp4_matmul_a8_f32(const float *x, int64_t x_stride, const uint8_t *w, float *y,
                        int64_t rows, int64_t n_out, int64_t k) {
    return matmul_a8(x, x_stride, 0, w, y, rows, n_out, k);
}

/* The C decoder layer's and experts' call: bf16 x and y, each output rounded once. */
int mxfp4_matmul_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, uint16_t *y,
                         int64_t rows, int64_t n_out, int64_t k) {
    return matmul_a8(x, x_stride, 1, w, y, rows, n_out, k);
}
