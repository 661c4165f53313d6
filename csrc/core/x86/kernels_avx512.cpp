// x86 AVX-512F: the fp32-FMA tiles with 6 rows x 64 columns of zmm accumulators (24 of 32 registers),
// and the streaming-read kernel used to measure memory bandwidth.
#include <immintrin.h>
#define CPUMOE_TABLE_FN kernels_x86_avx512
#define CPUMOE_NAME "x86-avx512"
#define CPUMOE_MAX_ROWS 6
#define CPUMOE_VEC_BYTES 64
#include "../kernels_fma.inc"

namespace cpumoe {
uint64_t stream_read_avx512(const void* p, int64_t bytes) {
  const __m512i* q = static_cast<const __m512i*>(p);
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (int64_t i = 0; i < bytes / 64; i += 4) {
    a = _mm512_xor_si512(a, _mm512_load_si512(q + i));
    b = _mm512_xor_si512(b, _mm512_load_si512(q + i + 1));
    c = _mm512_xor_si512(c, _mm512_load_si512(q + i + 2));
    d = _mm512_xor_si512(d, _mm512_load_si512(q + i + 3));
  }
  __m512i x = _mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d));
  return uint64_t(_mm512_reduce_add_epi64(x));
}
}  // namespace cpumoe
