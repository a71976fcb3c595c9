/* The int8 KV cache (--kv-cache-dtype int8) for the CPU: writing K/V into it and paged
 * attention over it, one query token per row, as paged_decode.c does for bf16 and fp32.
 *
 * A slot (one token, one KV head) is head_dim int8 values then their bf16 scale, 2 bytes
 * (model/network/kv_int8.py). The writer rounds exactly as kv_int8.quantize does, so a
 * token's bytes are the same whichever path wrote them. The kernel factors each slot's
 * scale out of its dot product (scale_k * sum q[d] k[d]) and into the softmax weight of
 * its value (p scale_v * v[d]), so the int8 values are widened to fp32 and never scaled
 * one by one. Each (row, KV head) pair is computed whole on one thread, in the same order
 * whatever else is in the batch, and a prefill's query takes the same path as a decode:
 * a token's attention is the same bits however its prompt was chunked. At head_dim 64
 * and 128 with AVX-512 or AVX2 the pairs take the vectorised path of paged_int8_avx512.h
 * or paged_int8_avx2.h, with bf16 queries where the CPU has AVX-512 BF16 their scores in
 * paged_int8_columns.h, for up to 8 queries of a prefill at once (a 64-token chunk's
 * attention at 4,096 tokens of context took 0.70x bf16's time, against 0.94-0.97x before);
 * elsewhere plain C loops that the compiler vectorises for the level it builds
 * (model/native/build.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32
#define SCALE_BYTES 2

static inline float slot_scale(const int8_t *slot, int64_t head_dim) {
    uint16_t bits;
    memcpy(&bits, slot + head_dim, sizeof bits);
    return from_bf16(bits);
}

#if defined(__AVX512F__)
#include "paged_pairs_avx512.h"
#include "paged_int8_avx512.h"
#define FAST_PAIRS 1
#if defined(__AVX512BF16__)
#include "paged_int8_columns.h"
#define COLUMNS 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include "paged_pairs_avx2.h"
#include "paged_int8_avx2.h"
#define FAST_PAIRS 1
#else
#define FAST_PAIRS 0
#endif
#ifndef COLUMNS
#define COLUMNS 0
#define QUERY_TILE 1
#endif
#define TILE_SCORES_BYTES (8 << 20)

/* One head's values into its slot: scale = bf16(max |x| / 127), q = round(x / scale). */
static void quantize_slot(const void *x, int64_t first, int64_t head_dim, int bf16,
                          int8_t *slot) {
    float top = 0.0f;
    for (int64_t d = 0; d < head_dim; d++) {
        const float a = fabsf(load(x, first + d, bf16));
        top = a > top ? a : top;
    }
    const uint16_t scale = to_bf16(top * (1.0f / 127.0f));
    const float wide = from_bf16(scale), inverse = wide > 0.0f ? 1.0f / wide : 0.0f;
    for (int64_t d = 0; d < head_dim; d++) {
        float q = rintf(load(x, first + d, bf16) * inverse);
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        slot[d] = (int8_t)q;
    }
    memcpy(slot + head_dim, &scale, sizeof scale);
}

/* Row r's n_kv heads (at x + r * row_stride elements, heads contiguous) into slots[r] of
 * the cache [slots, n_kv, head_dim + 2]. */
static void write_rows(const void *x, int64_t row_stride, int64_t rows, const int64_t *slots,
                       int8_t *cache, int64_t n_kv, int64_t head_dim, int bf16) {
    const int64_t width = head_dim + SCALE_BYTES;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < n_kv; h++)
            quantize_slot(x, r * row_stride + h * head_dim, head_dim, bf16,
                          cache + (slots[r] * n_kv + h) * width);
}

/* For the C decoder layer (decoder_layer.c), whose K/V are bf16, and for the layers in
 * PyTorch (model/attention/cpu_paged.py), where one call per cache replaced about a dozen
 * tensor operations of kv_int8.quantize. */
void kv_int8_write_bf16(const void *x, int64_t row_stride, int64_t rows, const int64_t *slots,
                        int8_t *cache, int64_t n_kv, int64_t head_dim) {
    write_rows(x, row_stride, rows, slots, cache, n_kv, head_dim, 1);
}
void kv_int8_write_f32(const void *x, int64_t row_stride, int64_t rows, const int64_t *slots,
                       int8_t *cache, int64_t n_kv, int64_t head_dim) {
    write_rows(x, row_stride, rows, slots, cache, n_kv, head_dim, 0);
}

