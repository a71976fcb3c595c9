/* A projection as the C decoder layer (decoder_layer.c) and the mixture-of-experts FFN
 * (moe_experts.c) read it: its weight bytes, scales and kind. */
#ifndef LLAMASERVE_LAYER_WEIGHT_H
#define LLAMASERVE_LAYER_WEIGHT_H

#include <stdint.h>

/* How a projection's weight is stored and multiplied. */
enum { INT4 = 0, INT4_A8 = 1, INT8_GROUPS = 2, INT5 = 3, INT6 = 4, INT5_A8 = 5, MXFP4 = 6,
       MXFP4_A8 = 7, INT6_A8 = 8, INT8_GROUPS_A8 = 9, INT4K = 10, INT4K_A8 = 11, SPLIT = 12 };

typedef struct {
    const uint8_t *weight; /* int4_matmul.c's, int5_, int6_ or int8_matmul.c's layout; MXFP4:
                              GGUF's blocks, scales within */
    const void *scales;    /* int4: bf16 scale and zero pairs, int4k: superblocks
                              (int4_scales.h); int5, grouped int8: fp16; int6: fp32 */
    int64_t kind;
} layer_weight;

/* SPLIT: one projection held in two kinds (model/quant/split.py: a Q/K/V layer's Q and K in
 * their format, int4 or int5, its V in its own); `weight` points to this. Outputs
 * [0, first_rows) come from `first`, the rest from `second`. */
typedef struct {
    layer_weight first, second;
    int64_t first_rows;
} split_weight;

/* y [rows, n_out] bf16 = x [rows, k] (row stride x_stride) times the weight; 0, or 2 when
 * out of memory. */
int layer_matmul(const layer_weight *w, const uint16_t *x, int64_t x_stride, uint16_t *y,
                 int64_t rows, int64_t n_out, int64_t k);

#endif
