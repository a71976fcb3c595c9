/* torch.topk's order of the top k of n values, ties included (topk_select.c). */
#ifndef LLAMASERVE_TOPK_SELECT_H
#define LLAMASERVE_TOPK_SELECT_H

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    float value;
    int64_t index;
} topk_pair;

/* work [n]: receives the n (value, index) pairs, the top k first in torch.topk's order. */
void topk_select(const float *values, int64_t n, int64_t k, topk_pair *work);

#endif
