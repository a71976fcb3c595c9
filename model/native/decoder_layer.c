/* A decoder layer's work around attention, for the CPU in bf16 with int4, int5, int6 or
 * grouped int8 weights, in two calls instead of about forty PyTorch ops: on 2 cores those ops' dispatch
 * cost more than the layer's arithmetic at one stream.
 *
 * decoder_attention_input: RMSNorm, the fused Q/K/V projection (plus Qwen2's bias), the
 * per-head Q/K RMSNorm (Qwen3, Gemma 3), RoPE on Q and K.
 * decoder_attention_output: O projection (normalised in Gemma 3, plus gpt-oss's bias) and
 * residual, RMSNorm,
 * gate/up projection, SiLU(gate) * up or GELU-tanh(gate) * up, down projection (normalised
 * in Gemma 3) and residual.
 * decoder_layer_decode: for a batch of decodes, both around the cache writes and decode
 * attention (with gpt-oss's attention sinks): the whole layer in one call.
 * A layer whose MLP is a mixture of experts (ffn 0) runs its norm, router and experts in C
 * after the attention's residual (moe_router.c) where it holds them, else stops there and
 * its caller runs them (model/network/moe.py).
 * With LoRA adapters resident, each projection's base product is followed by the update of
 * the step's adapter rows (lora_update.c), where the PyTorch layer's hooks add it.
 *
 * Each step rounds to bf16 where the PyTorch layer (model/decoder_layer.py) does: every
 * op's output is a bf16 tensor there, so it is here. Rows are computed alone, in the same
 * order whatever the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "layer_weight.h"
#include "lora_step.h"
#include "moe_layer.h"

/* Elementwise loops are shared among the OpenMP team only for enough rows (a prefill
 * chunk): waking it costs more than a decode step's few rows of work. */
#define PARALLEL_ROWS 64

void rms_norm_bf16(const void *x, const void *weight, void *out, int64_t rows, int64_t width,
                   float eps);
int int4_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, const uint16_t *sz,
                     uint16_t *y, int64_t rows, int64_t n_out, int64_t k);
int int4_matmul_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                        const uint16_t *sz, uint16_t *y, int64_t rows, int64_t n_out, int64_t k);
int int4k_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, const uint16_t *sz,
                      uint16_t *y, int64_t rows, int64_t n_out, int64_t k);
int int4k_matmul_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                         const uint16_t *sz, uint16_t *y, int64_t rows, int64_t n_out, int64_t k);

int int8_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, const uint16_t *scales,
                     float *y, int64_t rows, int64_t n_out, int64_t k);
int int5_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, const uint16_t *scales,
                     uint16_t *y, int64_t rows, int64_t n_out, int64_t k);
int int5_matmul_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                        const uint16_t *scales, uint16_t *y, int64_t rows, int64_t n_out,
                        int64_t k);
int int6_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, const float *scales,
                     uint16_t *y, int64_t rows, int64_t n_out, int64_t k);
int int6_matmul_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                        const float *scales, uint16_t *y, int64_t rows, int64_t n_out,
                        int64_t k);
int int8_matmul_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                        const uint16_t *scales, uint16_t *y, int64_t rows, int64_t n_out,
                        int64_t k);
int mxfp4_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, uint16_t *y,
                      int64_t rows, int64_t n_out, int64_t k);
int mxfp4_matmul_a8_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, uint16_t *y,
                         int64_t rows, int64_t n_out, int64_t k);

static int split_matmul(const split_weight *s, const uint16_t *x, int64_t x_stride, uint16_t *y,
                        int64_t rows, int64_t n_out, int64_t k);

/* y [rows, n_out] bf16. Grouped int8 sums in fp32, rounded to bf16 as the PyTorch layer
 * rounds Int8GroupLinear's output to the activations' dtype. */