static void softmax(float *s, int64_t len) {
    float top = s[0], total = 0.0f;
    for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
    for (int64_t t = 0; t < len; t++) {
        s[t] = expf(s[t] - top);
        total += s[t];
    }
    const float inverse = 1.0f / total;
    for (int64_t t = 0; t < len; t++) s[t] *= inverse;
}

/* One (query row, KV head) pair: the `group` query heads in qf (already times the
 * attention scale) against `len` tokens of `table`, the first `masked` hidden. */
static void pair_int8(float qf[][MAX_HEAD_DIM], const int8_t *k_cache, const int8_t *v_cache,
                      const int64_t *table, int64_t len, int64_t block_size,
                      int64_t block_stride, int64_t token_stride, int64_t head_dim,
                      int64_t group, int64_t masked, float *scores,
                      float acc[][MAX_HEAD_DIM]) {
    float x[MAX_HEAD_DIM];
    for (int64_t b = 0, t = 0; t < len; b++) { /* scores: scale_k * (q . k) per query head */
        const int8_t *block = k_cache + table[b] * block_stride;
        for (int64_t i = 0; i < block_size && t < len; i++, t++) {
            const int8_t *slot = block + i * token_stride;
            const float scale = slot_scale(slot, head_dim);
            for (int64_t d = 0; d < head_dim; d++) x[d] = (float)slot[d];
            for (int64_t g = 0; g < group; g++) {
                float dot = 0.0f;
                for (int64_t d = 0; d < head_dim; d++) dot += qf[g][d] * x[d];
                scores[g * len + t] = dot * scale;
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        for (int64_t t = 0; t < masked; t++) scores[g * len + t] = -INFINITY;
        softmax(scores + g * len, len);
        memset(acc[g], 0, sizeof(float) * head_dim);
    }
    for (int64_t b = 0, t = 0; t < len; b++) { /* the weighted sum of the values */
        const int8_t *block = v_cache + table[b] * block_stride;
        for (int64_t i = 0; i < block_size && t < len; i++, t++) {
            const int8_t *slot = block + i * token_stride;
            const float scale = slot_scale(slot, head_dim);
            for (int64_t d = 0; d < head_dim; d++) x[d] = (float)slot[d];
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * len + t] * scale;
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * x[d];
            }
        }
    }
}

#if FAST_PAIRS
/* The rest of a pair once its scores are in `scores` (`group` rows of `len`): their
 * exponentials, each weight times its value's scale (`value_scales`, `len` of them), then
 * the weighted values of INT8_HEADS_AT_ONCE query heads at a time, in the vectorised
 * path's functions, head_dim = INT8_RUN chunks (a constant). */
static inline __attribute__((always_inline)) void weigh_int8(
    const int8_t *v_cache, const int64_t *table, int64_t len, int64_t block_size,
    int64_t block_stride, int64_t token_stride, int64_t group, int64_t masked, float *scores,
    const float *value_scales, float acc[][MAX_HEAD_DIM], const int chunks) {
    const int64_t at_once = INT8_HEADS_AT_ONCE(chunks);
    float inverse_total[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        for (int64_t t = 0; t < masked; t++) scores[g * len + t] = -INFINITY;
        inverse_total[g] = 1.0f / exponentiate(scores + g * len, len, -INFINITY);
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t t = 0; t < len; t++) scores[g * len + t] *= value_scales[t];
    for (int64_t g = 0, n; g < group; g += n) {
        n = group - g < at_once ? group - g : at_once;
#define HEADS(count)                                                                       \
    int8_values(scores + g * len, inverse_total + g, v_cache, table, len, block_size,        \
                block_stride, token_stride, acc + g, count, chunks)
        switch (n) {
        case 7: HEADS(7); break;
        case 6: HEADS(6); break;
        case 5: HEADS(5); break;
        case 4: HEADS(4); break;
        case 3: HEADS(3); break;
        case 2: HEADS(2); break;
        default: HEADS(1); break;
        }
#undef HEADS
    }
}

