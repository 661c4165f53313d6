// What the 2x2-output matrix-multiply tiles (BFMMLA in kernels_bfmmla.cpp, SMMLA in quant_i8mm.cpp) share:
// turning their accumulators, each [row 2p col c, row 2p col c+1, row 2p+1 col c, row 2p+1 col c+1], back into
// row-major tile rows. Internal to each unit (anonymous namespace), compiled with each unit's flags.
#pragma once
#include <arm_neon.h>

#include "../types.h"

namespace cpumoe {
namespace {

// tile[r][2 * pair0 : 2 * (pair0 + G)] = acc, for R rows held as P row pairs (the last pair may be half used).
template <int R, int P, int G>
inline void store_pairs(const float32x4_t (&acc)[P][G], int pair0, float (&tile)[R][kBlockCols]) {
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int g = 0; g < G; g += 2) {
      const float64x2_t lo = vreinterpretq_f64_f32(acc[p][g]), hi = vreinterpretq_f64_f32(acc[p][g + 1]);
      const int col = 2 * (pair0 + g);
      vst1q_f32(&tile[2 * p][col], vreinterpretq_f32_f64(vzip1q_f64(lo, hi)));
      if (2 * p + 1 < R) vst1q_f32(&tile[2 * p + 1][col], vreinterpretq_f32_f64(vzip2q_f64(lo, hi)));
    }
}

}  // namespace
}  // namespace cpumoe