static int matmul(const layer_weight *w, const uint16_t *x, int64_t x_stride, uint16_t *y,
                  int64_t rows, int64_t n_out, int64_t k) {
    if (w->kind == SPLIT)
        return split_matmul((const split_weight *)w->weight, x, x_stride, y, rows, n_out, k);
    if (w->kind == INT4)
        return int4_matmul_bf16(x, x_stride, w->weight, w->scales, y, rows, n_out, k);
    if (w->kind == INT4_A8)
        return int4_matmul_a8_bf16(x, x_stride, w->weight, w->scales, y, rows, n_out, k);
    if (w->kind == INT4K)
        return int4k_matmul_bf16(x, x_stride, w->weight, w->scales, y, rows, n_out, k);
    if (w->kind == INT4K_A8)
        return int4k_matmul_a8_bf16(x, x_stride, w->weight, w->scales, y, rows, n_out, k);
    if (w->kind == INT5)
        return int5_matmul_bf16(x, x_stride, w->weight, w->scales, y, rows, n_out, k);
    if (w->kind == INT5_A8)
        return int5_matmul_a8_bf16(x, x_stride, w->weight, w->scales, y, rows, n_out, k);
    if (w->kind == INT6)
        return int6_matmul_bf16(x, x_stride, w->weight, w->scales, y, rows, n_out, k);
    if (w->kind == INT6_A8)
        return int6_matmul_a8_bf16(x, x_stride, w->weight, w->scales, y, rows, n_out, k);
    if (w->kind == INT8_GROUPS_A8)
        return int8_matmul_a8_bf16(x, x_stride, w->weight, w->scales, y, rows, n_out, k);
    if (w->kind == MXFP4) return mxfp4_matmul_bf16(x, x_stride, w->weight, y, rows, n_out, k);
    if (w->kind == MXFP4_A8)
        return mxfp4_matmul_a8_bf16(x, x_stride, w->weight, y, rows, n_out, k);
    float *out = malloc(sizeof(float) * (rows > 0 ? rows : 1) * n_out);
    if (out == NULL) return 2;
    int status = int8_matmul_bf16(x, x_stride, w->weight, w->scales, out, rows, n_out, k);
    for (int64_t i = 0; i < rows * n_out && !status; i++) y[i] = to_bf16(out[i]);
    free(out);
    return status;
}

/* Each part's product into its columns of y: a lone row's go straight there (a row's
 * outputs are contiguous), more rows' through a buffer the size of the larger part. */
static int split_matmul(const split_weight *s, const uint16_t *x, int64_t x_stride, uint16_t *y,
                        int64_t rows, int64_t n_out, int64_t k) {
    const int64_t widths[2] = {s->first_rows, n_out - s->first_rows};
    const layer_weight *parts[2] = {&s->first, &s->second};
    if (rows == 1) {
        int status = matmul(parts[0], x, x_stride, y, 1, widths[0], k);
        return status ? status : matmul(parts[1], x, x_stride, y + widths[0], 1, widths[1], k);
    }
    const int64_t widest = widths[0] > widths[1] ? widths[0] : widths[1];
    uint16_t *part = malloc(sizeof(uint16_t) * rows * widest);
    if (part == NULL) return 2;
    int status = 0;
    for (int64_t p = 0, at = 0; p < 2 && !status; at += widths[p], p++) {
        status = matmul(parts[p], x, x_stride, part, rows, widths[p], k);
        for (int64_t r = 0; r < rows && !status; r++)
            memcpy(y + r * n_out + at, part + r * widths[p], sizeof(uint16_t) * widths[p]);
    }
    free(part);
    return status;
}

int layer_matmul(const layer_weight *w, const uint16_t *x, int64_t x_stride, uint16_t *y,
                 int64_t rows, int64_t n_out, int64_t k) {
    return matmul(w, x, x_stride, y, rows, n_out, k);
}

/* Mirrored by a ctypes.Structure in model/native/layer.py: same fields, same order. The
 * family's optional parts are NULL where it has none. */
