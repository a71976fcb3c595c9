/* int4_matmul.c's loops on the superblock layout of the scales (int4_scales.h): GGUF's
 * Q4_K at its own size, as int4k_matmul_bf16 and int4k_matmul_around_bf16. */
#define INT4_SUPERBLOCKS 1
#include "int4_matmul.c"
