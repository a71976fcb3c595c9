/* Every decoder layer of a step of decodes in one call: decoder_layer.c's
 * decoder_layer_decode once per layer, each layer's output the next one's input. The same
 * calls, in the same order, as the Python loop over the layers makes; only the ~6 us of
 * Python around each of them (a module call, its checks, a ctypes call of 16 arguments,
 * an output tensor) go. */
#include <stdint.h>
#include <stdlib.h>

/* decoder_layer.c's; `layer` is its `decoder_layer`, passed through as a pointer. */
int decoder_layer_decode(const void *layer, const uint16_t *h, int64_t rows, const float *cos,
                         const float *sin, void *k_cache, void *v_cache, const int64_t *slots,
                         const int64_t *block_tables, int64_t table_stride,
                         const int64_t *seq_lens, int64_t block_size, float scale,
                         int64_t window, int64_t int8, uint16_t *out);

/* Mirrored by a ctypes.Structure in model/native/layer_stack.py: same fields, same order. */
typedef struct {
    const void *layer;
    void *k_cache, *v_cache;
    float scale;
    int64_t window; /* 0: the whole context */
    int64_t local;  /* 1: the layer rotates with the local angles (Gemma 3's windowed ones) */
} stack_layer;

/* h, out [rows, dim] bf16; cos, sin [rows, head_dim / 2] fp32, local_cos and local_sin the
 * windowed layers' (the same where the family has one RoPE base); the rest as
 * decoder_layer_decode reads it. Returns its status, from the first layer that fails: 1
 * (shapes past the attention kernel's buffers) can only come from the first, before
 * anything is written. */
int decoder_stack_decode(const stack_layer *layers, int64_t n_layers, const uint16_t *h,
                         int64_t rows, int64_t dim, const float *cos, const float *sin,
                         const float *local_cos, const float *local_sin, const int64_t *slots,
                         const int64_t *block_tables, int64_t table_stride,
                         const int64_t *seq_lens, int64_t block_size, int64_t int8,
                         uint16_t *out) {
    uint16_t *spare = malloc(sizeof(uint16_t) * (rows > 0 ? rows : 1) * dim);
    if (!spare)
        return 2;
    const uint16_t *in = h;
    int status = 0;
    for (int64_t i = 0; i < n_layers && !status; i++) {
        const stack_layer *l = &layers[i];
        /* Alternating buffers, so that the last layer writes into `out`. */
        uint16_t *dst = (n_layers - 1 - i) % 2 == 0 ? out : spare;
        status = decoder_layer_decode(l->layer, in, rows, l->local ? local_cos : cos,
                                      l->local ? local_sin : sin, l->k_cache, l->v_cache, slots,
                                      block_tables, table_stride, seq_lens, block_size, l->scale,
                                      l->window, int8, dst);
        in = dst;
    }
    free(spare);
    return status;
}
