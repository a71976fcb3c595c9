/* LoRA adapters in the C decoder layer: a step's rows and the resident slots they use,
 * as model/native/lora.py fills them, and the update lora_update.c adds after a
 * projection's base product. */
#ifndef LLAMASERVE_LORA_STEP_H
#define LLAMASERVE_LORA_STEP_H

#include <stdint.h>

/* One step, shared by every layer. Mirrored by a ctypes.Structure in model/native/lora.py. */
typedef struct {
    const int64_t *row_slots; /* [rows]: each row's slot, -1 for the base alone; NULL: no
                                 row of this step has an adapter */
    const int64_t *ranks;     /* [n_slots]: the largest rank of the adapter in each slot */
    int64_t n_slots, max_rank;
    /* Each slot's copies of every layer in one block (model/lora/slots.py), slot s's at
     * blocks + s * block_stride: read when one slot's rows are a step's only adapter rows.
     * NULL: the stacks alone. */
    const uint16_t *blocks;
    int64_t block_stride;
} lora_step;

/* y [rows, n_out] bf16 (contiguous), the base product of x [rows, k] (row stride
 * x_stride): each row of a slot >= 0 becomes bf16(y + bf16(x A^T B^T)) with its slot's A
 * [n_targets * max_rank, k] and B^T [max_rank, n_out] (model/lora/slots.py's copies, bf16,
 * widened to fp32 as they are read, all sums in fp32; output columns split among the targets
 * by `sizes`). `a` and `bt`: the slots' stacks; block_offset: where this
 * projection's A (then its B^T) lies in each slot's block. Rows of slot -1 are not touched.
 * Returns 0, or 2 when out of memory. */
int lora_update(const lora_step *step, const uint16_t *a, const uint16_t *bt,
                int64_t block_offset, int64_t n_targets, const int64_t *sizes,
                const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t rows, int64_t n_out,
                int64_t k);

/* The int4 base product (int4_matmul.c's layout: w4, sz4) into y, then lora_update's
 * update, the same bits; an update small enough to stay on one thread runs inside the
 * product's parallel region instead, shared by its threads. Returns 0, or 2 when out of
 * memory. */
int lora_int4_matmul(const lora_step *step, const uint16_t *a, const uint16_t *bt,
                     int64_t block_offset, int64_t n_targets, const int64_t *sizes,
                     const uint16_t *x, int64_t x_stride, const uint8_t *w4, const uint16_t *sz4,
                     uint16_t *y, int64_t rows, int64_t n_out, int64_t k);

#endif
