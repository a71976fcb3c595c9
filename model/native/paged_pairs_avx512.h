/* paged_decode.c's vectorised path with AVX-512 (dpbf16 where the CPU has AVX-512 BF16)
 * for bf16 q, caches and output, head_dim 64 or 128: `group_scores`, `exponentiate` and
 * `heads_values`, which paged_decode.c's `pair_bf16` calls. Included by paged_decode.c
 * (and, for `sum_each` and `exponentiate`, by paged_decode_int8.c), where the compiler
 * targets AVX-512. */
#ifndef LLAMASERVE_PAGED_PAIRS_AVX512_H
#define LLAMASERVE_PAGED_PAIRS_AVX512_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* 32 bf16 as two fp32 vectors, the even elements and the odd ones: a shift and a mask,
 * where widening in order takes a conversion per 16. The values are split so: weighted
 * sums need no reordering until the output. */
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

/* acc + the products of 16 pairs of bf16, lane i taking pair i of k and of q: AVX-512
 * BF16's dpbf16 (32 exact products per instruction) where the CPU has it, else the same
 * products in two fused multiply-adds. */
static inline __attribute__((always_inline)) __m512 dot_pairs(__m512 acc, __m512i k, __m512i q) {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)k, (__m512bh)q);
#else
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(k, high)),
                          _mm512_castsi512_ps(_mm512_and_si512(q, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(k, 16)),
                           _mm512_castsi512_ps(_mm512_slli_epi32(q, 16)), acc);
#endif
}

/* e^x for x <= 0, within about an ulp: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by a
 * polynomial (Cephes's expf), times 2^n. Inline, where glibc's vector expf is a call per
 * 16 values and a scalar call per value of a tail. */
static inline __m512 exp_negative(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f)); /* below, e^x is under FLT_MIN anyway */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* s[t] = e^(s[t] - top) for t < len, top the largest of them and `sink`; returns their sum
 * plus e^(sink - top) (an attention sink's share of the denominator; -INFINITY: none). The
 * softmax's division is left to the weighted values (one per output instead of one per
 * score). */
static inline float exponentiate(float *s, int64_t len, float sink) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
    const __mmask16 tail = (__mmask16)((1u << (len - t)) - 1);
    top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + t));
    const float most = _mm512_reduce_max_ps(top), highest = sink > most ? sink : most;
    const __m512 shift = _mm512_set1_ps(highest);
    __m512 total = _mm512_setzero_ps();
    for (t = 0; t + 16 <= len; t += 16) {
        const __m512 e = exp_negative(_mm512_sub_ps(_mm512_loadu_ps(s + t), shift));
        _mm512_storeu_ps(s + t, e);
        total = _mm512_add_ps(total, e);
    }
    if (tail) {
        const __m512 e = exp_negative(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), shift));
        _mm512_mask_storeu_ps(s + t, tail, e);
        total = _mm512_mask_add_ps(total, tail, total, e);
    }
    return _mm512_reduce_add_ps(total) + expf(sink - highest);
}

/* scale q . k for 16 keys, one per lane; q is `halves` vectors of bf16 pairs. Lane j
 * depends on key j alone. */
static inline __attribute__((always_inline)) __m512 sixteen_scores(
    const __m512i *qv, const uint16_t *const keys[16], __m512 scale, const int halves) {
    __m512 part[16];
    for (int j = 0; j < 16; j++) {
        part[j] = _mm512_setzero_ps();
        for (int c = 0; c < halves; c++)
            part[j] = dot_pairs(part[j], _mm512_loadu_si512(keys[j] + 32 * c), qv[c]);
    }
    return _mm512_mul_ps(sum_each(part), scale);
}

/* Prefetches the `halves` cache lines of each of the 16 rows from token t at (block b,
 * index i) on, into `hint`'s level, and moves (b, i) on by 16 tokens. */
static inline __attribute__((always_inline)) void prefetch_run(
    const uint16_t *cache, const int64_t *table, int64_t t, int64_t len, int64_t *b,
    int64_t *i, int64_t block_size, int64_t block_stride, int64_t token_stride, int hint,
    const int halves) {
    for (int j = 0; j < 16 && t + j < len; j++) {
        const char *row = (const char *)(cache + table[*b] * block_stride + *i * token_stride);
        for (int c = 0; c < halves; c++) {
            if (hint == _MM_HINT_T0)
                _mm_prefetch(row + 64 * c, _MM_HINT_T0);
            else
                _mm_prefetch(row + 64 * c, _MM_HINT_T1);
        }
        if (++*i == block_size) {
            ++*b;
            *i = 0;
        }
    }
}