/* The values' scales of `len` tokens of `table`. */
static void value_scales_of(const int8_t *v_cache, const int64_t *table, int64_t len,
                            int64_t block_size, int64_t block_stride, int64_t token_stride,
                            int64_t head_dim, float *value_scales) {
    for (int64_t b = 0, t = 0; t < len; b++) {
        const int8_t *block = v_cache + table[b] * block_stride;
        for (int64_t i = 0; i < block_size && t < len; i++, t++)
            value_scales[t] = slot_scale(block + i * token_stride, head_dim);
    }
}

/* pair_int8 in the vectorised path's functions, head_dim = INT8_RUN chunks (a constant),
 * for fp32 queries (qf, the attention scale applied) or, without AVX-512 BF16, bf16 ones;
 * `value_scales` holds room for `len`. */
static inline __attribute__((always_inline)) void pair_int8_fast(
    float qf[][MAX_HEAD_DIM], const int8_t *k_cache, const int8_t *v_cache,
    const int64_t *table, int64_t len, int64_t block_size, int64_t block_stride,
    int64_t token_stride, int64_t group, int64_t masked, float *scores, float *value_scales,
    float acc[][MAX_HEAD_DIM], const int chunks) {
    int8_scores(qf, k_cache, table, len, block_size, block_stride, token_stride, group, scores,
                chunks);
    value_scales_of(v_cache, table, len, block_size, block_stride, token_stride,
                    INT8_RUN * chunks, value_scales);
    weigh_int8(v_cache, table, len, block_size, block_stride, token_stride, group, masked,
               scores, value_scales, acc, chunks);
}
#endif

/* Whether row b is the query after row a of one prefill: one token longer, over the same
 * blocks (decodes of different sequences may share a cached prefix's blocks, not their
 * lengths in that order). */
static int next_query(const int64_t *block_tables, int64_t table_stride,
                      const int64_t *seq_lens, int64_t block_size, int64_t a, int64_t b) {
    if (seq_lens[b] != seq_lens[a] + 1) return 0;
    const int64_t blocks = (seq_lens[b] + block_size - 1) / block_size;
    return memcmp(block_tables + a * table_stride, block_tables + b * table_stride,
                  sizeof(int64_t) * blocks) == 0;
}

/* As paged_decode.c's paged_decode, over int8 caches [blocks, block_size, n_kv,
 * head_dim + 2]; q and out in bf16 or fp32. Returns 0, 1 for shapes past the fixed
 * buffers, 2 when out of memory. Work is split by (tile, KV head): a tile is up to
 * QUERY_TILE consecutive queries of one prefill where their scores share key columns
 * (paged_int8_columns.h), else one row. */
static int paged_decode_int8(const void *q, int64_t q_row_stride, const int8_t *k_cache,
                             const int8_t *v_cache, const int64_t *block_tables,
                             int64_t table_stride, const int64_t *seq_lens, void *out,
                             int64_t rows, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                             int64_t block_size, float scale, int64_t window, int bf16) {
    const int64_t group = n_heads / n_kv;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP) return 1;
    const int64_t token_stride = n_kv * (head_dim + SCALE_BYTES);
    const int64_t block_stride = block_size * token_stride;
    int64_t longest = 1;
    for (int64_t r = 0; r < rows; r++) longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    const int columns = COLUMNS && bf16 && (head_dim == 64 || head_dim == 128);
    /* Each query of a tile holds group x longest scores: at most TILE_SCORES_BYTES of them
     * a tile, so that long contexts take smaller tiles rather than larger buffers. */
    const int64_t fitting = TILE_SCORES_BYTES / (int64_t)(sizeof(float) * group * longest);
    const int64_t most = fitting < 1 ? 1 : fitting < QUERY_TILE ? fitting : QUERY_TILE;
    int64_t *firsts = malloc(sizeof(int64_t) * (rows + 1)), tiles = 0, widest = 1;
    if (firsts == NULL) return 2;
    for (int64_t r = 0, n; r < rows; r += n) { /* windows: a row a tile */
        n = 1;
        while (columns && window == 0 && n < most && r + n < rows &&
               next_query(block_tables, table_stride, seq_lens, block_size, r + n - 1, r + n))
            n++;
        firsts[tiles++] = r;
        widest = n > widest ? n : widest;
    }
    firsts[tiles] = rows;
    int failed = 0;

