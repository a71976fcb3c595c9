/* A mixture-of-experts FFN's experts for one step, in one call (model/native/moe.py): the
 * step's token slots grouped by expert, each chosen expert's gate/up, SiLU(gate) * up (or
 * gpt-oss's clamped gate, with its biases) and down run once over all the rows that chose
 * it (its weights read once per step however many tokens chose it), each slot's output weighted by the router, a token's k outputs
 * summed in the order of its top-k and added to the residual.
 *
 * Rounds to bf16 where model/network/moe.py's PyTorch path does (each op's output there is a
 * bf16 tensor); the products are the same kernels as the experts' quantised layers', whose
 * rows are computed alone, so a row's result does not depend on what shares its expert.
 * On several threads, MXFP4 experts (gpt-oss's) are cut into pieces of columns that the
 * threads take one at a time, every gate/up piece and then every down piece, in one
 * OpenMP region (run_pieces). Other kinds: with enough experts in the step each thread
 * takes whole experts (one region a layer rather than two per expert: on a busy 2-core
 * machine each region's barrier can wait for a descheduled thread); with few, the
 * experts run one after another, each product shared among the threads.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "moe_layer.h"

static inline uint16_t add_bias(uint16_t a, uint16_t b) {
    return to_bf16(from_bf16(a) + from_bf16(b));
}

/* n activations of (gate, up) pairs, biases added first where given (gpt-oss), each op
 * rounded to bf16 as the PyTorch expert's bf16 tensors are: gpt-oss's clamped gate, (up +
 * 1) g sigmoid(alpha g) with g = min(gate, limit) and up within +-limit, or SiLU(gate) up.
 * The flags are constants in each caller, so each loop has no branch and vectorises (its
 * scalar form had cost 5% of a decode step's experts). */
static inline __attribute__((always_inline)) void activations_of(
    const moe_experts *m, const uint16_t *g, const uint16_t *u, const uint16_t *gb,
    const uint16_t *ub, uint16_t *act, int64_t n, const int biased, const int clamped) {
    const float limit = m->limit, alpha = m->alpha;
    for (int64_t i = 0; i < n; i++) {
        const float gate = from_bf16(biased ? add_bias(g[i], gb[i]) : g[i]);
        const float up = from_bf16(biased ? add_bias(u[i], ub[i]) : u[i]);
        if (clamped) {
            const float c = round_to(fminf(gate, limit), 1);
            const float v = round_to(fmaxf(fminf(up, limit), -limit), 1);
            const float sigmoid = round_to(1.0f / (1.0f + expf(-round_to(c * alpha, 1))), 1);
            act[i] = to_bf16(round_to(v + 1.0f, 1) * round_to(c * sigmoid, 1));
        } else {
            act[i] = to_bf16(round_to(gate / (1.0f + expf(-gate)), 1) * up);
        }
    }
}

static void activations(const moe_experts *m, const uint16_t *g, const uint16_t *u,
                        const uint16_t *gb, const uint16_t *ub, uint16_t *act, int64_t n) {
    if (gb != NULL && m->limit > 0.0f)
        activations_of(m, g, u, gb, ub, act, n, 1, 1);
    else if (gb != NULL)
        activations_of(m, g, u, gb, ub, act, n, 1, 0);
    else if (m->limit > 0.0f)
        activations_of(m, g, u, gb, ub, act, n, 0, 1);
    else
        activations_of(m, g, u, gb, ub, act, n, 0, 0);
}

/* The buffers of a step, each slot's rows at its place in expert order; `x` holds a
 * slot's input row, then its weighted output. */
typedef struct {
    const int64_t *order; /* [slots] the slots sorted by expert, stable */
    uint16_t *x, *gate_up, *act;
} moe_step;

/* A slot's down output, bias added, times its router weight. */
static inline uint16_t weighted(uint16_t y, const uint16_t *bias, int64_t i, float w) {
    return to_bf16(from_bf16(bias != NULL ? add_bias(y, bias[i]) : y) * w);
}

