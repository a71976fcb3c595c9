/* Finds the Q6_K grid of float weights, for int6_matmul.c's layout: per super-block of 256
 * along K, an fp32 d; per sub-block of 16, an int8 c; per weight, q in 0..63 with
 * w = d c (q - 32) exactly.
 *
 * The loader hands a layer the GGUF file's values dequantised to fp32, d c (q - 32) as
 * llama.cpp computes them (exact: 11 + 8 + 6 significant bits). Written as integers of a
 * common binary exponent, a sub-block's greatest common divisor is a step all its values
 * are multiples of, and the super-block's divisor of those steps is a d they all share,
 * found without knowing the quantiser. A super-block whose values are on no such grid
 * (not from a Q6_K tensor) is rounded instead: to d c of the largest magnitude, as Q6_K's
 * quantiser does without its search; the caller is told how many were.
 *
 * int6_pack then writes q, c and d in int6_matmul.c's layout.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SUPER 256
#define SUB 16
#define SUBS (SUPER / SUB)
/* How far apart the exponents of a super-block's values may lie (13 bits of d c (q - 32)
 * beyond the 24 of a float's significand fit a 64-bit integer with room). */
#define MAX_SPREAD 38

/* int6_matmul.c's layout. */
#define TILE 16
#define SUB_BYTES 208
#define HIGH_BITS 128
#define SUB_SCALES 192
#define SUPER_BYTES (SUBS * SUB_BYTES)

static uint64_t gcd(uint64_t a, uint64_t b) {
    while (b) {
        const uint64_t r = a % b;
        a = b;
        b = r;
    }
    return a;
}

/* Rounds a super-block of w to the grid described above; always succeeds. */
static void round_super(const float *w, uint8_t *q, int8_t *c, float *d) {
    float step[SUBS], largest = 0.0f;
    for (int b = 0; b < SUBS; b++) {
        float amax = 0.0f;
        for (int j = 0; j < SUB; j++) amax = fmaxf(amax, fabsf(w[b * SUB + j]));
        step[b] = amax / 31.0f;
        largest = fmaxf(largest, step[b]);
    }
    *d = largest / 127.0f;
    for (int b = 0; b < SUBS; b++) {
        const long scale = *d > 0.0f ? lrintf(step[b] / *d) : 0;
        c[b] = (int8_t)(scale < 1 ? 1 : scale > 127 ? 127 : scale);
        const float unit = *d * (float)c[b];
        for (int j = 0; j < SUB; j++) {
            const long v = unit > 0.0f ? lrintf(w[b * SUB + j] / unit) : 0;
            q[b * SUB + j] = (uint8_t)((v < -32 ? -32 : v > 31 ? 31 : v) + 32);
        }
    }
}

/* c and q of each sub-block for d = flip * all, n in units of 2^low; 0 where some
 * sub-block has none. */
