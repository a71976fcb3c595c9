/* The low-rank update of LoRA adapters after a projection's base product in the C decoder
 * layer (decoder_layer.c), for a step whose rows use different adapters: rows are grouped
 * by slot, as punica and S-LoRA group them, so that each resident adapter's A and B are
 * read once per step however many of its rows the step holds.
 *
 * Two passes, shared among the OpenMP team when the step's adapters or rows are many: the
 * shrink u = x A^T (one item per slot and row of A) and the expand y += u B^T (one item
 * per slot and block of output columns, within one target). Each value is summed in one
 * fixed order whatever the other rows are (the shrink in 16 lanes by position in the row,
 * the expand over the rank in order), so a row's update never depends on its neighbours
 * (nor on the blocks of rows taken at once), and a row without an adapter is never written.
 *
 * A and B^T are bf16 (model/lora/slots.py's copies for this layer): the step is bound by
 * the bytes it reads, and the update's are half those of fp32. Each weight is widened to
 * fp32 as it is read (a shift, which vectorises) and every sum stays in fp32. A step whose
 * adapter rows all use one slot reads that slot's copies from its own block (every layer's,
 * in the order a step reads them: one run of memory); a step of several slots reads the
 * per-projection stacks, where the slots lie side by side. Both hold the same values in
 * the same shapes, so a row's update is the same bits whichever it reads; and whether the
 * expand's columns are cut by its items or by the threads' tiles of an int4 product, as
 * each column is summed alone.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "lora_step.h"

#define LANES 16
/* Output columns per item of the expand: runs along each row of B^T, and one accumulator
 * row that stays in L1. 64 rather than 256: a 576-column projection then splits 5 to 4
 * between two threads rather than 512 columns to 64. */
#define COLUMNS 64
/* Below this many weights (or with a team of one) an update is not given a parallel region
 * of its own: one rank-16 adapter's row on a model of SmolLM2-135M's size (18k to 68k
 * weights a call). In a region of its own, its two barriers a call cost more than they
 * gained whenever the other core was busy (a step 0.25 ms slower; 0.1 ms faster on an idle
 * machine); after an int4 base product it runs inside the product's region instead, shared
 * (lora_int4_matmul), else on the calling thread. Eight adapters' updates (147k and up)
 * gained 2-3% shared (docs/adapters.md). */
#define PARALLEL_WEIGHTS 131072
/* From this many adapter rows (int4's PAIRED_ROWS) an update gets a region of its own: alone,
 * one thread spent 43 ms of SmolLM2-135M's 154 ms 128-token prefill on rank-16 updates. */
#define SHARED_ROWS 16

/* The sum of a row's LANES partial sums, in one fixed order: one function (not inlined) for
 * a row alone and a row in a block, so that -ffast-math cannot reduce them differently. */
__attribute__((noinline)) static float lanes_sum(const float *acc) {
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += acc[l];
    return sum;
}

/* x . a (both bf16) over k, in LANES fp32 partial sums: the same order for every row. */
static float dot(const uint16_t *x, const uint16_t *a, int64_t k) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += from_bf16(x[i + l]) * from_bf16(a[i + l]);
    for (int l = 0; i + l < k; l++) acc[l] += from_bf16(x[i + l]) * from_bf16(a[i + l]);
    return lanes_sum(acc);
}

/* Rows at once in the shrink and the expand: each weight, widened once, serves them all. Each
 * row's lanes and columns take the same products in the same order as when it is alone. */
#define ROW_BLOCK 4

/* dot for ROW_BLOCK rows x[r] against one a: out[r], the same bits as dot(x[r], a, k). */
static void dot_block(const uint16_t *const *x, const uint16_t *a, int64_t k, float *out) {
    float acc[ROW_BLOCK][LANES] = {{0}};
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float av = from_bf16(a[i + l]);
            for (int r = 0; r < ROW_BLOCK; r++) acc[r][l] += from_bf16(x[r][i + l]) * av;
        }
    for (int l = 0; i + l < k; l++) {
        const float av = from_bf16(a[i + l]);
        for (int r = 0; r < ROW_BLOCK; r++) acc[r][l] += from_bf16(x[r][i + l]) * av;
    }
    for (int r = 0; r < ROW_BLOCK; r++) out[r] = lanes_sum(acc[r]);
}