/* Expert e over its `count` slots from `start`: runs the expert and leaves each slot's
 * weighted output in place of its input row (gathered there by the caller). */
static int run_expert(const moe_experts *m, const moe_step *s, int64_t e, int64_t start,
                      int64_t count, const uint16_t *weights) {
    const int64_t dim = m->dim, ffn = m->ffn;
    uint16_t *xg = s->x + start * dim, *gu = s->gate_up + start * 2 * ffn;
    uint16_t *act = s->act + start * ffn, *y = xg; /* the rows are read before y is written */
    const uint16_t *gu_bias = m->gate_up_bias ? m->gate_up_bias + e * 2 * ffn : NULL;
    const uint16_t *down_bias = m->down_bias ? m->down_bias + e * dim : NULL;
    int status = layer_matmul(&m->gate_up[e], xg, dim, gu, count, 2 * ffn, dim);
    if (status) return status;
    for (int64_t r = 0; r < count; r++)
        activations(m, gu + r * 2 * ffn, gu + r * 2 * ffn + ffn, gu_bias,
                    gu_bias ? gu_bias + ffn : NULL, act + r * ffn, ffn);
    if ((status = layer_matmul(&m->down[e], act, ffn, y, count, dim, ffn))) return status;
    for (int64_t r = 0; r < count; r++) {
        const float w = from_bf16(weights[s->order[start + r]]);
        for (int64_t i = 0; i < dim; i++) y[r * dim + i] = weighted(y[r * dim + i], down_bias, i, w);
    }
    return 0;
}

/* MXFP4 experts are shared among the threads by columns rather than whole experts: a
 * step of a few rows per expert holds 15-20 experts a layer of 0.9-1.4 ms each, and whole
 * experts left one thread idle for part of the last one; pieces of SPLIT_COLS columns
 * (rounded to whole groups of 4) keep both threads streaming weights to the end. Each
 * (row, column) is summed by the same instructions whatever columns share its call. */
#define SPLIT_COLS 768

static int by_columns(const moe_experts *m, const int64_t *active, int64_t n_active) {
    for (int64_t i = 0; i < n_active; i++) {
        const int64_t gu = m->gate_up[active[i]].kind, down = m->down[active[i]].kind;
        if ((gu != MXFP4 && gu != MXFP4_A8) || (down != MXFP4 && down != MXFP4_A8)) return 0;
    }
    return m->dim % 32 == 0 && m->ffn % 32 == 0 && omp_get_max_threads() > 1;
}

/* Columns [first, first + n) of an MXFP4 weight of `k` inputs, as a weight of its own. */
static inline layer_weight mxfp4_rows(const layer_weight *w, int64_t first, int64_t k) {
    const uint8_t *start = w->weight + first * (k / 32 * 17);
    return (layer_weight){start, start, w->kind};
}

/* Pieces of a product of n columns, and a piece's width (a multiple of 4). */
static inline int64_t pieces_of(int64_t n) { return (n + SPLIT_COLS - 1) / SPLIT_COLS; }
static inline int64_t piece_width(int64_t n) {
    const int64_t w = (n + pieces_of(n) - 1) / pieces_of(n);
    return (w + 3) / 4 * 4;
}

/* Expert e's gate and up columns [a, b) over its slots, their activations into `act`;
 * tmp holds 2 count (b - a). */
