/* paged_decode_int8.c's vectorised path with AVX2 and FMA (8 fp32 lanes), head_dim 64 or
 * 128 (8 `chunks` of 8 or 16), on CPUs without AVX-512: `int8_scores` and `int8_values`,
 * which its `pair_int8_fast` calls, beside paged_pairs_avx2.h's `sum_each8`, `first_lanes`
 * and `exponentiate`. Included by paged_decode_int8.c alone, after its `slot_scale`, where
 * the compiler targets AVX2 but not AVX-512.
 *
 * The AVX-512 path's shape at half the width (paged_int8_avx512.h says why): 8 keys a run,
 * widened to fp32 once for every query head, their 8 sums reduced at once; values 16
 * elements of the head at a time, each widened once for up to 4 query heads. */
#ifndef LLAMASERVE_PAGED_INT8_AVX2_H
#define LLAMASERVE_PAGED_INT8_AVX2_H

#include <immintrin.h>
#include <stdint.h>

#define INT8_RUN 8
#define INT8_HEADS_AT_ONCE(chunks) 4

/* 8 int8 as 8 fp32, in order. */
static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* scores[g * len + t] = scale_k(t) (qf_g . k_t) for the `group` query heads of qf (already
 * times the attention scale) sharing one KV head: keys 8 at a time, widened once into
 * `wide` for every head in turn; a run past the sequence's end repeats its last key and
 * stores only the lanes before the end. */
static inline __attribute__((always_inline)) void int8_scores(
    float qf[][MAX_HEAD_DIM], const int8_t *k_cache, const int64_t *table, int64_t len,
    int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t group,
    float *scores, const int chunks) {
    const int64_t head_dim = 8 * chunks;
    float wide[INT8_RUN][128] __attribute__((aligned(32)));
    float key_scales[INT8_RUN];
    for (int64_t t = 0, b = 0, i = 0; t < len; t += INT8_RUN) {
        for (int j = 0; j < INT8_RUN; j++) { /* the keys of tokens t + j, in block b, at i */
            const int8_t *key = k_cache + table[b] * block_stride + i * token_stride;
            for (int c = 0; c < chunks; c++) _mm256_store_ps(wide[j] + 8 * c, widen8(key + 8 * c));
            key_scales[j] = slot_scale(key, head_dim);
            if (t + j + 1 < len && ++i == block_size) {
                b++;
                i = 0;
            }
        }
        const __m256i valid = first_lanes(len - t < 8 ? len - t : 8);
        const __m256 scale = _mm256_loadu_ps(key_scales);
        for (int64_t g = 0; g < group; g++) {
            __m256 part[INT8_RUN];
            for (int j = 0; j < INT8_RUN; j++)
                part[j] = _mm256_mul_ps(_mm256_load_ps(wide[j]), _mm256_loadu_ps(qf[g]));
            for (int c = 1; c < chunks; c++) {
                const __m256 q = _mm256_loadu_ps(qf[g] + 8 * c);
                for (int j = 0; j < INT8_RUN; j++)
                    part[j] = _mm256_fmadd_ps(_mm256_load_ps(wide[j] + 8 * c), q, part[j]);
            }
            _mm256_maskstore_ps(scores + g * len + t, valid, _mm256_mul_ps(sum_each8(part), scale));
        }
    }
}

/* acc[h] = inverse_total[h] sum over t of p[h][t] v_t for `heads` query heads (a constant)
 * sharing the values (p: `heads` rows of `len`, each weight already times its value's
 * scale), 16 elements of the head at a time: each token's 16 widened once for all the
 * heads, each (head, element) summing its tokens in order in one lane. */
static inline __attribute__((always_inline)) void int8_values(
    const float *p, const float *inverse_total, const int8_t *v_cache, const int64_t *table,
    int64_t len, int64_t block_size, int64_t block_stride, int64_t token_stride,
    float acc_out[][MAX_HEAD_DIM], const int heads, const int chunks) {
    for (int64_t c = 0; c < 8 * chunks; c += 16) {
        __m256 acc[7][2]; /* room for paged_decode_int8.c's largest case; 4 are used */
        for (int h = 0; h < heads; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        for (int64_t b = 0, t = 0; t < len; b++) {
            const int8_t *block = v_cache + table[b] * block_stride + c;
            for (int64_t i = 0; i < block_size && t < len; i++, t++) {
                const __m256 low = widen8(block + i * token_stride);
                const __m256 high = widen8(block + i * token_stride + 8);
                for (int h = 0; h < heads; h++) {
                    const __m256 weight = _mm256_set1_ps(p[h * len + t]);
                    acc[h][0] = _mm256_fmadd_ps(weight, low, acc[h][0]);
                    acc[h][1] = _mm256_fmadd_ps(weight, high, acc[h][1]);
                }
            }
        }
        for (int h = 0; h < heads; h++) {
            const __m256 norm = _mm256_set1_ps(inverse_total[h]);
            _mm256_storeu_ps(acc_out[h] + c, _mm256_mul_ps(acc[h][0], norm));
            _mm256_storeu_ps(acc_out[h] + c + 8, _mm256_mul_ps(acc[h][1], norm));
        }
    }
}

#endif