/* The rows of each used slot, slot by slot: order[first[g] .. first[g + 1]) are group g's
 * rows, slot[g] its slot. Returns the number of groups. */
static int64_t group_rows(const lora_step *step, int64_t rows, int64_t *order, int64_t *first,
                          int64_t *slot) {
    int64_t groups = 0, n = 0;
    for (int64_t s = 0; s < step->n_slots; s++) {
        const int64_t start = n;
        for (int64_t r = 0; r < rows; r++)
            if (step->row_slots[r] == s) order[n++] = r;
        if (n > start && step->ranks[s] > 0) {
            first[groups] = start;
            slot[groups++] = s;
        } else {
            n = start;
        }
    }
    first[groups] = n;
    return groups;
}

/* What one call's passes read, for `passes`. */
typedef struct {
    const lora_step *step;
    const uint16_t *a, *bt, *x;
    uint16_t *y;
    const int64_t *sizes, *order, *first, *slot, *block_target, *block_start;
    float *u;
    int64_t a_stride, bt_stride, x_stride, width, n_out, k, groups, blocks, n_targets;
} update;

/* Row p's update of n columns from c0, from its sums acc. */
static void add_update(const update *w, int64_t p, int64_t c0, int64_t n, const float *acc) {
    uint16_t *out = w->y + w->order[p] * w->n_out + c0;
    for (int64_t c = 0; c < n; c++)
        out[c] = to_bf16(from_bf16(out[c]) + from_bf16(to_bf16(acc[c])));
}

/* ROW_BLOCK rows' expand from p: B^T's rows b (from column c0), their sums u. */
__attribute__((always_inline)) static inline void expand_block(
    const update *w, const uint16_t *b, const float *u, int64_t p, int64_t c0, int64_t n,
    int64_t rank) {
    float acc[ROW_BLOCK][COLUMNS] = {{0}};
    for (int64_t j = 0; j < rank; j++) {
        const uint16_t *b_row = b + j * w->n_out;
        float up[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; r++) up[r] = u[(p + r) * w->width + j];
        for (int64_t c = 0; c < n; c++) {
            const float bv = from_bf16(b_row[c]);
            for (int r = 0; r < ROW_BLOCK; r++) acc[r][c] += up[r] * bv;
        }
    }
    for (int r = 0; r < ROW_BLOCK; r++) add_update(w, p + r, c0, n, acc[r]);
}

/* Group g's rows' expand over n columns from c0, all in target t: y[order[p], c] +=
 * sum_j u[p, t R + j] B^T[slot, j, c], summed over j in order; ROW_BLOCK rows at once, then
 * the rest one by one, each column's sum the same products in the same order. */
static void expand(const update *w, int64_t g, int64_t t, int64_t c0, int64_t n) {
    const int64_t s = w->slot[g], rank = w->step->ranks[s], end = w->first[g + 1];
    const uint16_t *b = w->bt + s * w->bt_stride + c0;
    const float *u = w->u + t * w->step->max_rank;
    int64_t p = w->first[g];
    for (; p + ROW_BLOCK <= end; p += ROW_BLOCK) /* a constant n: the sums stay in registers */
        if (n == COLUMNS)
            expand_block(w, b, u, p, c0, COLUMNS, rank);
        else
            expand_block(w, b, u, p, c0, n, rank);
    for (; p < end; p++) {
        float acc[COLUMNS] = {0};
        const float *up = u + p * w->width;
        for (int64_t j = 0; j < rank; j++) {
            const uint16_t *b_row = b + j * w->n_out;
            for (int64_t c = 0; c < n; c++) acc[c] += up[j] * from_bf16(b_row[c]);
        }
        add_update(w, p, c0, n, acc);
    }
}

