/* Attention over a paged KV cache, for the CPU, one query token per row: a decode, or one
 * query of a prefill chunk given its own length (its position + 1) and its sequence's table.
 *
 * Each (row, KV head) pair reads its keys and values in place, block by block through
 * the block table, once: scores for the query heads sharing that KV head, a softmax over
 * the sequence's own length, then the weighted sum of the values, with exact products
 * summed in fp32. Nothing is gathered or padded, and a sequence's result depends on its
 * own data alone, computed in the same order whatever else is in the batch. Built at run
 * time for the machine it runs on (model/native/build.py). The pairs are shared among the
 * calling thread's OpenMP team: PyTorch's own, as the library links the libgomp PyTorch
 * has loaded.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32

/* Softmax of s[0..len) in place, e^sink joining the denominator (an attention sink's
 * logit, which weighs no value; -INFINITY: none). */
static void softmax(float *s, int64_t len, float sink) {
    float top = sink, total = 0.0f;
    for (int64_t t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
    for (int64_t t = 0; t < len; t++) {
        s[t] = expf(s[t] - top);
        total += s[t];
    }
    total += expf(sink - top);
    for (int64_t t = 0; t < len; t++) s[t] /= total;
}

/* Query head g's sink logit among `sinks` (NULL: none). */
static inline float sink_of(const float *sinks, int64_t g) {
    return sinks ? sinks[g] : -INFINITY;
}

#if defined(__AVX512F__)
#include "paged_pairs_avx512.h"
#define FAST_PAIRS 1
#elif defined(__AVX2__) && defined(__FMA__)
#include "paged_pairs_avx2.h"
#define FAST_PAIRS 1
#else
#define FAST_PAIRS 0
#endif

/* A sliding window starts inside its first block: the tokens before it get no weight. */
static inline void mask_leading(float *scores, int64_t group, int64_t len, int64_t masked) {
    for (int64_t g = 0; g < group; g++)
        for (int64_t t = 0; t < masked; t++) scores[g * len + t] = -INFINITY;
}

#if FAST_PAIRS
/* One (query, KV head) pair with bf16 q, caches and output and head_dim = 32 halves
 * (halves a constant: 2 or 4): the scores of every query head sharing the KV head, their
 * exponentials, then the weighted values of HEADS_AT_ONCE query heads at a time, in the
 * vectorised path's functions. A prefill's query and a decode take this same path,
 * so a token's attention is the same bits however its prompt was chunked. */
static inline __attribute__((always_inline)) void pair_bf16(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *table,
    int64_t len, int64_t block_size, int64_t block_stride, int64_t token_stride,
    int64_t group, float scale, float *scores, uint16_t *out, int prefetch, int64_t masked,
    const float *sinks, const int halves) {
    const int64_t head_dim = 32 * halves, at_once = HEADS_AT_ONCE(halves);
    float inverse_total[MAX_GROUP];
    group_scores(q, k_cache, v_cache, table, len, block_size, block_stride, token_stride, group,
                 scale, scores, prefetch, halves);
    mask_leading(scores, group, len, masked);
    for (int64_t g = 0; g < group; g++)
        inverse_total[g] = 1.0f / exponentiate(scores + g * len, len, sink_of(sinks, g));
    for (int64_t g = 0, n; g < group; g += n) {
        n = group - g < at_once ? group - g : at_once;
#define HEADS(count)                                                                       \
    heads_values(scores + g * len, inverse_total + g, v_cache, table, len, block_size,      \
                 block_stride, token_stride, out + g * head_dim, count, halves)
        switch (n) {
        case 4: HEADS(4); break;
        case 3: HEADS(3); break;
        case 2: HEADS(2); break;
        default: HEADS(1); break;
        }
#undef HEADS
    }
}
#endif

/* q [rows, q_row_stride] (each row's n_heads x head_dim contiguous); caches
 * [blocks, block_size, n_kv, head_dim]; block_tables [rows, table_stride]; out
 * [rows, n_heads, head_dim]; window: attend to the last `window` tokens only, or 0 for
 * all; sinks [n_heads] fp32: each query head's sink logit (gpt-oss), or NULL. Returns 0,
 * or 1 for shapes past the fixed buffers, 2 when out of memory. */
static inline __attribute__((always_inline)) int paged_decode(
    const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
    const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens, void *out,
    int64_t rows, int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t block_size,
    float scale, int64_t window, const float *sinks, int bf16) {
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
            /* With a window (0: none) a query sees its last `window` tokens: whole blocks
             * before them are skipped, the rest of the first block masked. */
            const int64_t skip = window > 0 && seq_lens[r] > window ? seq_lens[r] - window : 0;
            const int64_t skipped_blocks = skip / block_size, masked = skip % block_size;
            const int64_t len = seq_lens[r] - skipped_blocks * block_size;
            const int64_t *table = block_tables + r * table_stride + skipped_blocks;
            const float *head_sinks = sinks ? sinks + h * group : NULL;
#if FAST_PAIRS
            if (bf16 && (head_dim == 64 || head_dim == 128)) {
                const uint16_t *qh = (const uint16_t *)q + r * q_row_stride + h * group * head_dim;
                const uint16_t *kh = (const uint16_t *)k_cache + h * head_dim;
                const uint16_t *vh = (const uint16_t *)v_cache + h * head_dim;
                uint16_t *oh = (uint16_t *)out + (r * n_heads + h * group) * head_dim;
                /* A prefill's queries are rows of one table, each one token longer than
                 * the last: after its first, the K and V a query reads were just read.
                 * (Decodes of different sequences may share a cached prefix's first
                 * block, not their lengths in that order.) */
                const int cold = r == 0 || seq_lens[r] != seq_lens[r - 1] + 1 ||
                                 skipped_blocks > 0 ||
                                 table[0] != block_tables[(r - 1) * table_stride];
                if (head_dim == 64)
                    pair_bf16(qh, kh, vh, table, len, block_size, block_stride, token_stride,
                              group, scale, scores, oh, cold, masked, head_sinks, 2);
                else
                    pair_bf16(qh, kh, vh, table, len, block_size, block_stride, token_stride,
                              group, scale, scores, oh, cold, masked, head_sinks, 4);
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
            mask_leading(scores, group, len, masked);
            for (int64_t g = 0; g < group; g++) {
                softmax(scores + g * len, len, sink_of(head_sinks, g));
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
        int64_t block_size, float scale, int64_t window, const float *sinks
#define PASS                                                                               \
    q, q_row_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, rows,     \
        n_heads, n_kv, head_dim, block_size, scale, window, sinks

int paged_decode_bf16(ARGS) { return paged_decode(PASS, 1); }

/* Whether shapes fit the fixed buffers above, for callers that must know before writing. */
int paged_decode_fits(int64_t n_heads, int64_t n_kv, int64_t head_dim) {
    return head_dim <= MAX_HEAD_DIM && n_heads / n_kv <= MAX_GROUP;
}
int paged_decode_f32(ARGS) { return paged_decode(PASS, 0); }
