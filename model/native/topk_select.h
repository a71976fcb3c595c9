/* The top k of n values, the greatest first, ties in index order (topk_select.c). */
#ifndef LLAMASERVE_TOPK_SELECT_H
#define LLAMASERVE_TOPK_SELECT_H

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    float value;
    int64_t index;
} topk_pair;

/* work [k]: receives the top k (value, index) pairs in that order (k <= n). */
void topk_select(const float *values, int64_t n, int64_t k, topk_pair *work);

#endif
