/* paged_decode_int8.c's scores for bf16 queries where the CPU has AVX-512 BF16, head_dim
 * 64 or 128: each run of 16 keys turned into columns once, for every query head of the
 * KV head and every query of a prefill's tile. Included by paged_decode_int8.c alone,
 * after paged_int8_avx512.h (its `widen32_bf16`).
 *
 * paged_int8_avx512.h's int8_scores_bf16 multiplies each key by a query head in rows (a
 * dpbf16 per 32 dimensions) and then sums each key's 16 lanes across the register: at
 * head_dim 64 three instructions of that sum for every two of products. In columns, lane
 * j holds key j, and column p the key's dimensions 2p and 2p + 1; a query head's 16
 * scores are then head_dim / 2 dpbf16 with its own pair p broadcast, and no sum across
 * lanes. Building the columns (widening to bf16, a 16 x 16 transpose of 32-bit pairs)
 * costs about as much as the sums it saves for one query head: it is paid once per run
 * for all of them, and once for up to QUERY_TILE queries of the same prefill, whose
 * causal lengths differ by one.
 *
 * A score is the same sum in the same order (pairs 0, 1, ... in one lane) whatever the
 * tile, the run or the number of heads at once: a decode and a prefill's query get the
 * same bits. The products are exact (int8 in bf16 is exact), as in the rows' path. */
#ifndef LLAMASERVE_PAGED_INT8_COLUMNS_H
#define LLAMASERVE_PAGED_INT8_COLUMNS_H

#include <immintrin.h>
#include <stdint.h>

/* Queries of one prefill whose scores share the columns of a run. */
#define QUERY_TILE 8
/* Query heads whose scores are summed at once: their accumulators in registers. */
#define COLUMN_HEADS 8

/* r[i] lane j -> r[j] lane i, for 16 registers of 16 32-bit lanes: pairs of rows
 * interleaved in 32- then 64-bit lanes, then 128-bit lanes moved in two rounds. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4 q + m]: element 4 k + m of rows 4 q .. 4 q + 3, in 128-bit lane k */
    __m512i u[16];
    for (int q = 0; q < 4; q++) {
        u[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    for (int m = 0; m < 4; m++) {
        const __m512i low = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
        const __m512i high = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
        const __m512i low2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        const __m512i high2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
        r[m] = _mm512_shuffle_i32x4(low, low2, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(low, low2, 0xDD);
        r[8 + m] = _mm512_shuffle_i32x4(high, high2, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(high, high2, 0xDD);
    }
}

/* columns[p] lane j = dimensions 2p, 2p + 1 of keys[j], as bf16 (16 * chunks / 2 columns). */
static inline __attribute__((always_inline)) void key_columns(const int8_t *const keys[16],
                                                              __m512i *columns,
                                                              const int chunks) {
    for (int c = 0; c < chunks / 2; c++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) r[j] = widen32_bf16(keys[j] + 32 * c);
        transpose16(r);
        for (int p = 0; p < 16; p++) columns[16 * c + p] = r[p];
    }
}

/* out[g] lanes = the 16 keys' sums with query head g of q (`heads` of them, a constant),
 * pair by pair in order. */
static inline __attribute__((always_inline)) void column_sums(const __m512i *columns,
                                                              const uint32_t *q_pairs,
                                                              int64_t pairs_per_head,
                                                              __m512 *out, const int heads,
                                                              const int chunks) {
    __m512 acc[COLUMN_HEADS];
    for (int g = 0; g < heads; g++) acc[g] = _mm512_setzero_ps();
    for (int p = 0; p < 8 * chunks; p++) {
        const __m512bh column = (__m512bh)columns[p];
        for (int g = 0; g < heads; g++)
            acc[g] = _mm512_dpbf16_ps(
                acc[g], column, (__m512bh)_mm512_set1_epi32((int)q_pairs[g * pairs_per_head + p]));
    }
    for (int g = 0; g < heads; g++) out[g] = acc[g];
}

/* scores[i][g * lens[i] + t] = scale scale_k(t) (q_{i,g} . k_t) for the `tile` queries
 * q[i] (bf16, their `group` heads contiguous) of one sequence, lens[i] tokens of `table`
 * each, rising; runs of 16 keys read through the table up to the longest, turned into
 * columns once (a run past the end repeats its last key), each query storing the lanes
 * before its own end. */
static inline __attribute__((always_inline)) void tile_scores_columns(
    const uint16_t *const q[QUERY_TILE], const int64_t *lens, int64_t tile, float scale,
    const int8_t *k_cache, const int64_t *table, int64_t block_size, int64_t block_stride,
    int64_t token_stride, int64_t group, float *const scores[QUERY_TILE], const int chunks) {
    const int64_t head_dim = 16 * chunks, longest = lens[tile - 1];
    __m512i columns[64];
    float key_scales[16];
    const int8_t *keys[16];
    for (int64_t t = 0, b = 0, i = 0; t < longest; t += 16) {
        for (int j = 0; j < 16; j++) { /* the keys of tokens t + j, in block b, at i */
            keys[j] = k_cache + table[b] * block_stride + i * token_stride;
            key_scales[j] = slot_scale(keys[j], head_dim) * scale;
            if (t + j + 1 < longest && ++i == block_size) {
                b++;
                i = 0;
            }
        }
        key_columns(keys, columns, chunks);
        const __m512 scales = _mm512_loadu_ps(key_scales);
        for (int64_t r = 0; r < tile; r++) {
            if (lens[r] <= t) continue;
            const __mmask16 valid =
                lens[r] - t >= 16 ? 0xFFFF : (__mmask16)((1u << (lens[r] - t)) - 1);
            const uint32_t *pairs = (const uint32_t *)q[r];
            for (int64_t g = 0, n; g < group; g += n) {
                n = group - g < COLUMN_HEADS ? group - g : COLUMN_HEADS;
                __m512 sums[COLUMN_HEADS];
#define HEADS(count) column_sums(columns, pairs + g * 8 * chunks, 8 * chunks, sums, count, chunks)
                switch (n) {
                case 8: HEADS(8); break;
                case 7: HEADS(7); break;
                case 6: HEADS(6); break;
                case 5: HEADS(5); break;
                case 4: HEADS(4); break;
                case 3: HEADS(3); break;
                case 2: HEADS(2); break;
                default: HEADS(1); break;
                }
#undef HEADS
                for (int64_t h = 0; h < n; h++)
                    _mm512_mask_storeu_ps(scores[r] + (g + h) * lens[r] + t, valid,
                                          _mm512_mul_ps(sums[h], scales));
            }
        }
    }
}

#endif