#pragma omp parallel reduction(| : failed)
    {
        /* a tile's scores, then the values' scales of one sequence */
        float *scores = malloc(sizeof(float) * (widest * group + 1) * longest);
        float *value_scales = scores + widest * group * longest;
        float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
        failed = scores == NULL;
#pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < tiles * n_kv; item++) {
            if (failed) continue;
            const int64_t first = firsts[item / n_kv], h = item % n_kv;
            const int64_t tile = firsts[item / n_kv + 1] - first;
            const int8_t *kh = k_cache + h * (head_dim + SCALE_BYTES);
            const int8_t *vh = v_cache + h * (head_dim + SCALE_BYTES);
            int64_t lens[QUERY_TILE], masks[QUERY_TILE];
            const int64_t *tables[QUERY_TILE];
            for (int64_t i = 0; i < tile; i++) {
                const int64_t r = first + i;
                /* A window (0: none): whole blocks before it skipped, the rest masked. */
                const int64_t skip = window > 0 && seq_lens[r] > window ? seq_lens[r] - window : 0;
                lens[i] = seq_lens[r] - skip / block_size * block_size;
                masks[i] = skip % block_size;
                tables[i] = block_tables + r * table_stride + skip / block_size;
            }
#if COLUMNS
            if (columns) {
                const uint16_t *qs[QUERY_TILE];
                float *tile_scores[QUERY_TILE];
                for (int64_t i = 0; i < tile; i++) {
                    qs[i] = (const uint16_t *)q + (first + i) * q_row_stride + h * group * head_dim;
                    tile_scores[i] = scores + i * group * longest;
                }
                if (head_dim == 64)
                    tile_scores_columns(qs, lens, tile, scale, kh, tables[0], block_size,
                                        block_stride, token_stride, group, tile_scores, 4);
                else
                    tile_scores_columns(qs, lens, tile, scale, kh, tables[0], block_size,
                                        block_stride, token_stride, group, tile_scores, 8);
                value_scales_of(vh, tables[0], lens[tile - 1], block_size, block_stride,
                                token_stride, head_dim, value_scales);
            }
#endif
            for (int64_t i = 0; i < tile; i++) {
                const int64_t r = first + i, len = lens[i], masked = masks[i];
                const int64_t *table = tables[i];
#if COLUMNS
                if (columns) {
                    if (head_dim == 64)
                        weigh_int8(vh, table, len, block_size, block_stride, token_stride,
                                   group, masked, scores + i * group * longest, value_scales,
                                   acc, 4);
                    else
                        weigh_int8(vh, table, len, block_size, block_stride, token_stride,
                                   group, masked, scores + i * group * longest, value_scales,
                                   acc, 8);
                } else
#endif
                {
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t at = r * q_row_stride + (h * group + g) * head_dim;
                        for (int64_t d = 0; d < head_dim; d++)
                            qf[g][d] = load(q, at + d, bf16) * scale;
                    }
#if FAST_PAIRS
                    if (head_dim == 64 || head_dim == 128) {
                        if (head_dim == 64)
                            pair_int8_fast(qf, kh, vh, table, len, block_size, block_stride,
                                           token_stride, group, masked, scores, value_scales,
                                           acc, 64 / INT8_RUN);
                        else
                            pair_int8_fast(qf, kh, vh, table, len, block_size, block_stride,
                                           token_stride, group, masked, scores, value_scales,
                                           acc, 128 / INT8_RUN);
                    } else
#endif
                        pair_int8(qf, kh, vh, table, len, block_size, block_stride,
                                  token_stride, head_dim, group, masked, scores, acc);
                }
                for (int64_t g = 0; g < group; g++) {
                    const int64_t at = (r * n_heads + h * group + g) * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) store(out, at + d, acc[g][d], bf16);
                }
            }
        }
        free(scores);
    }
    free(firsts);
    return failed ? 2 : 0;
}

#define ARGS                                                                               \
    const void *q, int64_t q_row_stride, const int8_t *k_cache, const int8_t *v_cache,     \
        const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,         \
        void *out, int64_t rows, int64_t n_heads, int64_t n_kv, int64_t head_dim,           \
        int64_t block_size, float scale, int64_t window
#define PASS                                                                               \
    q, q_row_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, rows,     \
        n_heads, n_kv, head_dim, block_size, scale, window

int paged_decode_int8_bf16(ARGS) { return paged_decode_int8(PASS, 1); }
int paged_decode_int8_f32(ARGS) { return paged_decode_int8(PASS, 0); }
