// Portable tiles of every quantized format (quant.h), one row at a time with plain loops over the 64
// columns (the compiler vectorizes them for the baseline ISA). They are the definition every ISA's tiles
// are checked against, and the backend that runs where no ISA unit has tiles for a format. Also the per-token
// activation quantization every A8 backend shares.
#include <array>
#include <cstring>
#include <vector>

#include "quant.h"
#include "quant_row.h"
#include "simd.h"

namespace cpumoe {
namespace {

using simd::f32x16;
using simd::load_f32;

// y[0:64] = the block's dot products for activation row `a` (float32, before bias and epilogue).
void dot_int8(const GemmTile& t, const uint8_t* a, float* y) {
  const int8_t* w = static_cast<const int8_t*>(t.b);
  const int64_t Kp = t.k;
  const float* wscale = reinterpret_cast<const float*>(w + 64 * Kp);
  const int8_t* qa = reinterpret_cast<const int8_t*>(a);
  float ascale;
  std::memcpy(&ascale, a + Kp, 4);
  int32_t acc[kBlockCols] = {};
  for (int64_t q = 0; q < Kp / 4; ++q)
    for (int j = 0; j < 4; ++j) {
      const int32_t x = qa[4 * q + j];
      const int8_t* wq = w + q * 256 + j;
      for (int n = 0; n < kBlockCols; ++n) acc[n] += x * wq[4 * n];
    }
  for (int n = 0; n < kBlockCols; ++n) y[n] = float(acc[n]) * wscale[n] * ascale;
}

void dot_int4(const GemmTile& t, const uint8_t* a, float* y) {
  const uint8_t* w = static_cast<const uint8_t*>(t.b);
  const int64_t Kp = t.k, g = t.group;
  const float* meta = reinterpret_cast<const float*>(w + 32 * Kp);
  const int8_t* qa = reinterpret_cast<const int8_t*>(a);
  float ascale;
  std::memcpy(&ascale, a + Kp, 4);
  const int32_t* sums = reinterpret_cast<const int32_t*>(a + Kp + 4);
  float out[kBlockCols] = {};
  for (int64_t G = 0; G < Kp / g; ++G) {
    int32_t acc[kBlockCols] = {};
    for (int64_t oct = G * g / 8; oct < (G + 1) * g / 8; ++oct)
      for (int i = 0; i < 256; ++i) {
        const int n = 16 * (i / 64) + (i % 64) / 4, kk = i % 4;
        const uint8_t byte = w[oct * 256 + i];
        acc[n] += int32_t(byte & 0xF) * qa[8 * oct + kk] + int32_t(byte >> 4) * qa[8 * oct + 4 + kk];
      }
    int32_t asum = 0;
    for (int64_t c = G * g / 32; c < (G + 1) * g / 32; ++c) asum += sums[c];
    const float* scale = meta + G * int4_group_floats(t.symmetric);
    const float* zero = int4_zeros(scale, t.symmetric);
    for (int n = 0; n < kBlockCols; ++n) out[n] += scale[n] * (float(acc[n]) - zero[n] * float(asum));
  }
  for (int n = 0; n < kBlockCols; ++n) y[n] = out[n] * ascale;
}

void dot_fp8(const GemmTile& t, const uint8_t* a, float* y) {
  const uint8_t* w = static_cast<const uint8_t*>(t.b);
  const int64_t Kp = t.k, g = t.group;
  const float* scale = reinterpret_cast<const float*>(w + 64 * Kp);
  const uint16_t* x = reinterpret_cast<const uint16_t*>(a);
  static const std::array<float, 256> lut = [] {
    std::array<float, 256> l{};
    for (int b = 0; b < 256; ++b) l[b] = e4m3_to_float(uint8_t(b));
    return l;
  }();
  for (int n = 0; n < kBlockCols; ++n) y[n] = 0.0f;
  for (int64_t c0 = 0; c0 < Kp; c0 += g) {
    float acc[kBlockCols] = {};
    for (int64_t k = c0; k < c0 + g && k < Kp; ++k) {
      const float xk = bf16_to_f32(x[k]);
      const uint8_t* wk = w + (k / 2 * kBlockCols) * 2 + k % 2;
      for (int n = 0; n < kBlockCols; ++n) acc[n] += xk * lut[wk[2 * n]];
    }
    for (int n = 0; n < kBlockCols; ++n) y[n] += acc[n] * scale[c0 / g * 64 + n];
  }
}

void dot_mxfp4(const GemmTile& t, const uint8_t* a, float* y) {
  const uint8_t* w = static_cast<const uint8_t*>(t.b);
  const int64_t Kp = t.k;
  const uint8_t* exps = w + 32 * Kp;
  const int8_t* qa = reinterpret_cast<const int8_t*>(a);
  float ascale;
  std::memcpy(&ascale, a + Kp, 4);
  float out[kBlockCols] = {};
  for (int64_t G = 0; G < Kp / kMxfp4Group; ++G) {
    int32_t acc[kBlockCols] = {};
    for (int64_t oct = G * kMxfp4Group / 8; oct < (G + 1) * kMxfp4Group / 8; ++oct)
      for (int i = 0; i < 256; ++i) {
        const int n = 16 * (i / 64) + (i % 64) / 4, kk = i % 4;
        const uint8_t byte = w[oct * 256 + i];
        acc[n] += kMxfp4Twice[byte & 0xF] * qa[8 * oct + kk] + kMxfp4Twice[byte >> 4] * qa[8 * oct + 4 + kk];
      }
    for (int n = 0; n < kBlockCols; ++n) {
      const uint32_t bits = uint32_t(exps[G * 64 + n]) << 23;  // 2^(e - 127); e = 0 gives 0
      float scale;
      std::memcpy(&scale, &bits, 4);
      out[n] += scale * float(acc[n]);
    }
  }
  const float half_ascale = ascale * 0.5f;  // acc counts 2 x the e2m1 values
  for (int n = 0; n < kBlockCols; ++n) y[n] = out[n] * half_ascale;
}

using DotFn = void (*)(const GemmTile&, const uint8_t*, float*);

template <DotFn Dot>
void w13_tile(const GemmTile& t) {
  for (int r = 0; r < t.rows; ++r) {
    float y[kBlockCols];
    Dot(t, static_cast<const uint8_t*>(t.a_rows[r]), y);
    if (t.dtype == DType::kFloat32)
      simd::w13_epilogue<DType::kFloat32>(t, r, load_f32(y), load_f32(y + 16), load_f32(y + 32), load_f32(y + 48));
    else
      simd::w13_epilogue<DType::kBFloat16>(t, r, load_f32(y), load_f32(y + 16), load_f32(y + 32), load_f32(y + 48));
  }
}

template <DotFn Dot>
void w2_tile(const GemmTile& t) {
  for (int r = 0; r < t.rows; ++r) {
    float y[kBlockCols];
    Dot(t, static_cast<const uint8_t*>(t.a_rows[r]), y);
    const f32x16 v[4] = {load_f32(y), load_f32(y + 16), load_f32(y + 32), load_f32(y + 48)};
    simd::w2_epilogue(t, r, v);
  }
}

const QuantKernel kGeneric[kNumQuantFormats] = {
    {1, false, w13_tile<dot_int8>, w2_tile<dot_int8>},
    {1, false, w13_tile<dot_int4>, w2_tile<dot_int4>},
    {1, false, w13_tile<dot_fp8>, w2_tile<dot_fp8>},
    {1, false, w13_tile<dot_mxfp4>, w2_tile<dot_mxfp4>},
};

}  // namespace

const QuantKernel& quant_generic(QuantFormat f) { return kGeneric[int(f)]; }

void quantize_row_f32(const QuantKernel& q, const float* x, int64_t K, int64_t Kp, uint8_t* dst) {
  (q.write_row ? q.write_row : write_quantized_row)(x, K, Kp, q.unsigned_activations, dst);
}

void quantize_row(const QuantKernel& q, const void* x, int64_t K, DType dtype, int64_t Kp, uint8_t* dst) {
  if (dtype == DType::kFloat32) {
    quantize_row_f32(q, static_cast<const float*>(x), K, Kp, dst);
    return;
  }
  static thread_local std::vector<float> buf;
  buf.resize(K);
  const uint16_t* h = static_cast<const uint16_t*>(x);
  if (dtype == DType::kBFloat16)
    for (int64_t k = 0; k < K; ++k) buf[k] = bf16_to_f32(h[k]);
  else
    for (int64_t k = 0; k < K; ++k) buf[k] = f16_to_f32(h[k]);
  quantize_row_f32(q, buf.data(), K, Kp, dst);
}

}  // namespace cpumoe