/* The shrink, u[p, j] = x[order[p]] . A[slot, j], A's row j read once for its group; its
 * items shared among the team inside a parallel region, with no barrier after them. */
static void shrink(const void *work) {
    const update *w = work;
    const int64_t width = w->width, rank_max = w->step->max_rank, k = w->k;
#pragma omp for schedule(static) nowait
    for (int64_t item = 0; item < w->groups * width; item++) {
        const int64_t g = item / width, j = item % width, s = w->slot[g];
        if (j % rank_max >= w->step->ranks[s]) continue; /* zero padding: never read */
        const uint16_t *a_row = w->a + s * w->a_stride + j * k;
        int64_t p = w->first[g];
        for (; p + ROW_BLOCK <= w->first[g + 1]; p += ROW_BLOCK) {
            const uint16_t *x[ROW_BLOCK]; float out[ROW_BLOCK];
            for (int r = 0; r < ROW_BLOCK; r++) x[r] = w->x + w->order[p + r] * w->x_stride;
            dot_block(x, a_row, k, out);
            for (int r = 0; r < ROW_BLOCK; r++) w->u[(p + r) * width + j] = out[r];
        }
        for (; p < w->first[g + 1]; p++)
            w->u[p * width + j] = dot(w->x + w->order[p] * w->x_stride, a_row, k);
    }
}

/* The two passes; their loops are shared among the team when called inside a parallel
 * region, and run whole on the calling thread otherwise. */
static void passes(const update *w) {
    shrink(w);
#pragma omp barrier
    /* The expand: y[order[p], c] += sum_j u[p, t R + j] B^T[slot, j, c], c in target t. */
#pragma omp for schedule(static)
    for (int64_t item = 0; item < w->groups * w->blocks; item++) {
        const int64_t g = item / w->blocks, b = item % w->blocks, c0 = w->block_start[b];
        int64_t end = 0;
        for (int64_t i = 0; i <= w->block_target[b]; i++) end += w->sizes[i];
        expand(w, g, w->block_target[b], c0, end - c0 < COLUMNS ? end - c0 : COLUMNS);
    }
}

/* The expand of columns [c0, c1) for every group, on the calling thread: the same sums as
 * passes' items, cut at other columns (each column's sum is its own). */
static void expand_columns(const void *work, int64_t c0, int64_t c1) {
    const update *w = work;
    for (int64_t g = 0; g < w->groups; g++)
        for (int64_t t = 0, start = 0; t < w->n_targets; start += w->sizes[t++]) {
            const int64_t lo = c0 > start ? c0 : start;
            const int64_t hi = c1 < start + w->sizes[t] ? c1 : start + w->sizes[t];
            for (int64_t c = lo; c < hi; c += COLUMNS)
                expand(w, g, t, c, hi - c < COLUMNS ? hi - c : COLUMNS);
        }
}

/* int64 entries of a step's bookkeeping that live on the stack; more take one malloc. */
#define ON_STACK 2048

int int4_matmul_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w, const uint16_t *sz,
                     uint16_t *y, int64_t rows, int64_t n_out, int64_t k);
int int4_matmul_around_bf16(const uint16_t *x, int64_t x_stride, const uint8_t *w,
                            const uint16_t *sz, uint16_t *y, int64_t rows, int64_t n_out,
                            int64_t k, void (*before)(const void *),
                            void (*after)(const void *, int64_t, int64_t), const void *context);

/* The update, after the base product already in y, or with an int4 base (w4, sz4 not
 * NULL) computed here first: an update that would stay on the calling thread then runs in
 * the product's own parallel region, the shrink shared before its tiles and each thread's
 * expand over the columns of its tiles, so that both threads read the adapter without a
 * region or barrier of its own. */
