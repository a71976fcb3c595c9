/* The top k of n fp32 values: the greatest first, equal values in index order (a NaN counts
 * as the greatest), which is the order torch.sort(descending=True, stable=True) gives. A
 * mixture of experts' router (moe_router.c) picks its experts with it and the PyTorch router
 * (`SparseMoE.route`, model/network/moe.py) picks by the same rule, so a tie between two
 * experts, common once logits are rounded to bf16, picks the same expert on both paths.
 * k is a router's few experts a token, so keeping the top k sorted while scanning once is
 * the whole algorithm.
 */
#include <math.h>
#include <stdint.h>

#include "topk_select.h"

/* a before b: a is greater, or a NaN where b is not. Equal values are never before one
 * another, so the scan in index order leaves them in index order. */
static inline int before(const topk_pair *a, const topk_pair *b) {
    return (isnan(a->value) && !isnan(b->value)) || a->value > b->value;
}

void topk_select(const float *values, int64_t n, int64_t k, topk_pair *work) {
    int64_t filled = 0;
    if (k > n) k = n;
    if (k <= 0) return;
    for (int64_t i = 0; i < n; i++) {
        const topk_pair pair = {values[i], i};
        if (filled == k && !before(&pair, &work[k - 1])) continue;
        int64_t j = filled < k ? filled++ : k - 1;
        for (; j > 0 && before(&pair, &work[j - 1]); j--) work[j] = work[j - 1];
        work[j] = pair;
    }
}

/* For the tests: the top k of each of `rows` rows of n values, ids [rows, k]. */
int topk_select_rows(const float *values, int64_t rows, int64_t n, int64_t k, int64_t *ids) {
    topk_pair *work = malloc(sizeof(topk_pair) * (k > 0 ? k : 1));
    if (work == NULL) return 2;
    for (int64_t r = 0; r < rows; r++) {
        topk_select(values + r * n, n, k, work);
        for (int64_t j = 0; j < k; j++) ids[r * k + j] = work[j].index;
    }
    free(work);
    return 0;
}
