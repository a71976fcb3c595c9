/* A mixture-of-experts FFN as the C kernels read it (moe_experts.c, moe_router.c), and as
 * the C decoder layer (decoder_layer.c) runs it after attention. */
#ifndef LLAMASERVE_MOE_LAYER_H
#define LLAMASERVE_MOE_LAYER_H

#include <stdint.h>

#include "layer_weight.h"

/* Mirrored by a ctypes.Structure in model/native/moe.py: same fields, same order. */
typedef struct {
    const layer_weight *gate_up, *down; /* [n_experts] each */
    int64_t n_experts, top_k, dim, ffn;
    /* gpt-oss: biases [n_experts, 2 ffn] and [n_experts, dim] (NULL: none), and the gate
     * (up + 1) * g * sigmoid(alpha g), g = min(gate, limit), up within +-limit (limit 0:
     * SiLU(gate) * up). */
    const uint16_t *gate_up_bias, *down_bias;
    float limit, alpha;
    /* The router, where the C call routes too (NULL `router`: the caller gives the experts
     * and their weights): the post-attention RMSNorm's weight [dim] and eps, the router's
     * weight [n_experts, dim] and gpt-oss's bias [n_experts] (NULL: none), all bf16;
     * `norm_topk`: the top k weights renormalised to sum to 1 (Qwen3-MoE's
     * norm_topk_prob; gpt-oss's softmax over its top k logits is the same). */
    const uint16_t *norm, *router, *router_bias;
    float eps;
    int64_t norm_topk;
} moe_experts;

/* See moe_experts.c and moe_router.c. */
int moe_experts_bf16(const moe_experts *m, const uint16_t *x, int64_t rows, const int64_t *ids,
                     const uint16_t *weights, const uint16_t *h, uint16_t *out);
int moe_route_bf16(const moe_experts *m, const uint16_t *x, int64_t rows, int64_t *ids,
                   uint16_t *weights);
int moe_layer_bf16(const moe_experts *m, const uint16_t *h, int64_t rows, uint16_t *out);

#endif