static int update_after(const lora_step *step, const uint16_t *a, const uint16_t *bt,
                        int64_t block_offset, int64_t n_targets, const int64_t *sizes,
                        const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t rows,
                        int64_t n_out, int64_t k, const uint8_t *w4, const uint16_t *sz4) {
    const int64_t rank_max = step->max_rank, width = n_targets * rank_max;
    int64_t blocks = 0;
    for (int64_t t = 0; t < n_targets; t++) blocks += (sizes[t] + COLUMNS - 1) / COLUMNS;
    /* order, first, slot, block_target, block_start, then u (floats, in int64 units) */
    const int64_t u_words = (rows * (width > 0 ? width : 1) + 1) / 2;
    const int64_t words = rows + 2 * (step->n_slots + 1) + 2 * (blocks + 1) + u_words;
    int64_t stack[ON_STACK];
    int64_t *words_at = words <= ON_STACK ? stack : malloc(sizeof(int64_t) * words);
    if (words_at == NULL) return 2;
    int64_t *order = words_at, *first = order + rows, *slot = first + step->n_slots + 1;
    int64_t *block_target = slot + step->n_slots + 1, *block_start = block_target + blocks + 1;
    const int64_t groups = group_rows(step, rows, order, first, slot);
    for (int64_t t = 0, b = 0, offset = 0; t < n_targets; offset += sizes[t++])
        for (int64_t c = 0; c < sizes[t]; c += COLUMNS, b++) {
            block_target[b] = t;
            block_start[b] = offset + c;
        }
    int64_t weights = 0;
    for (int64_t g = 0; g < groups; g++) weights += step->ranks[slot[g]] * (n_targets * k + n_out);
    update w = {
        step, a, bt, x, y, sizes, order, first, slot, block_target, block_start,
        (float *)(block_start + blocks + 1),
        width * k,
        rank_max * n_out,
        x_stride, width, n_out, k, groups, blocks, n_targets,
    };
    if (groups == 1 && step->blocks != NULL) { /* one slot's rows: its own block */
        w.a = step->blocks + block_offset;
        w.bt = w.a + width * k;
        w.a_stride = w.bt_stride = step->block_stride;
    }
    const int team = omp_get_max_threads() > 1;
    const int shared = team && (weights >= PARALLEL_WEIGHTS || first[groups] >= SHARED_ROWS);
    int status = 1;
    /* Alone, a thread took 1% longer a step with the update inside the product's region. */
    if (w4 != NULL && groups > 0 && team && !shared) /* 1: too many rows */
        status = int4_matmul_around_bf16(x, x_stride, w4, sz4, y, rows, n_out, k, shrink,
                                         expand_columns, &w);
    if (status == 1) {
        status = w4 != NULL ? int4_matmul_bf16(x, x_stride, w4, sz4, y, rows, n_out, k) : 0;
        if (status == 0 && groups > 0 && shared) {
#pragma omp parallel
            passes(&w);
        } else if (status == 0 && groups > 0) {
            passes(&w); /* without waking the team */
        }
    }
    if (words_at != stack) free(words_at);
    return status;
}

int lora_update(const lora_step *step, const uint16_t *a, const uint16_t *bt,
                int64_t block_offset, int64_t n_targets, const int64_t *sizes,
                const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t rows, int64_t n_out,
                int64_t k) {
    if (step == NULL || step->row_slots == NULL || a == NULL || bt == NULL || rows <= 0) return 0;
    return update_after(step, a, bt, block_offset, n_targets, sizes, x, x_stride, y, rows, n_out,
                        k, NULL, NULL);
}

int lora_int4_matmul(const lora_step *step, const uint16_t *a, const uint16_t *bt,
                     int64_t block_offset, int64_t n_targets, const int64_t *sizes,
                     const uint16_t *x, int64_t x_stride, const uint8_t *w4, const uint16_t *sz4,
                     uint16_t *y, int64_t rows, int64_t n_out, int64_t k) {
    if (step == NULL || step->row_slots == NULL || a == NULL || bt == NULL || rows <= 0)
        return int4_matmul_bf16(x, x_stride, w4, sz4, y, rows, n_out, k);
    return update_after(step, a, bt, block_offset, n_targets, sizes, x, x_stride, y, rows, n_out,
                        k, w4, sz4);
}
