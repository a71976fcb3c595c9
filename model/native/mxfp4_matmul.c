/* MXFP4 weights times float activations for the CPU: y[M, N] = x[M, K] W[N, K]^T, W in
 * GGUF's own blocks as the file stores them (model/checkpoint/mxfp4.py): per 32 weights a
 * scale byte e and 16 bytes whose byte j holds weight j (low nibble) and j + 16 (high).
 *
 * The weights are decoded in registers, never to memory: a nibble indexes the E2M1 values
 * doubled (ggml's kvalues_mxfp4), times the halved scale 2^(e - 128). Both factors are
 * exact in fp32 and so is their product, so the result is the dequantised weight's product
 * within fp32's rounding of the sums. Activations stay in fp32 (bf16 ones are widened,
 * exactly, or summed by dpbf16 where mxfp4_dpbf16.h's loop is built): rounding them to
 * int8 as llama.cpp does would move the result by more than that.
 *
 * AVX-512: one vpermps looks up 16 nibbles in the 16-entry table at once. AVX2: vpermps
 * takes 8 entries, so the low 3 bits pick the magnitude and bit 3 is moved to the sign.
 * Other CPUs: a portable loop. Each output is one row's dot product over one weight row,
 * in the same order whatever the number of rows: rows are computed alone.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "mxfp4_block.h"
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include "mxfp4_dpbf16.h"
#define MXFP4_DPBF16 1
#endif

static const float MX_DOUBLED[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void column_rows(
    const float *x, int64_t x_stride, const uint8_t *w, int64_t blocks, float *y,
    int64_t y_stride, const int rows) {
    const __m512 table = _mm512_loadu_ps(MX_DOUBLED);
    __m512 first[MX_ROWS], second[MX_ROWS];
    for (int m = 0; m < rows; m++) first[m] = second[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = w + b * MX_BYTES;
        const __m512 scale = _mm512_set1_ps(half_scale(block[0]));
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 1)));
        /* vpermps reads the index's low 4 bits: the low nibble as it is. */
        const __m512 low = _mm512_mul_ps(_mm512_permutexvar_ps(q, table), scale);
        const __m512 high =
            _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), scale);
        for (int m = 0; m < rows; m++) {
            const float *xb = x + m * x_stride + b * MX_BLOCK;
            first[m] = _mm512_fmadd_ps(low, _mm512_loadu_ps(xb), first[m]);
            second[m] = _mm512_fmadd_ps(high, _mm512_loadu_ps(xb + 16), second[m]);
        }
    }
    for (int m = 0; m < rows; m++)
        y[m * y_stride] = _mm512_reduce_add_ps(_mm512_add_ps(first[m], second[m]));
}
#define MXFP4_KERNEL "avx512"

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Eight weights from eight nibbles (as 32-bit lanes): the magnitude by the low 3 bits
 * (vpermps ignores the rest), bit 3 moved to the sign. */
static inline __m256 eight_weights(__m128i nibbles, __m256 magnitudes, __m256 scale) {
    const __m256i idx = _mm256_cvtepu8_epi32(nibbles);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
    const __m256 w = _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, idx),
                                   _mm256_castsi256_ps(sign));
    return _mm256_mul_ps(w, scale);
}

static inline __attribute__((always_inline)) void column_rows(
    const float *x, int64_t x_stride, const uint8_t *w, int64_t blocks, float *y,
    int64_t y_stride, const int rows) {
    const __m256 magnitudes = _mm256_loadu_ps(MX_DOUBLED);
    const __m128i nibble = _mm_set1_epi8(0x0F);
    __m256 even[MX_ROWS], odd[MX_ROWS];
    for (int m = 0; m < rows; m++) even[m] = odd[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = w + b * MX_BYTES;
        const __m256 scale = _mm256_set1_ps(half_scale(block[0]));
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 1));
        const __m128i low = _mm_and_si128(bytes, nibble);
        const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        /* Weights 0-7, 8-15 (low nibbles), 16-23, 24-31 (high ones). */
        const __m256 w0 = eight_weights(low, magnitudes, scale);
        const __m256 w1 = eight_weights(_mm_srli_si128(low, 8), magnitudes, scale);
        const __m256 w2 = eight_weights(high, magnitudes, scale);
        const __m256 w3 = eight_weights(_mm_srli_si128(high, 8), magnitudes, scale);
        for (int m = 0; m < rows; m++) {
            const float *xb = x + m * x_stride + b * MX_BLOCK;
            even[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb), even[m]);
            odd[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), odd[m]);
            even[m] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), even[m]);
            odd[m] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), odd[m]);
        }
    }
    for (int m = 0; m < rows; m++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(even[m], odd[m]));
        y[m * y_stride] = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                          ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    }
}
#define MXFP4_KERNEL "avx2"

#else

/* One row's sum over one decoded block: a call of its own, so that fast math orders it
 * the same for every row. */
