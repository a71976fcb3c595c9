/* What the tiled matmuls (int4_matmul.c, int8_matmul.c) share: tiles of 16 output columns,
 * groups of 32 along K, blocks of up to 8 rows whose count is a compile-time constant in
 * each instance of the block's loop, so its accumulators live in registers. */
#ifndef LLAMASERVE_TILES_H
#define LLAMASERVE_TILES_H

#define TILE 16
#define GROUP 32
#define ROW_BLOCK 8

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

#endif
