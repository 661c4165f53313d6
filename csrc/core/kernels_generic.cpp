// Portable backend: the fp32-FMA tiles compiled for the architecture's baseline (SSE2 on x86-64, NEON on
// AArch64). Runs everywhere; every other backend is checked against the same reference.
#define CPUMOE_TABLE_FN kernels_generic
#define CPUMOE_NAME "generic"
#define CPUMOE_MAX_ROWS 1
#define CPUMOE_VEC_BYTES 16
#include "kernels_fma.inc"

namespace cpumoe {
uint64_t stream_read_generic(const void* p, int64_t bytes) {
  const uint64_t* q = static_cast<const uint64_t*>(p);
  uint64_t a = 0, b = 0, c = 0, d = 0;
  for (int64_t i = 0; i < bytes / 8; i += 4) {
    a ^= q[i];
    b ^= q[i + 1];
    c ^= q[i + 2];
    d ^= q[i + 3];
  }
  return a ^ b ^ c ^ d;
}
}  // namespace cpumoe
