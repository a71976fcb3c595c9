/* Attention over a paged KV cache, for the CPU, one query token per row: a decode, or one
 * query of a prefill chunk given its own length (its position + 1) and its sequence's table.
 *
 * Each (row, KV head) pair reads its keys and values in place, block by block through
 * the block table, once: scores for the query heads sharing that KV head, a softmax over
 * the sequence's own length, then the weighted sum of the values, all in fp32. Nothing is
 * gathered or padded, and a sequence's result depends on its own data alone, computed in
 * the same order whatever else is in the batch. Built at run time for the machine it runs
 * on (model/native/build.py). The pairs are shared among the calling thread's
 * OpenMP team: PyTorch's own, as the library links the libgomp PyTorch has loaded.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32

/* Softmax of s[0..len) in place. */
static void softmax(float *s, int64_t len) {
    float top = s[0], total = 0.0f;
    for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
    for (int64_t t = 0; t < len; t++) {
        s[t] = expf(s[t] - top);
        total += s[t];
    }
    for (int64_t t = 0; t < len; t++) s[t] /= total;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 32 bf16 as two fp32 vectors, the even elements and the odd ones: a shift and a mask,
 * where widening in order takes a conversion per 16. Query, keys and values are split the
 * same way, so dot products and weighted sums need no reordering until the output. */
static inline __attribute__((always_inline)) void split_bf16(const uint16_t *p, __m512 *even,
                                                             __m512 *odd) {
    const __m512i v = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* Lane t of the result is the sum of v[t]'s 16 lanes: halves added pairwise in four
 * rounds, in a fixed order. */
static inline __m512 sum_each(const __m512 v[16]) {
    __m512 r[8], s[4], u[2];
    for (int i = 0; i < 8; i++) /* 128-bit lanes: [a0 + a2, a1 + a3, b0 + b2, b1 + b3] */
        r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lane j: four partial sums of vector 4 i + j */
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* lane j: two partial sums each of vectors j, j + 4 (+ 8 i) */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88),
                                   _mm512_shuffle_ps(u[0], u[1], 0xDD));
    /* w's element 4 j + i holds vector 4 i + j */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, w);
}

/* acc += p v for one token's values, split as split_bf16 does. */
static inline __attribute__((always_inline)) void weigh_values(__m512 *acc, float p,
                                                               const uint16_t *v,
                                                               const int halves) {
    const __m512 weight = _mm512_set1_ps(p);
    __m512 even, odd;
    for (int c = 0; c < halves; c++) {
        split_bf16(v + 32 * c, &even, &odd);
        acc[2 * c] = _mm512_fmadd_ps(weight, even, acc[2 * c]);
        acc[2 * c + 1] = _mm512_fmadd_ps(weight, odd, acc[2 * c + 1]);
    }
}

/* One (sequence, KV head) pair with bf16 q, caches and output and head_dim = 32 halves
 * (halves a constant: 2 or 4), in registers: each query head's scores 16 tokens at a time,
 * then its weighted sum of the values in two interleaved sets of accumulators. */
static inline __attribute__((always_inline)) void pair_bf16(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
    int64_t len, int64_t block_size, int64_t block_stride, int64_t token_stride,
    int64_t group, float scale, float *scores, uint16_t *out, const int halves) {
    const int64_t head_dim = 32 * halves;
    for (int64_t g = 0; g < group; g++) {
        __m512 qe[4], qo[4], part[16];
        for (int c = 0; c < halves; c++) {
            split_bf16(q + g * head_dim + 32 * c, &qe[c], &qo[c]);
            qe[c] = _mm512_mul_ps(qe[c], _mm512_set1_ps(scale));
            qo[c] = _mm512_mul_ps(qo[c], _mm512_set1_ps(scale));
        }
        float *s = scores + g * len;
        int n = 0;
        for (int64_t b = 0, t = 0; t < len; b++) {
            const uint16_t *block = k_cache + table[b] * block_stride;
            for (int64_t i = 0; i < block_size && t < len; i++, t++) {
                __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps(), ke, ko;
                for (int c = 0; c < halves; c++) {
                    split_bf16(block + i * token_stride + 32 * c, &ke, &ko);
                    even = _mm512_fmadd_ps(qe[c], ke, even);
                    odd = _mm512_fmadd_ps(qo[c], ko, odd);
                }
                part[n++] = _mm512_add_ps(even, odd);
                if (n == 16) {
                    _mm512_storeu_ps(s + t - 15, sum_each(part));
                    n = 0;
                }
            }
        }
        if (n) {
            for (int j = n; j < 16; j++) part[j] = _mm512_setzero_ps();
            _mm512_mask_storeu_ps(s + len - n, (__mmask16)((1u << n) - 1), sum_each(part));
        }
        softmax(s, len);
        /* Two sets of accumulators, for even and odd tokens: one set's chain of dependent
         * adds would leave the FMA units waiting. */
        __m512 acc0[8], acc1[8];
        for (int c = 0; c < 2 * halves; c++) acc0[c] = acc1[c] = _mm512_setzero_ps();
        for (int64_t b = 0, t = 0; t < len; b++) {
            const uint16_t *block = v_cache + table[b] * block_stride;
            const int64_t count = len - t < block_size ? len - t : block_size;
            int64_t i = 0;
            for (; i + 1 < count; i += 2) {
                weigh_values(acc0, s[t + i], block + i * token_stride, halves);
                weigh_values(acc1, s[t + i + 1], block + (i + 1) * token_stride, halves);
            }
            if (i < count) weigh_values(acc0, s[t + i], block + i * token_stride, halves);
            t += count;
        }
        for (int c = 0; c < halves; c++) {
            float even[16], odd[16];
            _mm512_storeu_ps(even, _mm512_add_ps(acc0[2 * c], acc1[2 * c]));
            _mm512_storeu_ps(odd, _mm512_add_ps(acc0[2 * c + 1], acc1[2 * c + 1]));
            for (int j = 0; j < 16; j++) {
                out[g * head_dim + 32 * c + 2 * j] = to_bf16(even[j]);
                out[g * head_dim + 32 * c + 2 * j + 1] = to_bf16(odd[j]);
            }
        }
    }
}
#define FAST_PAIRS 1
#else
#define FAST_PAIRS 0
#endif