typedef struct {
    const uint16_t *input_norm, *post_attention_norm;
    layer_weight qkv, o, gate_up, down;
    const uint16_t *qkv_bias;                    /* Qwen2 */
    const uint16_t *q_norm, *k_norm;             /* per head: Qwen3, Gemma 3 */
    const uint16_t *attn_out_norm, *ffn_out_norm; /* Gemma 3 */
    int64_t gelu;                                /* GELU-tanh gate (Gemma 3), else SiLU */
    int64_t dim, n_heads, n_kv, head_dim, ffn;
    float eps;
    const uint16_t *o_bias; /* gpt-oss */
    const float *sinks;     /* gpt-oss: [n_heads] fp32 logits in each softmax's denominator */
    /* LoRA adapters (model/lora/slots.py), per fused projection (qkv, o, gate_up, down): the
     * slots' A [slots, targets * max_rank, in] and B^T [slots, max_rank, out], bf16; NULL
     * without adapters; where the same copies lie in each slot's block (lora_step.h).
     * `lora`: the step's rows and slots, shared by every layer. */
    const uint16_t *lora_a[4], *lora_bt[4];
    int64_t lora_block_offset[4];
    const lora_step *lora;
    /* A mixture of experts' layer (ffn 0): its norm, router and experts (moe_router.c), run
     * after attention's residual; NULL: the caller runs them. */
    const moe_experts *moe;
} decoder_layer;

enum { QKV = 0, O = 1, GATE_UP = 2, DOWN = 3 };

/* The base product of one of the layer's projections, then each adapter row's update. */
static int project(const decoder_layer *l, int which, const uint16_t *x, int64_t x_stride,
                   uint16_t *y, int64_t rows, int64_t n_out, int64_t k) {
    const layer_weight *w = which == QKV ? &l->qkv
                            : which == O ? &l->o
                            : which == GATE_UP ? &l->gate_up
                                               : &l->down;
    if (l->lora == NULL || l->lora->row_slots == NULL || l->lora_a[which] == NULL)
        return matmul(w, x, x_stride, y, rows, n_out, k);
    const int64_t kv = l->n_kv * l->head_dim;
    const int64_t qkv_sizes[3] = {l->n_heads * l->head_dim, kv, kv};
    const int64_t ffn_sizes[2] = {l->ffn, l->ffn}, whole[1] = {n_out};
    const int64_t *sizes = which == QKV ? qkv_sizes : which == GATE_UP ? ffn_sizes : whole;
    const int64_t n_targets = which == QKV ? 3 : which == GATE_UP ? 2 : 1;
    if (w->kind == INT4) /* the update inside the product's parallel region */
        return lora_int4_matmul(l->lora, l->lora_a[which], l->lora_bt[which],
                                l->lora_block_offset[which], n_targets, sizes, x, x_stride,
                                w->weight, w->scales, y, rows, n_out, k);
    int status = matmul(w, x, x_stride, y, rows, n_out, k);
    if (status) return status;
    return lora_update(l->lora, l->lora_a[which], l->lora_bt[which], l->lora_block_offset[which],
                       n_targets, sizes, x, x_stride, y, rows, n_out, k);
}

static inline uint16_t add_bf16(uint16_t a, uint16_t b) {
    return to_bf16(from_bf16(a) + from_bf16(b));
}

/* h [rows, dim]; cos, sin [rows, head_dim / 2] fp32; qkv [rows, (n_heads + 2 n_kv)
 * head_dim] receives Q and K rotated (HF layout: each head's two halves) and V. Returns 0,
 * or 2 when out of memory. */
