// What the Arm A8 tiles (quant_i8mm.cpp: SMMLA, quant_dotprod.cpp: SDOT) share: reading a quantized
// activation row and a block's metadata (layouts in ../quant.h), and the epilogue that turns a tile of
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

// A unit's tiles from its accumulate: Unit::accumulate<F, R>(t, rows, tile) fills R rows x 64 columns of float
// dot products, and these wrap it into the row tiles the driver calls, Unit::kMaxRows rows per register tile.
template <class Unit, QuantFormat F>
struct A8Tiles {
  static const float* col_scale(const GemmTile& t) {  // int8's weight scale comes after the dot; int4's is in it
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

// The int8 and int4 tiles of a unit, per format.
template <class Unit>
const QuantKernel* a8_kernel(QuantFormat f) {
  switch (f) {
    case QuantFormat::kInt8W8A8: return A8Tiles<Unit, QuantFormat::kInt8W8A8>::kernel();
    case QuantFormat::kInt4W4A16: return A8Tiles<Unit, QuantFormat::kInt4W4A16>::kernel();
    default: return nullptr;  // fp8 (bf16 activations) and mxfp4: the generic tiles
  }
}

}  // namespace
}  // namespace cpumoe
