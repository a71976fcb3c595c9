/* int4_matmul.c's portable loop, for a CPU with neither AVX-512 BF16 nor AVX2 + FMA: the
 * same tile_block as its vector loops, included in their place. */
#ifndef LLAMASERVE_INT4_PORTABLE_H
#define LLAMASERVE_INT4_PORTABLE_H

#include <stdint.h>

#include "bf16.h"
#include "int4_scales.h"
#include "tiles.h"

/* Portable version: each group of the tile is expanded to fp32 once per block of rows, and
 * the compiler vectorises the 16 columns. One row's sums are a call of their own, so that
 * fast math cannot order them differently for blocks of a different size. */
static __attribute__((noinline)) void row_group(
    const float wq[GROUP][TILE], const uint16_t *xg, const float scale[TILE],
    const float zero[TILE], float xsum, float total[TILE]) {
    float part[TILE] = {0};
    for (int k = 0; k < GROUP; k++) {
        const float xv = from_bf16(xg[k]);
        for (int i = 0; i < TILE; i++) part[i] += xv * wq[k][i];
    }
    for (int i = 0; i < TILE; i++)
        total[i] += part[i] * scale[i] + xsum * zero[i];
}

static inline void one_tile(
    const uint16_t *x, int64_t x_stride, const float *xsum, int64_t groups,
    const uint8_t *w, const uint16_t *sz, uint16_t *y, int64_t y_stride, const int rows) {
    float total[ROW_BLOCK][TILE] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        float wq[GROUP][TILE];
        const uint8_t *wg = w + g * (TILE * GROUP / 2);
        for (int s = 0; s < GROUP / 4; s++)
            for (int i = 0; i < TILE; i++)
                for (int e = 0; e < 2; e++) {
                    uint8_t byte = wg[32 * s + 2 * i + e];
                    wq[4 * s + e][i] = (float)(byte & 15) - 8.0f;
                    wq[4 * s + 2 + e][i] = (float)(byte >> 4) - 8.0f;
                }
        float scale[TILE], zero[TILE];
        for (int i = 0; i < TILE; i++) int4_scale_zero_at(sz, g, i, &scale[i], &zero[i]);
        for (int m = 0; m < rows; m++)
            row_group(wq, x + m * x_stride + g * GROUP, scale, zero, xsum[m * groups + g],
                      total[m]);
    }
    for (int m = 0; m < rows; m++)
        for (int i = 0; i < TILE; i++) y[m * y_stride + i] = to_bf16(total[m][i]);
}
static inline void tile_block(
    const uint16_t *x, int64_t x_stride, const float *xf, const float *xsum, int64_t groups,
    const uint8_t *w, int64_t tile_bytes, const uint16_t *sz, int64_t tile_scales,
    uint16_t *y, int64_t y_stride, const int rows, const int tiles) {
    (void)xf;
    for (int j = 0; j < tiles; j++)
        one_tile(x, x_stride, xsum, groups, w + j * tile_bytes, sz + j * tile_scales,
                 y + j * TILE, y_stride, rows);
}

#endif
