// The A8 row writer (quant.h's row layout) as an inline function, so that each unit that includes this header
// compiles its own copy with its own ISA flags: quant_generic's for the baseline, the x86 VNNI and AVX2 units'
// as QuantKernel::write_row. Its float operations are a division and the rounding additions, which no compiler
// contracts or reorders without -ffast-math, so every copy gives the same bits.
#pragma once
#include <cstdint>
#include <cstring>

namespace cpumoe {
namespace {  // one copy per unit, as quant_tiles.h's

// Writes the A8 row layout from float values x[0:K]. Plain loops without libm calls, so that the baseline
// ISA vectorizes them: a decode step quantizes a few rows per layer, and scalar nearbyint/fmax calls made
// that a visible share of an int4 step.
inline void write_quantized_row(const float* __restrict x, int64_t K, int64_t Kp, bool unsigned_activations,
                                uint8_t* __restrict dst) {
  // max |x| on the bit patterns: |x| orders as its bits do (NaN above all, as torch's amax), and an integer
  // max reduction vectorizes where a float one would need -ffast-math.
  uint32_t amax_bits = 0;
  for (int64_t k = 0; k < K; ++k) {
    uint32_t b;
    std::memcpy(&b, x + k, 4);
    b &= 0x7FFFFFFFu;
    amax_bits = b > amax_bits ? b : amax_bits;
  }
  float amax;
  std::memcpy(&amax, &amax_bits, 4);
  const float scale = amax / 127.0f;
  std::memcpy(dst + Kp, &scale, 4);
  const uint8_t offset = unsigned_activations ? 128 : 0;
  int8_t* q = reinterpret_cast<int8_t*>(dst);
  if (scale > 0.0f) {
    // Adding and taking away 1.5 * 2^23 rounds a float below 2^22 to the nearest integer, ties to even
    // (the default rounding mode), exactly as torch.round.
    constexpr float kRound = 12582912.0f;
    for (int64_t k = 0; k < K; ++k) {
      // |x| <= amax keeps x / scale far inside int32, so clamping the rounded integer gives the codes that
      // clamping the float would; integer clamps vectorize, where the float ones (branches) left this loop
      // scalar, 5% of an int4 decode step's time.
      const int32_t i = int32_t((x[k] / scale + kRound) - kRound);
      q[k] = int8_t(i > 127 ? 127 : (i < -127 ? -127 : i));
    }
  } else {
    std::memset(q, 0, K);
  }
  std::memset(q + K, 0, Kp - K);
  int32_t* sums = reinterpret_cast<int32_t*>(dst + Kp + 4);
  for (int64_t c = 0; c < Kp / 32; ++c) {
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) sum += q[32 * c + j];
    sums[c] = sum;
  }
  if (offset)
    for (int64_t k = 0; k < Kp; ++k) dst[k] = uint8_t(dst[k] + offset);
}

}  // namespace
}  // namespace cpumoe
