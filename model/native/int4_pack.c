/* The int4 matmul's tiled layout (int4_matmul.c describes it) from one value a byte:
 * packing runs once per layer at load, apart from the kernel's loops. */
#include <stdint.h>

#include "tiles.h"

/* The layout from q [n_out, k] (one value 0..15 a byte) and scales_and_zeros
 * [k / 32, n_out, 2] bf16: w gets k n_out / 2 bytes, tiled_sz 2 bf16 per (column, group). */
void int4_pack(const uint8_t *q, const uint16_t *scales_and_zeros, int64_t n_out, int64_t k,
               uint8_t *w, uint16_t *tiled_sz) {
    const int64_t groups = k / GROUP, tiles = n_out / TILE;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *out = w + (t * groups + g) * (TILE * GROUP / 2);
            for (int s = 0; s < GROUP / 4; s++)
                for (int i = 0; i < TILE; i++) {
                    const uint8_t *row = q + (t * TILE + i) * k + g * GROUP + 4 * s;
                    for (int e = 0; e < 2; e++)
                        out[32 * s + 2 * i + e] = (uint8_t)((row[e] & 15) | (row[2 + e] & 15) << 4);
                }
            uint16_t *sz = tiled_sz + (t * groups + g) * 2 * TILE;
            for (int i = 0; i < TILE; i++) {
                const uint16_t *pair = scales_and_zeros + (g * n_out + t * TILE + i) * 2;
                sz[i] = pair[0];
                sz[TILE + i] = pair[1];
            }
        }
}
