// x86 AVX2 + FMA + F16C: the fp32-FMA tiles. One row alone accumulates all 64 columns; up to 6 rows go 2 vectors
// of columns at a time (6 x 2 accumulators, 2 weight vectors and a broadcast: 15 of the 16 ymm registers).
#define CPUMOE_TABLE_FN kernels_x86_avx2
#define CPUMOE_NAME "x86-avx2"
#define CPUMOE_MAX_ROWS 6
#define CPUMOE_COL_VECS 2
#define CPUMOE_PREFETCH_BYTES 1024
#define CPUMOE_VEC_BYTES 32
#include "../kernels_fma.inc"