/* scores[g * len + t] = scale q_g . k_t for the `group` query heads of q (head_dim = 32
 * halves, halves a constant: 2 or 4) sharing one KV head, its keys read in place through
 * the block table, 16 at a time, every head in turn while they are in L1 (a run past the
 * sequence's end repeats its last key and stores only the lanes before the end). Each
 * score is the same computation wherever its run starts, so a decode and a prefill's
 * query get the same bits. Blocks lie anywhere in the cache, where the hardware's
 * prefetcher loses the stream: with `prefetch` (the sequence's K and V are not in the
 * caches already) the next run's keys, and this run's values for the weighted sum after
 * the softmax, are prefetched by hand (about 1.1x for decode attention from DRAM). */
static inline __attribute__((always_inline)) void group_scores(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
    int64_t len, int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t group,
    float scale, float *scores, int prefetch, const int halves) {
    const int64_t head_dim = 32 * halves;
    const __m512 scale_v = _mm512_set1_ps(scale);
    const uint16_t *keys[16];
    int64_t kb = 0, ki = 0, vb = 0, vi = 0; /* where the prefetches of K and V have got to */
    if (prefetch) /* the first run's keys */
        prefetch_run(k_cache, table, 0, len, &kb, &ki, block_size, block_stride, token_stride,
                     _MM_HINT_T0, halves);
    for (int64_t t = 0, b = 0, i = 0; t < len; t += 16) {
        if (prefetch) {
            prefetch_run(k_cache, table, t + 16, len, &kb, &ki, block_size, block_stride,
                         token_stride, _MM_HINT_T0, halves);
            prefetch_run(v_cache, table, t, len, &vb, &vi, block_size, block_stride,
                         token_stride, _MM_HINT_T1, halves);
        }
        for (int j = 0; j < 16; j++) { /* the keys of tokens t + j, in block b, at i */
            keys[j] = k_cache + table[b] * block_stride + i * token_stride;
            if (t + j + 1 < len && ++i == block_size) {
                b++;
                i = 0;
            }
        }
        const __mmask16 valid = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
        for (int64_t g = 0; g < group; g++) {
            __m512i qv[4];
            for (int c = 0; c < halves; c++) qv[c] = _mm512_loadu_si512(q + g * head_dim + 32 * c);
            _mm512_mask_storeu_ps(scores + g * len + t, valid,
                                  sixteen_scores(qv, keys, scale_v, halves));
        }
    }
}

/* out[h] = sum over t of p[h][t] v[t] for `heads` query heads (a constant) that share the
 * values: each token's values are split to fp32 once for all of them (split_bf16), and
 * each (head, 16 lanes) sums its tokens in order in one accumulator, so a head's result
 * does not depend on how many heads are taken at once. p: `heads` rows of `len`. */
static inline __attribute__((always_inline)) void heads_values(
    const float *p, const float *inverse_total, const uint16_t *v_cache, const int64_t *table,
    int64_t len, int64_t block_size, int64_t block_stride, int64_t token_stride, uint16_t *out,
    const int heads, const int halves) {
    const int64_t head_dim = 32 * halves;
    __m512 acc[4][8];
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < 2 * halves; c++) acc[h][c] = _mm512_setzero_ps();
    for (int64_t b = 0, t = 0; t < len; b++) {
        const uint16_t *block = v_cache + table[b] * block_stride;
        for (int64_t i = 0; i < block_size && t < len; i++, t++) {
            __m512 even[4], odd[4];
            for (int c = 0; c < halves; c++)
                split_bf16(block + i * token_stride + 32 * c, &even[c], &odd[c]);
            for (int h = 0; h < heads; h++) {
                const __m512 weight = _mm512_set1_ps(p[h * len + t]);
                for (int c = 0; c < halves; c++) {
                    acc[h][2 * c] = _mm512_fmadd_ps(weight, even[c], acc[h][2 * c]);
                    acc[h][2 * c + 1] = _mm512_fmadd_ps(weight, odd[c], acc[h][2 * c + 1]);
                }
            }
        }
    }
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < halves; c++) {
            float even[16], odd[16];
            const __m512 norm = _mm512_set1_ps(inverse_total[h]);
            _mm512_storeu_ps(even, _mm512_mul_ps(acc[h][2 * c], norm));
            _mm512_storeu_ps(odd, _mm512_mul_ps(acc[h][2 * c + 1], norm));
            for (int j = 0; j < 16; j++) {
                out[h * head_dim + 32 * c + 2 * j] = to_bf16(even[j]);
                out[h * head_dim + 32 * c + 2 * j + 1] = to_bf16(odd[j]);
            }
        }
}

/* Query heads whose values are weighed at once: their accumulators fill the registers. */
#define HEADS_AT_ONCE(halves) (8 / (halves))

#endif
