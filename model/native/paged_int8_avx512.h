/* paged_decode_int8.c's vectorised path with AVX-512, head_dim 64 or 128 (4 or 8 `chunks`
 * of 16): `int8_scores` and `int8_values`, which its `pair_int8_fast` and `weigh_int8`
 * call, beside paged_pairs_avx512.h's `sum_each` and `exponentiate`; and `widen32_bf16`
 * for paged_int8_columns.h, which takes the scores of bf16 queries where the CPU has
 * AVX-512 BF16.
 * Included by paged_decode_int8.c alone, after its `slot_scale`, where the compiler
 * targets AVX-512.
 *
 * The loops the compiler vectorised by itself reduced every score across lanes on its own
 * and kept the query heads' sums in memory: decode attention over an int8 cache took 1.6x
 * bf16's time per token and a prefill's 2.9x at 4,096 tokens. This path takes bf16's
 * shape: 16 keys a run, each widened once to fp32 for every query head of the KV head,
 * their 16 sums reduced at once; each value widened once for several query heads, whose sums
 * stay in registers. Every score and output element is computed in one order, fixed by
 * the sequence's own length, so a decode and a prefill's query get the same bits. */
#ifndef LLAMASERVE_PAGED_INT8_AVX512_H
#define LLAMASERVE_PAGED_INT8_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#define INT8_RUN 16 /* keys a run */
/* Query heads whose values are weighed at once: their sums and a value fill the registers
 * (at head_dim 64 a group of 7, Qwen2.5-0.5B's, in one pass: 1.1x over passes of 4 and 3;
 * at 128 three, 1.1x over two, where six spill and take 1.6x). */
#define INT8_HEADS_AT_ONCE(chunks) ((chunks) == 4 ? 7 : 3)

/* 16 int8 as 16 fp32, in order. */
static inline __m512 widen16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* scores[g * len + t] = scale_k(t) (qf_g . k_t) for the `group` query heads of qf (already
 * times the attention scale) sharing one KV head, its keys read in place through the block
 * table, 16 at a time, widened once into `wide` for every head in turn (a run past the
 * sequence's end repeats its last key and stores only the lanes before the end). */
static inline __attribute__((always_inline)) void int8_scores(
    float qf[][MAX_HEAD_DIM], const int8_t *k_cache, const int64_t *table, int64_t len,
    int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t group,
    float *scores, const int chunks) {
    const int64_t head_dim = 16 * chunks;
    float wide[INT8_RUN][128] __attribute__((aligned(64)));
    float key_scales[INT8_RUN];
    for (int64_t t = 0, b = 0, i = 0; t < len; t += INT8_RUN) {
        for (int j = 0; j < INT8_RUN; j++) { /* the keys of tokens t + j, in block b, at i */
            const int8_t *key = k_cache + table[b] * block_stride + i * token_stride;
            for (int c = 0; c < chunks; c++)
                _mm512_store_ps(wide[j] + 16 * c, widen16(key + 16 * c));
            key_scales[j] = slot_scale(key, head_dim);
            if (t + j + 1 < len && ++i == block_size) {
                b++;
                i = 0;
            }
        }
        const __mmask16 valid = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
        const __m512 scale = _mm512_loadu_ps(key_scales);
        for (int64_t g = 0; g < group; g++) {
            __m512 part[INT8_RUN];
            for (int j = 0; j < INT8_RUN; j++) {
                part[j] = _mm512_mul_ps(_mm512_load_ps(wide[j]), _mm512_loadu_ps(qf[g]));
                for (int c = 1; c < chunks; c++)
                    part[j] = _mm512_fmadd_ps(_mm512_load_ps(wide[j] + 16 * c),
                                              _mm512_loadu_ps(qf[g] + 16 * c), part[j]);
            }
            _mm512_mask_storeu_ps(scores + g * len + t, valid,
                                  _mm512_mul_ps(sum_each(part), scale));
        }
    }
}

#if defined(__AVX512BF16__)
/* 32 int8 as 32 bf16, in order: exact, as |q| <= 127 needs 7 bits of significand. */
static inline __m512i widen32_bf16(const int8_t *p) {
    return (__m512i)_mm512_cvtne2ps_pbh(widen16(p + 16), widen16(p));
}
#endif

/* acc[h] = inverse_total[h] sum over t of p[h][t] v_t for `heads` query heads (a constant)
 * sharing the values (p: `heads` rows of `len`, each weight already times its value's
 * scale): each token's values widened once for all of them, each (head, 16 lanes) summing
 * its tokens in order in one register, so a head's result does not depend on how many
 * heads are taken at once. */
static inline __attribute__((always_inline)) void int8_values(
    const float *p, const float *inverse_total, const int8_t *v_cache, const int64_t *table,
    int64_t len, int64_t block_size, int64_t block_stride, int64_t token_stride,
    float acc_out[][MAX_HEAD_DIM], const int heads, const int chunks) {
    __m512 acc[7][8];
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < chunks; c++) acc[h][c] = _mm512_setzero_ps();
    for (int64_t b = 0, t = 0; t < len; b++) {
        const int8_t *block = v_cache + table[b] * block_stride;
        for (int64_t i = 0; i < block_size && t < len; i++, t++) {
            __m512 v[8];
            for (int c = 0; c < chunks; c++) v[c] = widen16(block + i * token_stride + 16 * c);
            for (int h = 0; h < heads; h++) {
                const __m512 weight = _mm512_set1_ps(p[h * len + t]);
                for (int c = 0; c < chunks; c++)
                    acc[h][c] = _mm512_fmadd_ps(weight, v[c], acc[h][c]);
            }
        }
    }
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < chunks; c++)
            _mm512_storeu_ps(acc_out[h] + 16 * c,
                             _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inverse_total[h])));
}

#endif
