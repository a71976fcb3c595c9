/* int4_matmul_a8.c's loops on the superblock layout of the scales (int4_scales.h), as
 * int4k_matmul_a8_bf16. */
#define INT4_SUPERBLOCKS 1
#include "int4_matmul_a8.c"