/* q [rows, q_row_stride] (each row's n_heads x head_dim contiguous); caches
 * [blocks, block_size, n_kv, head_dim]; block_tables [rows, table_stride]; out
 * [rows, n_heads, head_dim]. Returns 0, or 1 for shapes past the fixed buffers, 2 when
 * out of memory. */
static inline __attribute__((always_inline)) int paged_decode(
    const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, void *out,
    int64_t rows, int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t block_size,
    float scale, int bf16) {
    const int64_t group = n_heads / n_kv;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP) return 1;
    const int64_t token_stride = n_kv * head_dim, block_stride = block_size * token_stride;
    int64_t longest = 1;
    for (int64_t r = 0; r < rows; r++) longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    int failed = 0;

    /* One (sequence, KV head) pair per iteration, each whole on one thread. */
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * longest);
        float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], x[MAX_HEAD_DIM];
        failed = scores == NULL;
#pragma omp for schedule(static, 1)
        for (int64_t pair = 0; pair < rows * n_kv; pair++) {
            if (failed) continue;
            const int64_t r = pair / n_kv, h = pair % n_kv;
            const int64_t len = seq_lens[r], *table = block_tables + r * table_stride;
#if FAST_PAIRS
            if (bf16 && (head_dim == 64 || head_dim == 128)) {
                const uint16_t *qh = (const uint16_t *)q + r * q_row_stride + h * group * head_dim;
                const uint16_t *kh = (const uint16_t *)k_cache + h * head_dim;
                const uint16_t *vh = (const uint16_t *)v_cache + h * head_dim;
                uint16_t *oh = (uint16_t *)out + (r * n_heads + h * group) * head_dim;
                if (head_dim == 64)
                    pair_bf16(qh, kh, vh, table, len, block_size, block_stride, token_stride,
                              group, scale, scores, oh, 2);
                else
                    pair_bf16(qh, kh, vh, table, len, block_size, block_stride, token_stride,
                              group, scale, scores, oh, 4);
                continue;
            }
#endif
            for (int64_t g = 0; g < group; g++) {
                const int64_t first = r * q_row_stride + (h * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) qf[g][d] = load(q, first + d, bf16) * scale;
            }
            /* Blocks in table order, tokens in block order: no division per token. */
            for (int64_t b = 0, t = 0; t < len; b++) { /* scores: q . k per query head */
                const int64_t base = table[b] * block_stride + h * head_dim;
                for (int64_t i = 0; i < block_size && t < len; i++, t++) {
                    const int64_t first = base + i * token_stride;
                    for (int64_t d = 0; d < head_dim; d++) x[d] = load(k_cache, first + d, bf16);
                    for (int64_t g = 0; g < group; g++) {
                        float dot = 0.0f;
                        for (int64_t d = 0; d < head_dim; d++) dot += qf[g][d] * x[d];
                        scores[g * len + t] = dot;
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                softmax(scores + g * len, len);
                memset(acc[g], 0, sizeof(float) * head_dim);
            }
            for (int64_t b = 0, t = 0; t < len; b++) { /* the weighted sum of the values */
                const int64_t base = table[b] * block_stride + h * head_dim;
                for (int64_t i = 0; i < block_size && t < len; i++, t++) {
                    const int64_t first = base + i * token_stride;
                    for (int64_t d = 0; d < head_dim; d++) x[d] = load(v_cache, first + d, bf16);
                    for (int64_t g = 0; g < group; g++) {
                        const float p = scores[g * len + t];
                        for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * x[d];
                    }
                }
            }
            for (int64_t g = 0; g < group; g++) {
                const int64_t first = (r * n_heads + h * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) store(out, first + d, acc[g][d], bf16);
            }
        }
        free(scores);
    }
    return failed ? 2 : 0;
}

#define ARGS                                                                               \
    const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,         \
        const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,         \
        void *out, int64_t rows, int64_t n_heads, int64_t n_kv, int64_t head_dim,           \
        int64_t block_size, float scale
#define PASS                                                                               \
    q, q_row_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, rows,     \
        n_heads, n_kv, head_dim, block_size, scale

int paged_decode_bf16(ARGS) { return paged_decode(PASS, 1); }

/* Whether shapes fit the fixed buffers above, for callers that must know before writing. */
int paged_decode_fits(int64_t n_heads, int64_t n_kv, int64_t head_dim) {
    return head_dim <= MAX_HEAD_DIM && n_heads / n_kv <= MAX_GROUP;
}
int paged_decode_f32(ARGS) { return paged_decode(PASS, 0); }

/* Whether bf16 rows of this head size take the vectorised path above. */
int paged_decode_vectorised(int64_t head_dim) {
    return FAST_PAIRS && (head_dim == 64 || head_dim == 128);
}
