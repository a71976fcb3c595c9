/* paged_decode.c's vectorised path with AVX2 and FMA (8 fp32 lanes) for bf16 q, caches
 * and output, head_dim 64 or 128, on CPUs without AVX-512 (the AVX2-only EPYCs):
 * `group_scores`, `exponentiate` and `heads_values`, which paged_decode.c's `pair_bf16`
 * calls. Included by paged_decode.c (and, for `sum_each8`, `first_lanes` and
 * `exponentiate`, by paged_decode_int8.c), where the compiler targets AVX2 but not
 * AVX-512.
 *
 * The generic loop the compiler vectorises took about twice SDPA's time for a 512-token
 * prefill here: every score a dot product reduced across lanes on its own, every value
 * widened once per query head. This path takes the AVX-512 one's shape at half the width:
 * 8 keys a run, widened to fp32 once for every query head of the KV head, their 8 sums
 * reduced at once; exponentials inline; each value widened once for up to 4 query heads.
 * A score, an exponential and an output element are each computed in one order, fixed by
 * the sequence's own length, so a decode and a prefill's query get the same bits. */
#ifndef LLAMASERVE_PAGED_PAIRS_AVX2_H
#define LLAMASERVE_PAGED_PAIRS_AVX2_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* 16 bf16 as two fp32 vectors, the even elements and the odd ones (a shift and a mask);
 * dot products and weighted sums need no reordering until the output. */
static inline __attribute__((always_inline)) void split_bf16x16(const uint16_t *p, __m256 *even,
                                                                __m256 *odd) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    *odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* Lane j of the result is the sum of v[j]'s 8 lanes, in a fixed order. */
static inline __m256 sum_each8(const __m256 v[8]) {
    /* hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] */
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* ab = [v0 0..3, v1 0..3, v2 0..3, v3 0..3 | v0 4..7, ...]: low halves plus high */
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20),
                         _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* e^x for x <= 0, within about an ulp: x = n ln 2 + r, e^r by Cephes's expf polynomial,
 * times 2^n built in the exponent field (n >= -126 after the clamp: a normal number). */
static inline __m256 exp_negative8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}

/* The first `count` (0..8) lanes set, as maskload and maskstore read a mask. */
static inline __m256i first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* s[t] = e^(s[t] - top) for t < len, top the largest of them and `sink`; returns their sum
 * plus e^(sink - top), an attention sink's share of the denominator (-INFINITY: none). */
static inline float exponentiate(float *s, int64_t len, float sink) {
    float top = sink;
    for (int64_t t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
    const __m256 shift = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp_negative8(_mm256_sub_ps(_mm256_loadu_ps(s + t), shift));
        _mm256_storeu_ps(s + t, e);
        total = _mm256_add_ps(total, e);
    }
    if (t < len) {
        const __m256i tail = first_lanes(len - t);
        const __m256 e = exp_negative8(_mm256_sub_ps(_mm256_maskload_ps(s + t, tail), shift));
        _mm256_maskstore_ps(s + t, tail, e);
        total = _mm256_add_ps(total, _mm256_and_ps(e, _mm256_castsi256_ps(tail)));
    }
    return sum_lanes(total) + expf(sink - top);
}

/* scores[g * len + t] = scale q_g . k_t for the `group` query heads of q (head_dim = 32
 * halves) sharing one KV head: keys 8 at a time, each widened once into `wide` (even
 * elements, then odd, per 16) for every head in turn; a run past the sequence's end
 * repeats its last key and stores only the lanes before the end. */
static inline __attribute__((always_inline)) void group_scores(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
    int64_t len, int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t group,
    float scale, float *scores, int prefetch, const int halves) {
    (void)v_cache, (void)prefetch; /* the next 8 keys are one block's neighbours */
    const int64_t head_dim = 32 * halves;
    const int chunks = 2 * halves; /* of 16 elements */
    __m256 wide[8][8][2];
    for (int64_t t = 0, b = 0, i = 0; t < len; t += 8) {
        for (int j = 0; j < 8; j++) { /* the keys of tokens t + j, in block b, at i */
            const uint16_t *key = k_cache + table[b] * block_stride + i * token_stride;
            for (int c = 0; c < chunks; c++) split_bf16x16(key + 16 * c, &wide[j][c][0], &wide[j][c][1]);
            if (t + j + 1 < len && ++i == block_size) {
                b++;
                i = 0;
            }
        }
        const __m256i valid = first_lanes(len - t < 8 ? len - t : 8);
        for (int64_t g = 0; g < group; g++) {
            __m256 qe[8], qo[8], part[8];
            for (int c = 0; c < chunks; c++) split_bf16x16(q + g * head_dim + 16 * c, &qe[c], &qo[c]);
            for (int j = 0; j < 8; j++) {
                part[j] = _mm256_mul_ps(wide[j][0][0], qe[0]);
                part[j] = _mm256_fmadd_ps(wide[j][0][1], qo[0], part[j]);
                for (int c = 1; c < chunks; c++) {
                    part[j] = _mm256_fmadd_ps(wide[j][c][0], qe[c], part[j]);
                    part[j] = _mm256_fmadd_ps(wide[j][c][1], qo[c], part[j]);
                }
            }
            _mm256_maskstore_ps(scores + g * len + t, valid,
                                _mm256_mul_ps(sum_each8(part), _mm256_set1_ps(scale)));
        }
    }
}

/* out[h] = sum over t of p[h][t] v[t] / total[h] for `heads` query heads (a constant)
 * sharing the values, 16 elements of the head at a time: each token's 16 widened once for
 * all the heads, each (head, element) summing its tokens in order in one lane, so a head's
 * result does not depend on how many heads are taken at once. */
static inline __attribute__((always_inline)) void heads_values(
    const float *p, const float *inverse_total, const uint16_t *v_cache, const int64_t *table,
    int64_t len, int64_t block_size, int64_t block_stride, int64_t token_stride, uint16_t *out,
    const int heads, const int halves) {
    const int64_t head_dim = 32 * halves;
    for (int64_t c = 0; c < head_dim; c += 16) {
        __m256 acc[4][2];
        for (int h = 0; h < heads; h++) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
        for (int64_t b = 0, t = 0; t < len; b++) {
            const uint16_t *block = v_cache + table[b] * block_stride + c;
            for (int64_t i = 0; i < block_size && t < len; i++, t++) {
                __m256 even, odd;
                split_bf16x16(block + i * token_stride, &even, &odd);
                for (int h = 0; h < heads; h++) {
                    const __m256 weight = _mm256_set1_ps(p[h * len + t]);
                    acc[h][0] = _mm256_fmadd_ps(weight, even, acc[h][0]);
                    acc[h][1] = _mm256_fmadd_ps(weight, odd, acc[h][1]);
                }
            }
        }
        for (int h = 0; h < heads; h++) {
            float even[8], odd[8];
            const __m256 norm = _mm256_set1_ps(inverse_total[h]);
            _mm256_storeu_ps(even, _mm256_mul_ps(acc[h][0], norm));
            _mm256_storeu_ps(odd, _mm256_mul_ps(acc[h][1], norm));
            for (int j = 0; j < 8; j++) {
                out[h * head_dim + c + 2 * j] = to_bf16(even[j]);
                out[h * head_dim + c + 2 * j + 1] = to_bf16(odd[j]);
            }
        }
    }
}

/* Query heads whose values are weighed at once. */
#define HEADS_AT_ONCE(halves) 4

#endif
