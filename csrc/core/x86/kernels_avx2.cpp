// x86 AVX2 + FMA + F16C: the fp32-FMA tiles. One row alone accumulates all 64 columns; up to 6 rows go 2 vectors
// of columns at a time (6 x 2 accumulators, 2 weight vectors and a broadcast: 15 of the 16 ymm registers). And the
// streaming-read kernel of the bandwidth probe on CPUs without AVX-512.
#include <immintrin.h>
#define CPUMOE_TABLE_FN kernels_x86_avx2
#define CPUMOE_NAME "x86-avx2"
#define CPUMOE_MAX_ROWS 6
#define CPUMOE_COL_VECS 2
#define CPUMOE_PREFETCH_BYTES 1024
#define CPUMOE_VEC_BYTES 32
#include "../kernels_fma.inc"

namespace cpumoe {
// 32-byte loads: on a Zen 3 VM two threads read 1 GiB at 19.6-22.5 GB/s (medians of 6, five runs) where the
// baseline unit's 8-byte loop read 16.4-21.6 in the same runs, slower than the model's decode steps read weights.
uint64_t stream_read_avx2(const void* p, int64_t bytes) {
  const __m256i* q = static_cast<const __m256i*>(p);
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (int64_t i = 0; i < bytes / 32; i += 4) {
    a = _mm256_xor_si256(a, _mm256_load_si256(q + i));
    b = _mm256_xor_si256(b, _mm256_load_si256(q + i + 1));
    c = _mm256_xor_si256(c, _mm256_load_si256(q + i + 2));
    d = _mm256_xor_si256(d, _mm256_load_si256(q + i + 3));
  }
  const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
  return uint64_t(_mm256_extract_epi64(x, 0) ^ _mm256_extract_epi64(x, 1) ^ _mm256_extract_epi64(x, 2) ^
                  _mm256_extract_epi64(x, 3));
}
}  // namespace cpumoe
