/* An MXFP4 block as GGUF stores it (type 39): one E8M0 scale byte, then 16 bytes of E2M1
 * nibbles for 32 values; and the tiling both MXFP4 kernels share. */
#ifndef LLAMASERVE_MXFP4_BLOCK_H
#define LLAMASERVE_MXFP4_BLOCK_H

#include <stdint.h>
#include <string.h>

#define MX_BLOCK 32
#define MX_BYTES 17
#define MX_ROWS 4   /* rows sharing a weight block's decoding */
#define ROW_TILE 32 /* rows that pass every column while they stay in cache */

/* 2^(e - 128), exactly, as ggml_e8m0_to_fp32_half. */
static inline float half_scale(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif
