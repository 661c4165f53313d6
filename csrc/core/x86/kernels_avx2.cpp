// x86 AVX2 + FMA + F16C: the fp32-FMA tiles (one row per register tile: 16 ymm accumulators would spill).
#define CPUMOE_TABLE_FN kernels_x86_avx2
#define CPUMOE_NAME "x86-avx2"
#define CPUMOE_MAX_ROWS 1
#define CPUMOE_VEC_BYTES 32
#include "../kernels_fma.inc"
