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

#endif
