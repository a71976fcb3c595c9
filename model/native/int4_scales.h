/* Where the int4 loops (int4_matmul.c, int4_matmul_a8.c) find a group's scale and zero
 * (w = (q - 8) scale + zero), in either of two layouts of a tile's scales.
 *
 * The plain layout: per group of the tile, 16 bf16 scales and then 16 bf16 zeros, one bit
 * a weight. Q4_0 and Q4_1 blocks, and anything quantised at load, take it.
 *
 * The superblock layout (INT4_SUPERBLOCKS, built as int4k_matmul.c and int4k_matmul_a8.c):
 * GGUF's Q4_K exactly, at 0.625 bits a weight where the plain one takes 1 (4.625 against 5
 * bits a weight with the nibbles: a step of a 1.5B Q4_K_M model reads 50 MB less). Per
 * 256 values along K (eight groups) and tile: 16 fp16 d, 16 fp16 dmin, then per group 16
 * uint8 sub-scales sc and 16 uint8 sub-mins m; Q4_K's w = d sc q - dmin m, so scale = d sc
 * and zero = 8 scale - dmin m. d sc and dmin m are exact in fp32 (11 and at most 8
 * significant bits); the zero is rounded once. */
#ifndef LLAMASERVE_INT4_SCALES_H
#define LLAMASERVE_INT4_SCALES_H

#include <stdint.h>

#include "bf16.h"
#include "tiles.h"

#ifdef INT4_SUPERBLOCKS
/* uint16 units of one tile's scales per group: 320 bytes per eight groups. */
#define INT4_SCALE_UNITS 20
#define INT4_SUPER_UNITS 160
static inline const uint16_t *int4_super(const uint16_t *sz, int64_t g) {
    return sz + (g >> 3) * INT4_SUPER_UNITS;
}
static inline const uint8_t *int4_sub(const uint16_t *sz, int64_t g) {
    return (const uint8_t *)(int4_super(sz, g) + 2 * TILE) + (g & 7) * 2 * TILE;
}
#else
#define INT4_SCALE_UNITS (2 * TILE)
#endif

/* Column i of the tile at group g, for the portable loops. */
static inline void int4_scale_zero_at(const uint16_t *sz, int64_t g, int i, float *scale,
                                      float *zero) {
#ifdef INT4_SUPERBLOCKS
    const uint16_t *super = int4_super(sz, g);
    const uint8_t *sub = int4_sub(sz, g);
    *scale = from_fp16(super[i]) * (float)sub[i];
    *zero = 8.0f * *scale - from_fp16(super[TILE + i]) * (float)sub[TILE + i];
#else
    *scale = from_bf16(sz[g * INT4_SCALE_UNITS + i]);
    *zero = from_bf16(sz[g * INT4_SCALE_UNITS + TILE + i]);
#endif
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The tile's 16 columns at group g. */
static inline __attribute__((always_inline)) void int4_scale_zero16(
    const uint16_t *sz, int64_t g, __m512 *scale, __m512 *zero) {
#ifdef INT4_SUPERBLOCKS
    const uint16_t *super = int4_super(sz, g);
    const uint8_t *sub = int4_sub(sz, g);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)super));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(super + TILE)));
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sub)));
    const __m512 m =
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sub + TILE))));
    *scale = _mm512_mul_ps(d, sc);
    *zero = _mm512_fmsub_ps(_mm512_set1_ps(8.0f), *scale, _mm512_mul_ps(dmin, m));
#else
    const uint16_t *p = sz + g * INT4_SCALE_UNITS;
    *scale = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    *zero = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + TILE))), 16));
#endif
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* Columns 8 half .. 8 half + 7 of the tile at group g. */
static inline __attribute__((always_inline)) void int4_scale_zero8(
    const uint16_t *sz, int64_t g, int half, __m256 *scale, __m256 *zero) {
#ifdef INT4_SUPERBLOCKS
    const uint16_t *super = int4_super(sz, g) + 8 * half;
    const uint8_t *sub = int4_sub(sz, g) + 8 * half;
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)super));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(super + TILE)));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sub)));
    const __m256 m =
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sub + TILE))));
    *scale = _mm256_mul_ps(d, sc);
    *zero = _mm256_fmsub_ps(_mm256_set1_ps(8.0f), *scale, _mm256_mul_ps(dmin, m));
#else
    const uint16_t *p = sz + g * INT4_SCALE_UNITS + 8 * half;
    *scale = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    *zero = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + TILE))), 16));
#endif
}

/* The tile's even columns (0, 2, .. 14) and odd ones (1, 3, .. 15) at group g, for loops
 * whose 32-bit lane j sums columns 2 j and 2 j + 1 apart. */
static inline __attribute__((always_inline)) void int4_scale_zero_even_odd(
    const uint16_t *sz, int64_t g, __m256 *scale_even, __m256 *scale_odd, __m256 *zero_even,
    __m256 *zero_odd) {
#ifdef INT4_SUPERBLOCKS
    __m256 scale[2], zero[2];
    for (int half = 0; half < 2; half++) int4_scale_zero8(sz, g, half, &scale[half], &zero[half]);
    /* shuffle_ps takes lanes 0, 2 (or 1, 3) of each 128 bits of both; the 64-bit permute
     * then puts the first half's columns before the second's. */
#define EVEN_ODD(a, b, pick) \
    _mm256_castpd_ps(_mm256_permute4x64_pd( \
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, pick)), _MM_SHUFFLE(3, 1, 2, 0)))
    *scale_even = EVEN_ODD(scale[0], scale[1], _MM_SHUFFLE(2, 0, 2, 0));
    *scale_odd = EVEN_ODD(scale[0], scale[1], _MM_SHUFFLE(3, 1, 3, 1));
    *zero_even = EVEN_ODD(zero[0], zero[1], _MM_SHUFFLE(2, 0, 2, 0));
    *zero_odd = EVEN_ODD(zero[0], zero[1], _MM_SHUFFLE(3, 1, 3, 1));
#undef EVEN_ODD
#else
    const __m256i high_half = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256i scales = _mm256_loadu_si256((const __m256i *)(sz + g * INT4_SCALE_UNITS));
    const __m256i zeros = _mm256_loadu_si256((const __m256i *)(sz + g * INT4_SCALE_UNITS + TILE));
    *scale_even = _mm256_castsi256_ps(_mm256_slli_epi32(scales, 16));
    *scale_odd = _mm256_castsi256_ps(_mm256_and_si256(scales, high_half));
    *zero_even = _mm256_castsi256_ps(_mm256_slli_epi32(zeros, 16));
    *zero_odd = _mm256_castsi256_ps(_mm256_and_si256(zeros, high_half));
#endif
}
#endif

#endif