static int gate_up_piece(const moe_experts *m, const moe_step *s, int64_t e, int64_t start,
                         int64_t count, int64_t a, int64_t b, uint16_t *tmp) {
    const int64_t dim = m->dim, ffn = m->ffn, n = b - a;
    const uint16_t *xg = s->x + start * dim;
    const layer_weight gate = mxfp4_rows(&m->gate_up[e], a, dim);
    const layer_weight up = mxfp4_rows(&m->gate_up[e], ffn + a, dim);
    int status = layer_matmul(&gate, xg, dim, tmp, count, n, dim);
    if (!status) status = layer_matmul(&up, xg, dim, tmp + count * n, count, n, dim);
    if (status) return status;
    const uint16_t *bias = m->gate_up_bias ? m->gate_up_bias + e * 2 * ffn : NULL;
    uint16_t *act = s->act + start * ffn;
    for (int64_t r = 0; r < count; r++)
        activations(m, tmp + r * n, tmp + (count + r) * n, bias ? bias + a : NULL,
                    bias ? bias + ffn + a : NULL, act + r * ffn + a, n);
    return 0;
}

/* Expert e's down columns [a, b) over its slots, weighted, into the slots' rows. */
static int down_piece(const moe_experts *m, const moe_step *s, int64_t e, int64_t start,
                      int64_t count, int64_t a, int64_t b, const uint16_t *weights,
                      uint16_t *tmp) {
    const int64_t dim = m->dim, ffn = m->ffn, n = b - a;
    const layer_weight down = mxfp4_rows(&m->down[e], a, ffn);
    const int status = layer_matmul(&down, s->act + start * ffn, ffn, tmp, count, n, ffn);
    if (status) return status;
    const uint16_t *bias = m->down_bias ? m->down_bias + e * dim : NULL;
    uint16_t *y = s->x + start * dim;
    for (int64_t r = 0; r < count; r++) {
        const float w = from_bf16(weights[s->order[start + r]]);
        for (int64_t i = a; i < b; i++) y[r * dim + i] = weighted(tmp[r * n + i - a], bias, i, w);
    }
    return 0;
}

/* Every active expert's gate/up pieces, then (all of them done) their down pieces, taken
 * by the threads one piece at a time. `most`: the most slots an expert has. */
static int run_pieces(const moe_experts *m, const moe_step *s, const int64_t *starts,
                      const int64_t *active, int64_t n_active, int64_t most,
                      const uint16_t *weights) {
    const int64_t ffn = m->ffn, dim = m->dim;
    const int64_t up_pieces = pieces_of(ffn), up_width = piece_width(ffn);
    const int64_t down_pieces = pieces_of(dim), down_width = piece_width(dim);
    const int64_t width = up_width > down_width ? up_width : down_width;
    int status = 0;
#pragma omp parallel reduction(max : status)
    {
        uint16_t *tmp = malloc(sizeof(uint16_t) * 2 * most * width);
        status = tmp == NULL ? 2 : 0; /* the reduction's own copy starts at INT_MIN */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_active * up_pieces; i++) {
            const int64_t e = active[i / up_pieces], a = i % up_pieces * up_width;
            const int64_t b = a + up_width < ffn ? a + up_width : ffn;
            if (status || a >= b) continue;
            status = gate_up_piece(m, s, e, starts[e], starts[e + 1] - starts[e], a, b, tmp);
        }
        /* the loop's barrier: every activation is written */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_active * down_pieces; i++) {
            const int64_t e = active[i / down_pieces], a = i % down_pieces * down_width;
            const int64_t b = a + down_width < dim ? a + down_width : dim;
            if (status || a >= b) continue;
            status = down_piece(m, s, e, starts[e], starts[e + 1] - starts[e], a, b, weights,
                                tmp);
        }
        free(tmp);
    }
    return status;
}

/* Runs every chosen expert over its slots (starts [n_experts + 1]). */
static int run_experts(const moe_experts *m, const moe_step *s, const int64_t *starts,
                       const uint16_t *x, const uint16_t *weights) {
    int64_t *active = malloc(sizeof(int64_t) * (m->n_experts > 0 ? m->n_experts : 1));
    if (active == NULL) return 2;
    int64_t n_active = 0, most = 0;
    for (int64_t e = 0; e < m->n_experts; e++)
        if (starts[e + 1] > starts[e]) {
            active[n_active++] = e;
            most = starts[e + 1] - starts[e] > most ? starts[e + 1] - starts[e] : most;
        }
    const int64_t slots = starts[m->n_experts];
    for (int64_t i = 0; i < slots; i++)
        memcpy(s->x + i * m->dim, x + s->order[i] / m->top_k * m->dim, sizeof(uint16_t) * m->dim);
    /* Experts of equal slot counts that the threads share evenly (one stream: k experts of
     * one row) stay whole: pieces would only add a barrier and restart more streams. */
    int even = n_active % omp_get_max_threads() == 0;
    for (int64_t i = 0; i < n_active; i++)
        even &= starts[active[i] + 1] - starts[active[i]] == most;
    int status = 0;
    if (n_active > 0 && !even && by_columns(m, active, n_active)) {
        status = run_pieces(m, s, starts, active, n_active, most, weights);
        free(active);
        return status;
    }
    const int whole_experts = n_active >= 2 * omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) reduction(max : status) if (whole_experts)
    for (int64_t i = 0; i < n_active; i++) {
        const int64_t e = active[i];
        const int got = run_expert(m, s, e, starts[e], starts[e + 1] - starts[e], weights);
        status = got > status ? got : status;
    }
    free(active);
    return status;
}

/* x [rows, dim] the normalised rows; ids [rows, top_k] the router's experts; weights [rows,
 * top_k] bf16, its weights; h [rows, dim] the residual; out [rows, dim] (may be h) receives
 * h plus the experts' weighted sum. Returns 0, 1 for an expert id out of range (nothing is
 * written then), or 2 when out of memory. */
int moe_experts_bf16(const moe_experts *m, const uint16_t *x, int64_t rows, const int64_t *ids,
                     const uint16_t *weights, const uint16_t *h, uint16_t *out) {
    const int64_t k = m->top_k, dim = m->dim, ffn = m->ffn, slots = rows * k;
    const int64_t n = slots > 0 ? slots : 1;
    for (int64_t i = 0; i < slots; i++)
        if (ids[i] < 0 || ids[i] >= m->n_experts) return 1;
    int64_t *starts = calloc(m->n_experts + 1, sizeof(int64_t));
    int64_t *fill = malloc(sizeof(int64_t) * (m->n_experts + 1));
    int64_t *order = malloc(sizeof(int64_t) * n), *place = malloc(sizeof(int64_t) * n);
    moe_step s = {order, malloc(sizeof(uint16_t) * n * dim), malloc(sizeof(uint16_t) * n * 2 * ffn),
                  malloc(sizeof(uint16_t) * n * ffn)};
    float *sum = malloc(sizeof(float) * dim);
    int status = 2;
    if (!starts || !fill || !order || !place || !s.x || !s.gate_up || !s.act || !sum) goto done;
    for (int64_t i = 0; i < slots; i++) starts[ids[i] + 1]++;
    for (int64_t e = 0; e < m->n_experts; e++) starts[e + 1] += starts[e];
    memcpy(fill, starts, sizeof(int64_t) * (m->n_experts + 1));
    for (int64_t i = 0; i < slots; i++) {
        place[i] = fill[ids[i]]++;
        order[place[i]] = i;
    }
    if ((status = run_experts(m, &s, starts, x, weights))) goto done;
    /* A token's k outputs summed in fp32 in top-k order and rounded once, as torch sums
     * bf16; then added to the residual. */
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < dim; i++) sum[i] = 0.0f;
        for (int64_t j = 0; j < k; j++)
            for (int64_t i = 0; i < dim; i++) sum[i] += from_bf16(s.x[place[r * k + j] * dim + i]);
        for (int64_t i = 0; i < dim; i++)
            out[r * dim + i] = to_bf16(from_bf16(h[r * dim + i]) + from_bf16(to_bf16(sum[i])));
    }
done:
    free(starts);
    free(fill);
    free(order);
    free(place);
    free(s.x);
    free(s.gate_up);
    free(s.act);
    free(sum);
    return status;
}
