/* The portable loops' sum of one row over one group of 32, against a tile's 16 columns
 * expanded to fp32 (`wq`) and scaled by one fp16 scale per column: shared by the
 * symmetric kernels (int5_matmul.c, int8_matmul.c). A call of its own per row, so that
 * fast math cannot order a row's sums differently for blocks of a different size. */
#ifndef LLAMASERVE_PORTABLE_GROUP_H
#define LLAMASERVE_PORTABLE_GROUP_H

#include <stdint.h>

#include "bf16.h"
#include "tiles.h"

static __attribute__((noinline)) void row_group(const float wq[GROUP][TILE], const uint16_t *xg,
                                                const uint16_t *scale, float total[TILE]) {
    float part[TILE] = {0};
    for (int k = 0; k < GROUP; k++) {
        const float xv = from_bf16(xg[k]);
        for (int i = 0; i < TILE; i++) part[i] += xv * wq[k][i];
    }
    for (int i = 0; i < TILE; i++) total[i] += part[i] * from_fp16(scale[i]);
}

#endif