int decoder_attention_input(const decoder_layer *l, const uint16_t *h, int64_t rows,
                            const float *cos, const float *sin, uint16_t *qkv) {
    const int64_t width = (l->n_heads + 2 * l->n_kv) * l->head_dim, half = l->head_dim / 2;
    uint16_t *normed = malloc(sizeof(uint16_t) * (rows > 0 ? rows : 1) * l->dim);
    if (normed == NULL) return 2;
    rms_norm_bf16(h, l->input_norm, normed, rows, l->dim, l->eps);
    int status = project(l, QKV, normed, l->dim, qkv, rows, width, l->dim);
    free(normed);
    if (status) return status;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *row = qkv + r * width;
        if (l->qkv_bias != NULL)
            for (int64_t i = 0; i < width; i++) row[i] = add_bf16(row[i], l->qkv_bias[i]);
        if (l->q_norm != NULL) {
            rms_norm_bf16(row, l->q_norm, row, l->n_heads, l->head_dim, l->eps);
            rms_norm_bf16(row + l->n_heads * l->head_dim, l->k_norm,
                          row + l->n_heads * l->head_dim, l->n_kv, l->head_dim, l->eps);
        }
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t head = 0; head < l->n_heads + l->n_kv; head++) {
            uint16_t *x = qkv + r * width + head * l->head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float x1 = from_bf16(x[i]), x2 = from_bf16(x[i + half]);
                x[i] = to_bf16(x1 * c[i] - x2 * s[i]);
                x[i + half] = to_bf16(x2 * c[i] + x1 * s[i]);
            }
        }
    }
    return 0;
}

/* h [rows, dim]; attn [rows, attn_stride], its first n_heads head_dim columns read; out
 * [rows, dim] receives the layer's output. Returns 0, or 2 when out of memory. */
int decoder_attention_output(const decoder_layer *l, const uint16_t *h, const uint16_t *attn,
                             int64_t attn_stride, int64_t rows, uint16_t *out) {
    const int64_t dim = l->dim, ffn = l->ffn, q_size = l->n_heads * l->head_dim;
    const int64_t n = rows > 0 ? rows : 1;
    const int64_t f = ffn > 0 ? ffn : 1; /* malloc(0) may give NULL */
    uint16_t *projected = malloc(sizeof(uint16_t) * n * dim);
    uint16_t *normed = malloc(sizeof(uint16_t) * n * dim);
    uint16_t *gate_up = malloc(sizeof(uint16_t) * n * 2 * f);
    uint16_t *act = malloc(sizeof(uint16_t) * n * f);
    int status = 2;
    if (!projected || !normed || !gate_up || !act) goto done;
    if ((status = project(l, O, attn, attn_stride, projected, rows, dim, q_size))) goto done;
    if (l->attn_out_norm != NULL)
        rms_norm_bf16(projected, l->attn_out_norm, projected, rows, dim, l->eps);
    if (l->o_bias != NULL)
        for (int64_t i = 0; i < rows * dim; i++)
            projected[i] = add_bf16(projected[i], l->o_bias[i % dim]);
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t i = 0; i < rows * dim; i++) out[i] = add_bf16(h[i], projected[i]);
    if (ffn == 0) { /* a mixture of experts: here where the layer holds it, else the caller's */
        if (l->moe != NULL) status = moe_layer_bf16(l->moe, out, rows, out);
        goto done;
    }
    rms_norm_bf16(out, l->post_attention_norm, normed, rows, dim, l->eps);
    if ((status = project(l, GATE_UP, normed, dim, gate_up, rows, 2 * ffn, dim))) goto done;
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < ffn; i++) {
            const float g = from_bf16(gate_up[r * 2 * ffn + i]);
            /* torch's GELU-tanh: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) */
            const float a = l->gelu ? 0.5f * g *
                                          (1.0f + tanhf(0.7978845608028654f *
                                                        (g + 0.044715f * g * g * g)))
                                    : g / (1.0f + expf(-g));
            act[r * ffn + i] = to_bf16(round_to(a, 1) * from_bf16(gate_up[r * 2 * ffn + ffn + i]));
        }
    if ((status = project(l, DOWN, act, ffn, projected, rows, dim, ffn))) goto done;
    if (l->ffn_out_norm != NULL)
        rms_norm_bf16(projected, l->ffn_out_norm, projected, rows, dim, l->eps);
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t i = 0; i < rows * dim; i++) out[i] = add_bf16(out[i], projected[i]);
done:
    free(projected);
    free(normed);
    free(gate_up);
    free(act);
    return status;
}