static int fit(const int64_t *n, const uint64_t *sub_gcd, uint64_t all, int flip, uint8_t *q,
               int8_t *c) {
    for (int b = 0; b < SUBS; b++) {
        int8_t *cb = c + b;
        uint8_t *qb = q + b * SUB;
        const int64_t *nb = n + b * SUB;
        if (sub_gcd[b] == 0) {
            *cb = 0;
            memset(qb, 32, SUB);
            continue;
        }
        /* The values in steps of the sub-block's divisor, then the coarsest step (c up to
         * 128 in magnitude) whose values fit -32..31, of either sign. */
        int64_t lo = INT64_MAX, hi = INT64_MIN;
        for (int j = 0; j < SUB; j++) {
            const int64_t v = flip * nb[j] / (int64_t)sub_gcd[b];
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        const uint64_t units = sub_gcd[b] / all;
        int found = 0;
        for (uint64_t split = 1; split <= 64 && !found; split++) {
            if (units % split || units / split > 128) continue;
            const int64_t scale = (int64_t)(units / split), a = lo * (int64_t)split,
                          z = hi * (int64_t)split;
            for (int sign = 1; sign >= -1 && !found; sign -= 2) {
                const int64_t lo_v = sign > 0 ? a : -z, hi_v = sign > 0 ? z : -a;
                if (lo_v < -32 || hi_v > 31 || sign * scale > 127) continue;
                *cb = (int8_t)(sign * scale);
                for (int j = 0; j < SUB; j++) {
                    const int64_t v = flip * nb[j] / (int64_t)sub_gcd[b];
                    qb[j] = (uint8_t)(sign * v * (int64_t)split + 32);
                }
                found = 1;
            }
        }
        if (!found) return 0;
    }
    return 1;
}

/* The exact grid of a super-block, or 0 where it has none. */
static int exact_super(const float *w, uint8_t *q, int8_t *c, float *d) {
    int exponent[SUPER], low = INT32_MAX, high = INT32_MIN;
    int64_t mantissa[SUPER];
    for (int j = 0; j < SUPER; j++) {
        uint32_t bits;
        memcpy(&bits, &w[j], 4);
        if ((bits & 0x7F800000u) == 0x7F800000u) return 0; /* inf or NaN: fast math's
                                                             * isfinite may not see them */
        mantissa[j] = (int64_t)ldexpf(frexpf(w[j], &exponent[j]), 24);
        exponent[j] -= 24;
        if (mantissa[j] != 0) {
            low = exponent[j] < low ? exponent[j] : low;
            high = exponent[j] > high ? exponent[j] : high;
        }
    }
    if (low == INT32_MAX) { /* all zero */
        *d = 0.0f;
        memset(c, 0, SUBS);
        memset(q, 32, SUPER);
        return 1;
    }
    if (high - low > MAX_SPREAD) return 0;
    int64_t n[SUPER];
    uint64_t sub_gcd[SUBS], all = 0;
    for (int b = 0; b < SUBS; b++) {
        uint64_t g = 0;
        for (int j = b * SUB; j < (b + 1) * SUB; j++) {
            n[j] = mantissa[j] * ((int64_t)1 << (exponent[j] - low));
            g = gcd(g, (uint64_t)(n[j] < 0 ? -n[j] : n[j]));
        }
        sub_gcd[b] = g;
        all = gcd(all, g);
    }
    /* d = +-all (in units of 2^low): the sign decides which c fit (only -128 of 128). */
    int flip = 1;
    if (!fit(n, sub_gcd, all, flip, q, c) && !fit(n, sub_gcd, all, flip = -1, q, c)) return 0;
    *d = flip * ldexpf((float)all, low);
    for (int b = 0; b < SUBS; b++) {
        const float unit = *d * (float)c[b];
        for (int j = 0; j < SUB; j++)
            if (unit * (float)((int)q[b * SUB + j] - 32) != w[b * SUB + j]) return 0;
    }
    return 1;
}

/* w [rows, k] fp32, k % 256 == 0; q [rows, k], c [rows, k / 16], d [rows, k / 256].
 * Returns how many super-blocks were rounded, not found on a grid. */
int64_t int6_grid(const float *w, int64_t rows, int64_t k, uint8_t *q, int8_t *c, float *d) {
    const int64_t supers = rows * (k / SUPER);
    int64_t rounded = 0;
#pragma omp parallel for schedule(static) reduction(+ : rounded)
    for (int64_t s = 0; s < supers; s++) {
        const float *ws = w + s * SUPER;
        uint8_t *qs = q + s * SUPER;
        int8_t *cs = c + s * SUBS;
        if (!exact_super(ws, qs, cs, d + s)) {
            round_super(ws, qs, cs, d + s);
            rounded++;
        }
    }
    return rounded;
}

/* int6_matmul.c's layout from q [n_out, k] (0..63, a row per output column), c [n_out, k / 16]
 * and d [n_out, k / 256]: w receives k n_out 13 / 16 bytes, tiled_d n_out k / 256 floats. */
void int6_pack(const uint8_t *q, const int8_t *c, const float *d, int64_t n_out, int64_t k,
               uint8_t *w, float *tiled_d) {
    const int64_t supers = k / SUPER, tiles = n_out / TILE, subs = k / SUB;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t g = 0; g < supers; g++) {
            for (int b = 0; b < SUBS; b++) {
                uint8_t *out = w + (t * supers + g) * SUPER_BYTES + b * SUB_BYTES;
                memset(out + HIGH_BITS, 0, SUB_SCALES - HIGH_BITS);
                for (int s = 0; s < 4; s++)
                    for (int i = 0; i < TILE; i++)
                        for (int e = 0; e < 2; e++) {
                            const uint8_t *row =
                                q + (t * TILE + i) * k + g * SUPER + b * SUB + 4 * s;
                            const uint8_t low = row[e], high = row[2 + e];
                            const int j = 2 * i + e;
                            out[32 * s + j] = (uint8_t)((low & 15) | (high & 15) << 4);
                            const int top = ((low >> 4) & 3) | ((high >> 4) & 3) << 2;
                            out[HIGH_BITS + 32 * (s / 2) + j] |= (uint8_t)(top << (4 * (s & 1)));
                        }
                for (int i = 0; i < TILE; i++)
                    out[SUB_SCALES + i] = (uint8_t)c[(t * TILE + i) * subs + g * SUBS + b];
            }
            for (int i = 0; i < TILE; i++)
                tiled_d[(t * supers + g) * TILE + i] = d[(t * TILE + i) * supers + g];
        }
}
