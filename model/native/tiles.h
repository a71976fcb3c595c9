/* What the tiled matmuls (int4_matmul.c, int8_matmul.c) share: tiles of 16 output columns,
 * groups of 32 along K, blocks of up to 8 rows whose count is a compile-time constant in
 * each instance of the block's loop, so its accumulators live in registers. */
#ifndef LLAMASERVE_TILES_H
#define LLAMASERVE_TILES_H

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 16
#define GROUP 32
#define ROW_BLOCK 8

/* How far ahead of its products a block asks for its tiles' weights. From 4 to 32 rows a
 * block computes about as long as its weights take to stream from memory, and with the
 * hardware prefetcher alone the two overlapped poorly. At 8 rows, weights streamed from
 * memory, 2-core AVX-512 BF16 EPYC: int4 [17920 x 1536] 1.55 -> 1.28 ms, int6 1.87 -> 1.48,
 * grouped int8's 151,936 x 896 output projection 8.5 -> 7.4, w4a8 1.22 -> 0.93, w5a8
 * [9728 x 896] 0.46 -> 0.38. The AVX2 build's fp32 loops gain less (the same output
 * projection 17.9 -> 14.8 ms, w4a8 1.76 -> 1.61, int6 at 4 rows 3.1 -> 2.6). Twice as far
 * ahead gained nothing more, four times lost. Below PREFETCH_ROWS rows the gain was within
 * the noise; int5 with bf16 products and the AVX2 loop of w5a8 gained nothing at any row
 * count and run without. */
#define PREFETCH_AHEAD 1024
#define PREFETCH_ROWS 4

/* Asks for the `step` bytes PREFETCH_AHEAD on from byte `at` of a tile `length` bytes long,
 * a cache line at a time; nothing past the tile's end. */
static inline void prefetch_ahead(const uint8_t *tile, int64_t at, int64_t step, int64_t length) {
    if (at + PREFETCH_AHEAD + step > length) return;
    for (int64_t line = 0; line < step; line += 64)
        __builtin_prefetch(tile + at + PREFETCH_AHEAD + line, 0, 3);
}

/* BLOCK(n) for n = min(left, ROW_BLOCK), n a constant in each case. */
#define FOR_ROW_BLOCK(left, BLOCK)                                                        \
    switch ((left) < ROW_BLOCK ? (left) : ROW_BLOCK) {                                    \
    case 1: BLOCK(1); break;                                                              \
    case 2: BLOCK(2); break;                                                              \
    case 3: BLOCK(3); break;                                                              \
    case 4: BLOCK(4); break;                                                              \
    case 5: BLOCK(5); break;                                                              \
    case 6: BLOCK(6); break;                                                              \
    case 7: BLOCK(7); break;                                                              \
    default: BLOCK(8); break;                                                             \
    }

/* The entry points' loop: tiles shared among the OpenMP team, each over its blocks of rows,
 * BLOCK(n) as above with t (the tile) and m0 (the block's first row) in scope. */
#define FOR_TILES_AND_ROW_BLOCKS(tiles, rows, BLOCK)                                      \
    _Pragma("omp parallel for schedule(static)")                                          \
    for (int64_t t = 0; t < (tiles); t++)                                                 \
        for (int64_t m0 = 0; m0 < (rows); m0 += ROW_BLOCK) {                              \
            FOR_ROW_BLOCK((rows) - m0, BLOCK)                                             \
        }

/* The same over pairs of adjacent tiles, for kernels whose block takes two (each
 * broadcast of x then serves both): PAIR(n) at tiles t and t + 1, SINGLE(n) for the last
 * of an odd count. */
#define FOR_TILE_PAIRS_AND_ROW_BLOCKS(tiles, rows, PAIR, SINGLE)                          \
    _Pragma("omp parallel for schedule(static)")                                          \
    for (int64_t pair = 0; pair < ((tiles) + 1) / 2; pair++) {                            \
        const int64_t t = 2 * pair;                                                       \
        for (int64_t m0 = 0; m0 < (rows); m0 += ROW_BLOCK) {                              \
            if (t + 1 < (tiles)) {                                                        \
                FOR_ROW_BLOCK((rows) - m0, PAIR)                                          \
            } else {                                                                      \
                FOR_ROW_BLOCK((rows) - m0, SINGLE)                                        \
            }                                                                             \
        }                                                                                 \
    }

/* The loop of a kernel that unpacks each pair of adjacent tiles once for all its blocks of
 * rows (from some 32 rows on, where unpacking per block of 8 rows costs a sizeable part of
 * the instructions): each thread owns a buffer of `buffer_bytes` (a multiple of 64). With
 * t, n (1 or 2 tiles) and `buffer` in scope, UNPACK fills the buffer, then PAIR(r) or
 * SINGLE(r) runs each block (m0 its first row). `status` becomes 2 when out of memory. */
#define FOR_UNPACKED_TILE_PAIRS(tiles, rows, buffer_bytes, status, UNPACK, PAIR, SINGLE)    \
    do {                                                                                 \
        const int threads_ = omp_get_max_threads();                                      \
        char *buffers_ = aligned_alloc(64, (size_t)threads_ * (buffer_bytes));          \
        if (buffers_ == NULL) {                                                          \
            (status) = 2;                                                                \
            break;                                                                       \
        }                                                                                \
        _Pragma("omp parallel for schedule(static) num_threads(threads_)")              \
        for (int64_t pair = 0; pair < ((tiles) + 1) / 2; pair++) {                        \
            const int64_t t = 2 * pair;                                                   \
            const int n = t + 1 < (tiles) ? 2 : 1;                                        \
            void *buffer = buffers_ + (size_t)omp_get_thread_num() * (buffer_bytes);      \
            UNPACK;                                                                      \
            for (int64_t m0 = 0; m0 < (rows); m0 += ROW_BLOCK) {                          \
                if (n == 2) {                                                            \
                    FOR_ROW_BLOCK((rows) - m0, PAIR)                                     \
                } else {                                                                 \
                    FOR_ROW_BLOCK((rows) - m0, SINGLE)                                   \
                }                                                                        \
            }                                                                            \
        }                                                                                \
        free(buffers_);                                                                  \
    } while (0)

#endif