int paged_decode_bf16(const void *q, int64_t q_row_stride, const void *k_cache,
                      const void *v_cache, const int64_t *block_tables, int64_t table_stride,
                      const int64_t *seq_lens, void *out, int64_t rows, int64_t n_heads,
                      int64_t n_kv, int64_t head_dim, int64_t block_size, float scale,
                      int64_t window, const float *sinks);
int paged_decode_int8_bf16(const void *q, int64_t q_row_stride, const int8_t *k_cache,
                           const int8_t *v_cache, const int64_t *block_tables,
                           int64_t table_stride, const int64_t *seq_lens, void *out,
                           int64_t rows, int64_t n_heads, int64_t n_kv, int64_t head_dim,
                           int64_t block_size, float scale, int64_t window);
void kv_int8_write_bf16(const void *x, int64_t row_stride, int64_t rows, const int64_t *slots,
                        int8_t *cache, int64_t n_kv, int64_t head_dim);
int paged_decode_fits(int64_t n_heads, int64_t n_kv, int64_t head_dim);

/* The whole layer for a batch of decodes, one new token per row, in one call: the
 * attention input, K and V stored at their cache slots, decode attention over the paged
 * cache (paged_decode.c), the attention output. Caches [blocks, block_size, n_kv,
 * head_dim] bf16, or with `int8` the int8 cache's [.., head_dim + 2] slots, written and
 * read by paged_decode_int8.c; slots [rows]; block_tables [rows, table_stride]; seq_lens
 * [rows], the new token included; window: the layer's sliding window, 0 for none.
 * Returns 0, 1 for shapes past the attention kernel's buffers (nothing is written then),
 * or 2 when out of memory. */
int decoder_layer_decode(const decoder_layer *l, const uint16_t *h, int64_t rows,
                         const float *cos, const float *sin, void *k_cache, void *v_cache,
                         const int64_t *slots, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *seq_lens, int64_t block_size,
                         float scale, int64_t window, int64_t int8, uint16_t *out) {
    const int64_t q_size = l->n_heads * l->head_dim, kv_size = l->n_kv * l->head_dim;
    const int64_t width = q_size + 2 * kv_size, n = rows > 0 ? rows : 1;
    if (!paged_decode_fits(l->n_heads, l->n_kv, l->head_dim)) return 1;
    uint16_t *qkv = malloc(sizeof(uint16_t) * n * width);
    uint16_t *attn = malloc(sizeof(uint16_t) * n * q_size);
    int status = 2;
    if (!qkv || !attn) goto done;
    if ((status = decoder_attention_input(l, h, rows, cos, sin, qkv))) goto done;
    if (int8) {
        kv_int8_write_bf16(qkv + q_size, width, rows, slots, k_cache, l->n_kv, l->head_dim);
        kv_int8_write_bf16(qkv + q_size + kv_size, width, rows, slots, v_cache, l->n_kv,
                           l->head_dim);
        status = paged_decode_int8_bf16(qkv, width, k_cache, v_cache, block_tables,
                                        table_stride, seq_lens, attn, rows, l->n_heads,
                                        l->n_kv, l->head_dim, block_size, scale, window);
    } else {
        for (int64_t r = 0; r < rows; r++) {
            memcpy((uint16_t *)k_cache + slots[r] * kv_size, qkv + r * width + q_size,
                   sizeof(uint16_t) * kv_size);
            memcpy((uint16_t *)v_cache + slots[r] * kv_size, qkv + r * width + q_size + kv_size,
                   sizeof(uint16_t) * kv_size);
        }
        status = paged_decode_bf16(qkv, width, k_cache, v_cache, block_tables, table_stride,
                                   seq_lens, attn, rows, l->n_heads, l->n_kv, l->head_dim,
                                   block_size, scale, window, l->sinks);
    }
    if (status) goto done;
    status = decoder_attention_output(l, h, attn, q_size, rows, out);
done:
    free(qkv);
    free(attn);
    return status;
}
