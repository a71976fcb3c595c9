/* bf16 and fp32 element access shared by the kernels: each kernel is written once over
 * `load`/`store` with a constant `bf16` flag and compiled once per type. */
#ifndef LLAMASERVE_BF16_H
#define LLAMASERVE_BF16_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float from_bf16(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* IEEE half to float, subnormals included: the symmetric kernels' scales (GGUF's own
 * scale type). */
static inline float from_fp16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, mant = h & 1023;
    uint32_t bits;
    if (exp == 0) {
        float f = (float)mant * (1.0f / 16777216.0f); /* mant 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | mant << 13;
    } else {
        bits = sign | (exp + 112) << 23 | mant << 13;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even; values are finite */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Element i of a bf16 or fp32 array: `bf16` is a constant in each caller, so every loop
 * over it is compiled twice, once per type, with no branch inside. */
static inline __attribute__((always_inline)) float load(const void *p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void store(void *p, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* A malloc'd fp32 copy of `rows` bf16 rows of k values, `stride` apart, as the AVX2
 * matmul loops broadcast them; NULL when out of memory. */
static inline float *fp32_rows(const uint16_t *x, int64_t stride, int64_t rows, int64_t k) {
    float *out = malloc(sizeof(float) * (rows > 0 ? rows : 1) * k);
    if (out != NULL)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t j = 0; j < k; j++) out[m * k + j] = from_bf16(x[m * stride + j]);
    return out;
}

/* x as the array's type would hold it. */
static inline __attribute__((always_inline)) float round_to(float x, int bf16) {
    return bf16 ? from_bf16(to_bf16(x)) : x;
}

#endif
