/* A mixture of experts' router and whole FFN in C (model/native/moe.py): the post-attention
 * RMSNorm, the router's logits, a softmax in fp32, the top k experts, ties in index order
 * (topk_select.c), their weights renormalised where the family does (Qwen3-MoE's
 * norm_topk_prob, gpt-oss), then the experts (moe_experts.c). The C decoder layer calls
 * `moe_layer_bf16` after attention, so a decode step makes one call a layer.
 *
 * Rounds where model/network/moe.py's PyTorch `route` does: the logits to bf16 (its
 * bf16 linear layer; gpt-oss's bias is added before that one rounding), the softmax and
 * renormalisation in fp32, the weights to bf16. The logits' sums run in another order than
 * PyTorch's product, so a logit can land one bf16 step away where the exact sum sits near a
 * rounding boundary; equal logits give equal probabilities, and a tie picks the lower index,
 * as the PyTorch router does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "moe_layer.h"
#include "topk_select.h"

#define PARALLEL_ROWS 64 /* as decoder_layer.c: a prefill chunk's rows, not a decode's */

void rms_norm_bf16(const void *x, const void *weight, void *out, int64_t rows, int64_t width,
                   float eps);

/* One row's top k: ids [k] and weights [k] bf16. `scratch`: 2 n_experts + dim floats and
 * n_experts pairs. */
static void route_row(const moe_experts *m, const uint16_t *x, int64_t *ids, uint16_t *weights,
                      float *scratch, topk_pair *work) {
    const int64_t n = m->n_experts, dim = m->dim, k = m->top_k;
    float *xf = scratch, *probs = scratch + dim;
    for (int64_t i = 0; i < dim; i++) xf[i] = from_bf16(x[i]);
    float top = 0.0f;
    for (int64_t e = 0; e < n; e++) {
        const uint16_t *w = m->router + e * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) sum += xf[i] * from_bf16(w[i]);
        if (m->router_bias != NULL) sum += from_bf16(m->router_bias[e]);
        probs[e] = round_to(sum, 1);
        top = e == 0 || probs[e] > top ? probs[e] : top;
    }
    float total = 0.0f;
    for (int64_t e = 0; e < n; e++) total += probs[e] = expf(probs[e] - top);
    const float inverse = 1.0f / total;
    for (int64_t e = 0; e < n; e++) probs[e] *= inverse;
    topk_select(probs, n, k, work);
    float chosen = 0.0f;
    for (int64_t j = 0; j < k; j++) chosen += work[j].value;
    for (int64_t j = 0; j < k; j++) {
        ids[j] = work[j].index;
        weights[j] = to_bf16(m->norm_topk ? work[j].value / chosen : work[j].value);
    }
}

/* x [rows, dim] the normalised rows; ids [rows, top_k] and weights [rows, top_k] bf16
 * receive the router's choice. Returns 0, or 2 when out of memory. */
int moe_route_bf16(const moe_experts *m, const uint16_t *x, int64_t rows, int64_t *ids,
                   uint16_t *weights) {
    int status = 0;
#pragma omp parallel if (rows >= PARALLEL_ROWS) reduction(max : status)
    {
        float *scratch = malloc(sizeof(float) * (2 * m->n_experts + m->dim));
        topk_pair *work = malloc(sizeof(topk_pair) * m->n_experts);
        if (scratch == NULL || work == NULL) {
            status = 2;
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                route_row(m, x + r * m->dim, ids + r * m->top_k, weights + r * m->top_k,
                          scratch, work);
        }
        free(scratch);
        free(work);
    }
    return status;
}

/* h [rows, dim] the residual after attention; out [rows, dim] (may be h) receives h plus
 * the experts' output for RMSNorm(h), routed here. Returns 0, or 2 when out of memory. */
int moe_layer_bf16(const moe_experts *m, const uint16_t *h, int64_t rows, uint16_t *out) {
    const int64_t n = rows > 0 ? rows : 1;
    uint16_t *x = malloc(sizeof(uint16_t) * n * m->dim);
    int64_t *ids = malloc(sizeof(int64_t) * n * m->top_k);
    uint16_t *weights = malloc(sizeof(uint16_t) * n * m->top_k);
    int status = 2;
    if (x != NULL && ids != NULL && weights != NULL) {
        rms_norm_bf16(h, m->norm, x, rows, m->dim, m->eps);
        status = moe_route_bf16(m, x, rows, ids, weights);
        if (!status) status = moe_experts_bf16(m, x, rows, ids, weights, h, out);
    }
    free(x);
    free(ids);
    free(weights);
    return status;
}
