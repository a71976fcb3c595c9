/* RMSNorm for the CPU: out = weight * (x / sqrt(mean(x^2) + eps)), row by row.
 *
 * The same formula as the model's PyTorch RMSNorm (model/llama.py), including its
 * roundings in bf16: the normalised row is rounded to bf16 before the weight multiplies it,
 * as `weight * normed.to(bf16)` does. One call instead of about nine small ops per norm,
 * sixty-one norms per forward of the default model: 0.5-2.7 ms per decode step on 2 cores.
 * Each row is computed alone, in the same order whatever the batch.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* Rows are shared among the caller's OpenMP team only when there are enough of them to
 * pay for waking it (a prefill chunk, not a decode step). */
#define PARALLEL_ROWS 64

static inline __attribute__((always_inline)) void rms_norm(const void *x, const void *weight,
                                                          void *out, int64_t rows,
                                                          int64_t width, float eps, int bf16) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t first = r * width;
        float squares = 0.0f;
        for (int64_t i = 0; i < width; i++) {
            const float v = load(x, first + i, bf16);
            squares += v * v;
        }
        const float inverse = 1.0f / sqrtf(squares / (float)width + eps);
        for (int64_t i = 0; i < width; i++) {
            const float normed = round_to(load(x, first + i, bf16) * inverse, bf16);
            store(out, first + i, load(weight, i, bf16) * normed, bf16);
        }
    }
}

void rms_norm_bf16(const void *x, const void *weight, void *out, int64_t rows, int64_t width,
                   float eps) {
    rms_norm(x, weight, out, rows, width, eps, 1);
}

void rms_norm_f32(const void *x, const void *weight, void *out, int64_t rows, int64_t width,
                  float eps) {
    rms_norm(x, weight, out, rows, width, eps, 0);
}
