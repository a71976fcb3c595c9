/* Rows of a GGUF embedding table dequantised straight from its blocks (Q4_0, Q4_1, Q5_0,
 * Q8_0, Q4_K, Q6_K):
 * a decode step looks up one row, which in PyTorch's whole-tensor decoders
 * (model/checkpoint/dequant.py) took some fifty small ops, ~150 us a step.
 *
 * The values are the same bits as those decoders' (and ggml's reference): every product
 * below has at most one inexact factor pair (a float16 scale, 11 significant bits, times
 * small integers), so each weight is one rounding of its exact value whatever order the
 * compiler (-ffast-math) multiplies in, and Q4_K's offset is added to an exact product, so
 * a fused multiply-add rounds it as the separate add does. Output in fp32 or bf16 (round to
 * nearest even, as PyTorch casts). */
#include <stdint.h>

#include "bf16.h"

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* ggml's type ids */

static float fp16_at(const uint8_t *b) { return from_fp16((uint16_t)(b[0] | b[1] << 8)); }

/* The 32-weight blocks with 4-bit quants (and Q5_0's fifth bits): byte j holds element j
 * in its low nibble and j + 16 in its high one; w = d (q - offset), or d q + m for Q4_1. */
static void row_q4_q5(const uint8_t *b, int64_t blocks, int64_t qtype, void *out, int bf16) {
    const int64_t size = qtype == Q4_0 ? 18 : qtype == Q4_1 ? 20 : 22;
    const uint8_t *qs = b + size - 16;
    for (int64_t i = 0; i < blocks; i++, b += size, qs += size) {
        const float d = fp16_at(b), m = qtype == Q4_1 ? fp16_at(b + 2) : 0.0f;
        uint32_t qh = 0; /* Q5_0: a little-endian uint32, bit l = element l's fifth */
        if (qtype == Q5_0)
            qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
        for (int l = 0; l < 32; l++) {
            int q = (qs[l % 16] >> (4 * (l / 16))) & 15;
            if (qtype == Q5_0)
                q = (q | ((qh >> l) & 1) << 4) - 16;
            else if (qtype == Q4_0)
                q -= 8;
            store(out, 32 * i + l, qtype == Q4_1 ? (float)q * d + m : (float)q * d, bf16);
        }
    }
}

static void row_q8_0(const uint8_t *b, int64_t blocks, void *out, int bf16) {
    for (int64_t i = 0; i < blocks; i++, b += 34) {
        const float d = fp16_at(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int l = 0; l < 32; l++)
            store(out, 32 * i + l, (float)q[l] * d, bf16);
    }
}

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and min from the 12 packed bytes. */
static void scale_min_k4(int j, const uint8_t *s, int *scale, int *min) {
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void row_q4_k(const uint8_t *b, int64_t blocks, void *out, int bf16) {
    for (int64_t i = 0; i < blocks; i++, b += 144) {
        const float d = fp16_at(b), dmin = fp16_at(b + 2);
        for (int j = 0; j < 8; j++) { /* chunk j / 2: sub-block j in its low or high nibbles */
            int scale, min;
            scale_min_k4(j, b + 4, &scale, &min);
            const float step = d * (float)scale, low = -(dmin * (float)min);
            const uint8_t *qs = b + 16 + 32 * (j / 2);
            const int shift = 4 * (j % 2);
            for (int l = 0; l < 32; l++)
                store(out, 256 * i + 32 * j + l, (float)((qs[l] >> shift) & 15) * step + low, bf16);
        }
    }
}

static void row_q6_k(const uint8_t *b, int64_t blocks, void *out, int bf16) {
    for (int64_t i = 0; i < blocks; i++, b += 210) {
        const float d = fp16_at(b + 208);
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int half = 0; half < 2; half++) { /* 128 weights from 64 ql and 32 qh bytes */
            const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
            for (int l = 0; l < 32; l++)
                for (int k = 0; k < 4; k++) { /* k: which quarter of the 128 */
                    const int low = (ql[l + 32 * (k % 2)] >> (4 * (k / 2))) & 15;
                    const int q = (low | ((qh[l] >> (2 * k)) & 3) << 4) - 32;
                    const float dc = d * (float)sc[8 * half + 2 * k + l / 16];
                    store(out, 256 * i + 128 * half + 32 * k + l, dc * (float)q, bf16);
                }
        }
    }
}

/* Rows `ids` (n of them, each < rows) of a table of `rows` rows of `dim` weights of type
 * `qtype`, `row_bytes` apart, into out [n, dim] (bf16 where `bf16`, else fp32). Returns 0;
 * 1 for a type this file does not decode, 2 for an id past the table (nothing written). */
int gguf_rows(const uint8_t *table, int64_t rows, int64_t row_bytes, int64_t dim, int64_t qtype,
              const int64_t *ids, int64_t n, void *out, int64_t bf16) {
    const int legacy = qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0;
    if (!legacy && qtype != Q8_0 && qtype != Q4_K && qtype != Q6_K)
        return 1;
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= rows)
            return 2;
    const int64_t block = legacy || qtype == Q8_0 ? 32 : 256;
    const size_t width = bf16 ? 2 : 4;
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = table + ids[r] * row_bytes;
        void *dst = (uint8_t *)out + (size_t)(r * dim) * width;
        if (legacy)
            row_q4_q5(row, dim / block, qtype, dst, bf16 != 0);
        else if (qtype == Q8_0)
            row_q8_0(row, dim / block, dst, bf16 != 0);
        else if (qtype == Q4_K)
            row_q4_k(row, dim / block, dst, bf16 != 0);
        else
            row_q6_k(row, dim / block, dst, bf16 != 0);
    }
    return 0;
}
