/* The top k of n fp32 values in the order torch.topk returns them on the CPU, ties
 * included: ATen's topk (ATen/native/TopKImpl.h) fills (value, index) pairs in index order
 * and, for k * 64 <= n, runs std::partial_sort over them, else std::nth_element to the k-th
 * and std::sort of the k - 1 before it, all with "a before b when a's value is greater"
 * (NaN first). Which of several equal values comes first is whatever those algorithms'
 * moves leave, so this file repeats libstdc++'s (bits/stl_algo.h, bits/stl_heap.h) move for
 * move; tests/test_moe_router.py checks it against torch.topk on values with many ties.
 * A mixture of experts' router (moe_router.c) picks its experts with it, so that a tie
 * between two experts' logits picks the expert the PyTorch path picks.
 */
#include <math.h>
#include <stdint.h>

#include "topk_select.h"

#define THRESHOLD 16 /* libstdc++'s _S_threshold */

static inline int before(const topk_pair *a, const topk_pair *b) {
    return (isnan(a->value) && !isnan(b->value)) || a->value > b->value;
}

static inline void swap(topk_pair *a, topk_pair *b) {
    const topk_pair t = *a;
    *a = *b;
    *b = t;
}

static int64_t lg(int64_t n) { return 63 - __builtin_clzll((unsigned long long)n); }

/* bits/stl_heap.h: __push_heap, __adjust_heap, __make_heap, __pop_heap */
static void push_heap(topk_pair *first, int64_t hole, int64_t top, topk_pair value) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && before(&first[parent], &value)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = value;
}

static void adjust_heap(topk_pair *first, int64_t hole, int64_t len, topk_pair value) {
    const int64_t top = hole;
    int64_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (before(&first[child], &first[child - 1])) child--;
        first[hole] = first[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        first[hole] = first[child - 1];
        hole = child - 1;
    }
    push_heap(first, hole, top, value);
}

static void make_heap(topk_pair *first, topk_pair *last) {
    const int64_t len = last - first;
    if (len < 2) return;
    for (int64_t parent = (len - 2) / 2;; parent--) {
        adjust_heap(first, parent, len, first[parent]);
        if (parent == 0) return;
    }
}

static void pop_heap(topk_pair *first, topk_pair *last, topk_pair *result) {
    const topk_pair value = *result;
    *result = *first;
    adjust_heap(first, 0, last - first, value);
}

/* bits/stl_algo.h: __heap_select, __partial_sort */
static void heap_select(topk_pair *first, topk_pair *middle, topk_pair *last) {
    make_heap(first, middle);
    for (topk_pair *i = middle; i < last; i++)
        if (before(i, first)) pop_heap(first, middle, i);
}

static void partial_sort(topk_pair *first, topk_pair *middle, topk_pair *last) {
    heap_select(first, middle, last);
    while (middle - first > 1) {
        middle--;
        pop_heap(first, middle, middle);
    }
}

/* __unguarded_linear_insert, __insertion_sort, __unguarded_insertion_sort */
static void linear_insert(topk_pair *last) {
    const topk_pair value = *last;
    topk_pair *next = last - 1;
    while (before(&value, next)) {
        *last = *next;
        last = next--;
    }
    *last = value;
}

static void insertion_sort(topk_pair *first, topk_pair *last) {
    if (first == last) return;
    for (topk_pair *i = first + 1; i != last; i++) {
        if (before(i, first)) {
            const topk_pair value = *i;
            for (topk_pair *j = i; j != first; j--) *j = *(j - 1);
            *first = value;
        } else {
            linear_insert(i);
        }
    }
}

/* __move_median_to_first, __unguarded_partition, __unguarded_partition_pivot */
static void median_to_first(topk_pair *result, topk_pair *a, topk_pair *b, topk_pair *c) {
    if (before(a, b)) {
        if (before(b, c)) swap(result, b);
        else if (before(a, c)) swap(result, c);
        else swap(result, a);
    } else if (before(a, c)) {
        swap(result, a);
    } else if (before(b, c)) {
        swap(result, c);
    } else {
        swap(result, b);
    }
}

static topk_pair *partition_pivot(topk_pair *first, topk_pair *last) {
    median_to_first(first, first + 1, first + (last - first) / 2, last - 1);
    topk_pair *pivot = first, *lo = first + 1, *hi = last;
    for (;;) {
        while (before(lo, pivot)) lo++;
        hi--;
        while (before(pivot, hi)) hi--;
        if (!(lo < hi)) return lo;
        swap(lo, hi);
        lo++;
    }
}

/* __introselect (std::nth_element) */
static void nth_element(topk_pair *first, topk_pair *nth, topk_pair *last) {
    if (first == last || nth == last) return;
    int64_t depth = lg(last - first) * 2;
    while (last - first > 3) {
        if (depth == 0) {
            heap_select(first, nth + 1, last);
            swap(first, nth);
            return;
        }
        depth--;
        topk_pair *cut = partition_pivot(first, last);
        if (cut <= nth) first = cut;
        else last = cut;
    }
    insertion_sort(first, last);
}

/* __introsort_loop and __final_insertion_sort (std::sort) */
static void introsort_loop(topk_pair *first, topk_pair *last, int64_t depth) {
    while (last - first > THRESHOLD) {
        if (depth == 0) {
            partial_sort(first, last, last);
            return;
        }
        depth--;
        topk_pair *cut = partition_pivot(first, last);
        introsort_loop(cut, last, depth);
        last = cut;
    }
}

static void sort(topk_pair *first, topk_pair *last) {
    if (first == last) return;
    introsort_loop(first, last, lg(last - first) * 2);
    if (last - first > THRESHOLD) {
        insertion_sort(first, first + THRESHOLD);
        for (topk_pair *i = first + THRESHOLD; i != last; i++) linear_insert(i);
    } else {
        insertion_sort(first, last);
    }
}

void topk_select(const float *values, int64_t n, int64_t k, topk_pair *work) {
    if (k <= 0) return;
    for (int64_t j = 0; j < n; j++) work[j] = (topk_pair){values[j], j};
    if (k * 64 <= n) {
        partial_sort(work, work + k, work + n);
    } else {
        nth_element(work, work + k - 1, work + n);
        sort(work, work + k - 1);
    }
}

/* For the tests: the top k of each of `rows` rows of n values, ids [rows, k]. */
int topk_select_rows(const float *values, int64_t rows, int64_t n, int64_t k, int64_t *ids) {
    topk_pair *work = malloc(sizeof(topk_pair) * (n > 0 ? n : 1));
    if (work == NULL) return 2;
    for (int64_t r = 0; r < rows; r++) {
        topk_select(values + r * n, n, k, work);
        for (int64_t j = 0; j < k; j++) ids[r * k + j] = work[j].index;
    }
    free(work);
    return 0;
}
