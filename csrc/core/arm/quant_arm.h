// What the Arm A8 tiles (quant_i8mm.cpp: SMMLA, quant_dotprod.cpp: SDOT) share: reading a quantized
// activation row and a block's metadata (layouts in ../quant.h), and the epilogue that turns a tile of
// float32 dot products into the w13 or w2 output. Both units are compiled with their own -march flags,
// so everything here is internal to each (anonymous namespace) and compiled twice.
#pragma once
#include <arm_neon.h>

#include <cstring>

#include "../quant.h"
#include "../simd.h"

namespace cpumoe {
namespace {

// One A8 activation row: int8 a[Kp], then an f32 scale at byte Kp, then int32 sums[Kp/32] at byte Kp + 4.
struct A8Row {
  const int8_t* q;
  const int32_t* sums;  // 4-byte aligned: Kp is a multiple of 32
  float scale;
};

inline A8Row a8_row(const void* row, int64_t Kp) {
  const char* p = static_cast<const char*>(row);
  A8Row r{reinterpret_cast<const int8_t*>(p), reinterpret_cast<const int32_t*>(p + Kp + 4), 0.0f};
  std::memcpy(&r.scale, p + Kp, 4);
  return r;
}

// Sum of the row's activations over k in [k0, k0 + g) (k0 and g multiples of 32), as float32 (exact below
// 2^24, i.e. for any g up to 132k).
inline float a8_group_sum(const A8Row& r, int64_t k0, int64_t g) {
  int32_t s = 0;
  for (int64_t c = k0 / 32; c < (k0 + g) / 32; ++c) s += r.sums[c];
  return float(s);
}

// int8_w8a8: f32 scale[64] after the 64 * Kp weight bytes.
inline const float* int8_col_scales(const GemmTile& t) {
  return reinterpret_cast<const float*>(static_cast<const char*>(t.b) + 64 * t.k);
}
// int4_w4a16: group G's f32 scale[64] (zero[64] follows) after the 32 * Kp code bytes.
inline const float* int4_group_meta(const GemmTile& t, int64_t G) {
  return reinterpret_cast<const float*>(static_cast<const char*>(t.b) + 32 * t.k + 512 * G);
}

// tile[r][n] holds row r's dot product with column n, already times the column's weight scale (int4) or
// not (int8: col_scale != nullptr multiplies it in); the row's activation scale is applied here, then
// bias, activation / row_scale as the dense tiles do (simd.h).
template <int R>
inline void a8_w13_finish(const GemmTile& t, const A8Row (&rows)[R], const float* col_scale,
                          const float (&tile)[R][kBlockCols]) {
  simd::f32x16 cs[4];
  for (int c = 0; c < 4; ++c) cs[c] = col_scale ? simd::load_f32(col_scale + 16 * c) : simd::splat(1.0f);
  for (int r = 0; r < R; ++r) {
    const float sa = rows[r].scale;
    simd::w13_epilogue<DType::kFloat32>(t, r, simd::load_f32(tile[r]) * cs[0] * sa,
                                        simd::load_f32(tile[r] + 16) * cs[1] * sa,
                                        simd::load_f32(tile[r] + 32) * cs[2] * sa,
                                        simd::load_f32(tile[r] + 48) * cs[3] * sa);
  }
}

template <int R>
inline void a8_w2_finish(const GemmTile& t, const A8Row (&rows)[R], const float* col_scale,
                         const float (&tile)[R][kBlockCols]) {
  simd::f32x16 cs[4];
  for (int c = 0; c < 4; ++c) cs[c] = col_scale ? simd::load_f32(col_scale + 16 * c) : simd::splat(1.0f);
  for (int r = 0; r < R; ++r) {
    const float sa = rows[r].scale;
    const simd::f32x16 v[4] = {simd::load_f32(tile[r]) * cs[0] * sa, simd::load_f32(tile[r] + 16) * cs[1] * sa,
                               simd::load_f32(tile[r] + 32) * cs[2] * sa, simd::load_f32(tile[r] + 48) * cs[3] * sa};
    simd::w2_epilogue(t, r, v);
  }
}

}  // namespace
}  // namespace cpumoe
