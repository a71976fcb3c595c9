/* Activations rounded to int8 for the matmuls with int8 activations (int4_matmul_a8.c,
 * int5_matmul_a8.c): each row of x in groups of 32 along K, x ~ xq * d with xq in
 * -127..127 and d = max |x| / 127 per (row, group), as llama.cpp's Q8_0 does. A row is
 * quantised and summed alone, in the same order whatever the number of rows, so its
 * result does not depend on its batch. */
#ifndef LLAMASERVE_INT8_ROWS_H
#define LLAMASERVE_INT8_ROWS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "tiles.h"

/* Per (row, group) constants of the quantised x. */
typedef struct {
    float d;    /* the scale of xq */
    float dsum; /* d sum xq: the weights' offset (8 for int4, 16 for int5) times it is
                   subtracted once per group */
    float sum;  /* sum of x itself, for zeros */
    float offset8; /* 8 (sum - dsum): the Q4_K loop's per-group term (int4_matmul_a8.c),
                      taken once here rather than per tile (3% of a 128-row product) */
} group_constants;

/* A row's K values in groups of 32 as xq, in K order (`k_order`) or K offsets 0, 2, 1, 3 in
 * each four, as vpdpbusd's lanes hold a tile's nibbles; written as loops the compiler
 * vectorises. */
static void quantise_row(const uint16_t *x, int64_t groups, int8_t *xq, group_constants *c,
                         int k_order) {
    for (int64_t g = 0; g < groups; g++) {
        float v[GROUP], top = 0.0f, sum = 0.0f;
        for (int j = 0; j < GROUP; j++) v[j] = from_bf16(x[g * GROUP + j]);
        for (int j = 0; j < GROUP; j++) {
            sum += v[j];
            top = fmaxf(top, fabsf(v[j]));
        }
        const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
        int32_t q[GROUP], total = 0;
        for (int j = 0; j < GROUP; j++) q[j] = (int32_t)nearbyintf(v[j] * inverse);
        for (int j = 0; j < GROUP; j++) total += q[j];
        if (k_order) {
            for (int j = 0; j < GROUP; j++) xq[g * GROUP + j] = (int8_t)q[j];
        } else {
            uint32_t fours[GROUP / 4];
            for (int f = 0; f < GROUP / 4; f++)
                fours[f] = (uint32_t)(q[4 * f] & 255) | (uint32_t)(q[4 * f + 2] & 255) << 8 |
                           (uint32_t)(q[4 * f + 1] & 255) << 16 |
                           (uint32_t)(q[4 * f + 3] & 255) << 24;
            memcpy(xq + g * GROUP, fours, GROUP);
        }
        c[g].d = top / 127.0f;
        c[g].dsum = c[g].d * (float)total;
        c[g].sum = sum;
        c[g].offset8 = 8.0f * (sum - c[g].dsum);
    }
}

/* Every row of x [rows, x_stride] bf16 quantised: *xq [rows, k], *c [rows, k / 32], to be
 * freed by the caller. Returns 0, or 2 when out of memory (nothing then to free). */
static int quantise_rows(const uint16_t *x, int64_t x_stride, int64_t rows, int64_t k,
                         int k_order, int8_t **xq, group_constants **c) {
    const int64_t groups = k / GROUP, n = rows > 0 ? rows : 1;
    *xq = malloc((size_t)(n * k));
    *c = malloc(sizeof(group_constants) * n * groups);
    if (*xq == NULL || *c == NULL) {
        free(*xq);
        free(*c);
        return 2;
    }
    int8_t *q = *xq;
    group_constants *constants = *c;
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t m = 0; m < rows; m++)
        quantise_row(x + m * x_stride, groups, q + m * k, constants + m * groups, k_order);
    return 0;
}

#endif