static __attribute__((noinline)) float block_dot(const float wb[MX_BLOCK], const float *xb) {
    float sum = 0.0f;
    for (int j = 0; j < MX_BLOCK; j++) sum += wb[j] * xb[j];
    return sum;
}

static inline void column_rows(const float *x, int64_t x_stride, const uint8_t *w,
                               int64_t blocks, float *y, int64_t y_stride, const int rows) {
    float total[MX_ROWS] = {0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = w + b * MX_BYTES;
        const float scale = half_scale(block[0]);
        float wb[MX_BLOCK];
        for (int j = 0; j < MX_BLOCK / 2; j++) {
            wb[j] = MX_DOUBLED[block[1 + j] & 15] * scale;
            wb[j + MX_BLOCK / 2] = MX_DOUBLED[block[1 + j] >> 4] * scale;
        }
        for (int m = 0; m < rows; m++) total[m] += block_dot(wb, x + m * x_stride + b * MX_BLOCK);
    }
    for (int m = 0; m < rows; m++) y[m * y_stride] = total[m];
}
#define MXFP4_KERNEL "portable"

#endif

/* The loop of fp32 rows, and that of bf16 ones (mxfp4_dpbf16.h's where it is built). */
const char *mxfp4_matmul_kind(void) { return MXFP4_KERNEL; }
#ifdef MXFP4_DPBF16
const char *mxfp4_matmul_bf16_kind(void) { return "avx512_bf16"; }
#else
const char *mxfp4_matmul_bf16_kind(void) { return MXFP4_KERNEL; }
#endif

/* Rows first..end of x against one column's weight row, MX_ROWS at a time. */
static void column(const float *x, int64_t x_stride, const uint8_t *wn, int64_t blocks,
                   float *y, int64_t n_out, int64_t first, int64_t end) {
    for (int64_t m0 = first; m0 < end; m0 += MX_ROWS) {
        const float *xm = x + m0 * x_stride;
        float *ym = y + m0 * n_out;
        switch (end - m0 < MX_ROWS ? end - m0 : MX_ROWS) {
        case 1: column_rows(xm, x_stride, wn, blocks, ym, n_out, 1); break;
        case 2: column_rows(xm, x_stride, wn, blocks, ym, n_out, 2); break;
        case 3: column_rows(xm, x_stride, wn, blocks, ym, n_out, 3); break;
        default: column_rows(xm, x_stride, wn, blocks, ym, n_out, MX_ROWS);
        }
    }
}

/* x [rows, x_stride] fp32 (k contiguous); w [n_out, k / 32 * 17] GGUF MXFP4 blocks; y
 * [rows, n_out] fp32. k % 32 == 0, checked by the caller. Returns 0. */
int mxfp4_matmul_f32(const float *x, int64_t x_stride, const uint8_t *w, float *y,
                     int64_t rows, int64_t n_out, int64_t k) {
    const int64_t blocks = k / MX_BLOCK, row_bytes = blocks * MX_BYTES;
    const int64_t tiles = (rows + ROW_TILE - 1) / ROW_TILE;
    /* A tile of x's rows (32 rows of 2880 fp32: 368 KB, within L2) passes every column's
     * weight row, so a long prefill reads the weights once per tile rather than x once per
     * column; a decode's one tile has its columns shared among the threads. */
#pragma omp parallel for collapse(2) schedule(static) if (rows * n_out * k >= (1 << 18))
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t n = 0; n < n_out; n++) {
            const int64_t end = (t + 1) * ROW_TILE < rows ? (t + 1) * ROW_TILE : rows;
            column(x, x_stride, w + n * row_bytes, blocks, y + n, n_out, t * ROW_TILE, end);
        }
    return 0;
}

/* As mxfp4_matmul_f32 with bf16 x and y (the C decoder layer's and experts' rows), each
 * output rounded once: with AVX-512 BF16 and VBMI, mxfp4_dpbf16.h's loop; else x widened
 * exactly for the fp32 one. Returns 0, or 2 when out of memory. */
int mxfp4_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, uint16_t *y,
                      int64_t rows, int64_t n_out, int64_t k) {
#ifdef MXFP4_DPBF16
    return mxfp4_dpbf16(x, x_stride, w, y, rows, n_out, k);
#else
    const int64_t n = rows > 0 ? rows : 1;
    float *xf = malloc(sizeof(float) * n * k), *yf = malloc(sizeof(float) * n * n_out);
    if (xf == NULL || yf == NULL) {
        free(xf);
        free(yf);
        return 2;
    }
    for (int64_t m = 0; m < rows; m++)
        for (int64_t i = 0; i < k; i++) xf[m * k + i] = from_bf16(x[m * x_stride + i]);
    mxfp4_matmul_f32(xf, k, w, yf, rows, n_out, k);
    for (int64_t i = 0; i < rows * n_out; i++) y[i] = to_bf16(yf[i]);
    free(xf);
    free(yf);
    return 0;
#endif
}
