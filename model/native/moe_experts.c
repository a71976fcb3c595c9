/* A mixture-of-experts FFN's experts for one step, in one call (model/native/moe.py): the
 * step's token slots grouped by expert, each chosen expert's gate/up, SiLU(gate) * up (or
 * gpt-oss's clamped gate, with its biases) and down run once over all the rows that chose it (its weights read once per step however
 * many tokens chose it), each slot's output weighted by the router, a token's k outputs
 * summed in the order of its top-k and added to the residual.
 *
 * Rounds to bf16 where model/network/moe.py's PyTorch path does (each op's output there is a
 * bf16 tensor); the products are the same kernels as the experts' quantised layers', whose
 * rows are computed alone, so a row's result does not depend on what shares its expert.
 * With enough experts in the step each thread takes whole experts (one OpenMP region a
 * layer rather than two per expert: on a busy 2-core machine each region's barrier can
 * wait for a descheduled thread); with few, the experts run one after another, each
 * product shared among the threads.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "moe_layer.h"

static inline uint16_t add_bias(uint16_t a, uint16_t b) {
    return to_bf16(from_bf16(a) + from_bf16(b));
}

/* gpt-oss's gate of one (gate, up) pair, rounded to bf16 after each op as the PyTorch
 * expert's bf16 tensors are. */
static inline uint16_t clamped_gate(const moe_experts *m, uint16_t gate, uint16_t up) {
    const float g = round_to(fminf(from_bf16(gate), m->limit), 1);
    const float u = round_to(fmaxf(fminf(from_bf16(up), m->limit), -m->limit), 1);
    const float scaled = round_to(g * m->alpha, 1);
    const float sigmoid = round_to(1.0f / (1.0f + expf(-scaled)), 1);
    return to_bf16(round_to(u + 1.0f, 1) * round_to(g * sigmoid, 1));
}

/* The buffers of a step, each slot's rows at its place in expert order; `x` holds a
 * slot's input row, then its weighted output. */
typedef struct {
    const int64_t *order; /* [slots] the slots sorted by expert, stable */
    uint16_t *x, *gate_up, *act;
} moe_step;

/* Expert e over its `count` slots from `start`: gathers their rows, runs the expert and
 * leaves each slot's weighted output in place of its input row. */
static int run_expert(const moe_experts *m, const moe_step *s, int64_t e, int64_t start,
                      int64_t count, const uint16_t *x, const uint16_t *weights) {
    const int64_t dim = m->dim, ffn = m->ffn;
    uint16_t *xg = s->x + start * dim, *gu = s->gate_up + start * 2 * ffn;
    uint16_t *act = s->act + start * ffn, *y = xg; /* the rows are read before y is written */
    for (int64_t i = 0; i < count; i++)
        memcpy(xg + i * dim, x + s->order[start + i] / m->top_k * dim, sizeof(uint16_t) * dim);
    int status = layer_matmul(&m->gate_up[e], xg, dim, gu, count, 2 * ffn, dim);
    if (status) return status;
    if (m->gate_up_bias != NULL)
        for (int64_t i = 0; i < count * 2 * ffn; i++)
            gu[i] = add_bias(gu[i], m->gate_up_bias[e * 2 * ffn + i % (2 * ffn)]);
    for (int64_t r = 0; r < count; r++)
        for (int64_t i = 0; i < ffn; i++) {
            const uint16_t gate = gu[r * 2 * ffn + i], up = gu[r * 2 * ffn + ffn + i];
            if (m->limit > 0.0f) {
                act[r * ffn + i] = clamped_gate(m, gate, up);
                continue;
            }
            const float g = from_bf16(gate);
            const float a = round_to(g / (1.0f + expf(-g)), 1);
            act[r * ffn + i] = to_bf16(a * from_bf16(up));
        }
    if ((status = layer_matmul(&m->down[e], act, ffn, y, count, dim, ffn))) return status;
    if (m->down_bias != NULL)
        for (int64_t i = 0; i < count * dim; i++)
            y[i] = add_bias(y[i], m->down_bias[e * dim + i % dim]);
    for (int64_t r = 0; r < count; r++) {
        const float w = from_bf16(weights[s->order[start + r]]);
        for (int64_t i = 0; i < dim; i++) y[r * dim + i] = to_bf16(from_bf16(y[r * dim + i]) * w);
    }
    return 0;
}

/* Runs every chosen expert over its slots (starts [n_experts + 1]). */
static int run_experts(const moe_experts *m, const moe_step *s, const int64_t *starts,
                       const uint16_t *x, const uint16_t *weights) {
    int64_t *active = malloc(sizeof(int64_t) * m->n_experts);
    if (active == NULL) return 2;
    int64_t n_active = 0;
    for (int64_t e = 0; e < m->n_experts; e++)
        if (starts[e + 1] > starts[e]) active[n_active++] = e;
    int status = 0;
    const int whole_experts = n_active >= 2 * omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) reduction(max : status) if (whole_experts)
    for (int64_t i = 0; i < n_active; i++) {
        const int64_t e = active[i];
        const int got = run_expert(m, s, e, starts[e], starts[e + 1] - starts[e], x, weights);
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
