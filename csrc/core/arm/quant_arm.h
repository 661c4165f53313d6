// What the Arm A8 tiles (quant_i8mm.cpp: SMMLA, quant_dotprod.cpp: SDOT) share: reading a quantized
// activation row, a block's 4-bit codes and its metadata (layouts in ../quant.h), and the epilogue that turns a tile of
// float32 dot products into the w13 or w2 output. Both units are compiled with their own -march flags,
// so everything here is internal to each (anonymous namespace) and compiled twice.
#pragma once
#include <arm_neon.h>

#include <cstring>
#include <utility>

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
// int4_w4a16: group G's f32 scale[64] (zero[64] follows unless symmetric) after the 32 * Kp code bytes.
inline const float* int4_group_meta(const GemmTile& t, int64_t G) {
  return reinterpret_cast<const float*>(static_cast<const char*>(t.b) + 32 * t.k) + int4_group_floats(t.symmetric) * G;
}

// The 4-bit codes of one 16-byte quarter of a k-octet (int4_w4a16 and mxfp4_w4a16 share the order: columns
// 4u..4u+3, k 0..3 in the low nibbles and k 4..7 in the high ones) as two int8 operands: int4's codes 0..15
// as they are, mxfp4's through a table to kMxfp4Twice (signed x signed products need no offset).
template <QuantFormat F>
inline void nibble_operands(uint8x16_t v, int8x16_t& lo, int8x16_t& hi) {
  const uint8x16_t low = vandq_u8(v, vdupq_n_u8(0xF)), high = vshrq_n_u8(v, 4);
  if constexpr (F == QuantFormat::kMxfp4W4A16) {
    const int8x16_t table = vld1q_s8(kMxfp4Twice);
    lo = vqtbl1q_s8(table, low);
    hi = vqtbl1q_s8(table, high);
  } else {
    lo = vreinterpretq_s8_u8(low);
    hi = vreinterpretq_s8_u8(high);
  }
}

// mxfp4_w4a16: 2^(e - 128) for columns n..n+L-1 of group G (the e8m0 scale, halved because the dot sums
// kMxfp4Twice; exact), L = 4 or 2.
inline float32x4_t mxfp4_half_scales4(const GemmTile& t, int64_t G, int n) {
  uint32_t bytes;
  std::memcpy(&bytes, static_cast<const uint8_t*>(t.b) + 32 * t.k + 64 * G + n, 4);
  const uint32x4_t e = vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(bytes))));
  return vmulq_n_f32(vreinterpretq_f32_u32(vshlq_n_u32(e, 23)), 0.5f);
}
inline float32x2_t mxfp4_half_scales2(const GemmTile& t, int64_t G, int n) {
  const uint8_t* e = static_cast<const uint8_t*>(t.b) + 32 * t.k + 64 * G + n;
  const uint32x2_t bits = vshl_n_u32(vcreate_u32(uint64_t(e[0]) | uint64_t(e[1]) << 32), 23);
  return vmul_n_f32(vreinterpret_f32_u32(bits), 0.5f);
}

// tile[r][n] holds row r's dot product with column n, already times the column's weight scale (int4, mxfp4)
// or not (int8: col_scale != nullptr multiplies it in); the row's activation scale is applied here, then
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

// A unit's tiles from its accumulate: Unit::accumulate<F, R>(t, rows, tile) fills R rows x 64 columns of float
// dot products, and these wrap it into the row tiles the driver calls, Unit::kMaxRows rows per register tile.
template <class Unit, QuantFormat F>
struct A8Tiles {
  static const float* col_scale(const GemmTile& t) {  // int8's weight scale comes after the dot; int4's, mxfp4's in it
    return F == QuantFormat::kInt8W8A8 ? int8_col_scales(t) : nullptr;
  }
  template <int R>
  static void w13_rows(const GemmTile& t) {
    A8Row rows[R];
    for (int r = 0; r < R; ++r) rows[r] = a8_row(t.a_rows[r], t.k);
    float tile[R][kBlockCols];
    Unit::template accumulate<F, R>(t, rows, tile);
    a8_w13_finish<R>(t, rows, col_scale(t), tile);
  }
  template <int R>
  static void w2_rows(const GemmTile& t) {
    A8Row rows[R];
    for (int r = 0; r < R; ++r) rows[r] = a8_row(t.a_rows[r], t.k);
    float tile[R][kBlockCols];
    Unit::template accumulate<F, R>(t, rows, tile);
    a8_w2_finish<R>(t, rows, col_scale(t), tile);
  }
  template <std::size_t... I>
  static void run(const GemmTile& t, bool w13, std::index_sequence<I...>) {
    static constexpr TileFn fns13[] = {nullptr, w13_rows<int(I) + 1>...};
    static constexpr TileFn fns2[] = {nullptr, w2_rows<int(I) + 1>...};
    run_row_tiles(t, w13 ? fns13 : fns2, Unit::kMaxRows, 4);  // both write float32
  }
  static void w13_tile(const GemmTile& t) { run(t, true, std::make_index_sequence<Unit::kMaxRows>{}); }
  static void w2_tile(const GemmTile& t) { run(t, false, std::make_index_sequence<Unit::kMaxRows>{}); }
  static const QuantKernel* kernel() {
    static const QuantKernel k{Unit::kMaxRows, false, w13_tile, w2_tile};  // signed x signed: no u8 rows
    return &k;
  }
};

// The A8 tiles of a unit (int8, int4, mxfp4), per format.
template <class Unit>
const QuantKernel* a8_kernel(QuantFormat f) {
  switch (f) {
    case QuantFormat::kInt8W8A8: return A8Tiles<Unit, QuantFormat::kInt8W8A8>::kernel();
    case QuantFormat::kInt4W4A16: return A8Tiles<Unit, QuantFormat::kInt4W4A16>::kernel();
    case QuantFormat::kMxfp4W4A16: return A8Tiles<Unit, QuantFormat::kMxfp4W4A16>::kernel();
    default: return nullptr;  // fp8 takes bf16 activations: the generic tiles
  }
}

}  // namespace
}  // namespace cpumoe
