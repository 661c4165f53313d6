// Arm NEON (baseline AArch64): fp32-FMA tiles over the kKN layout ([K][64] per block, weights in their own
// dtype). Per k, a run of the weight row is loaded and widened to float32 (bf16: shift left by 16, fp16:
// FCVTL), and each tile row adds it times its activation with a by-lane FMA; activations are loaded four
// k at a time, so one q register per row feeds four k steps.
//
// Tiling: R rows x C columns of float32 accumulators, C = 32 for 1-2 rows and 16 for 3-4 rows, so at most
// 16 of the 32 q registers hold accumulators; the block's 64 columns take 64/C passes over k, the later
// passes rereading the activation rows from L1. The other half of the register file holds the R
// activation vectors and the weights that GCC's scheduler loads ahead (24 accumulators spill under it).
// One row (decode) gets 8 independent accumulator chains, enough to stream weights at memory speed.
// The fixed-count loops carry `#pragma GCC unroll`: at -O2 GCC does not unroll them otherwise, and the
// accumulator arrays then live in memory.
#include <arm_neon.h>

#include "../simd.h"

namespace cpumoe {
namespace {

constexpr int kMaxRows = 4;

// Columns per pass for a tile of R rows.
constexpr int pass_cols(int R) { return R <= 2 ? 32 : 16; }

template <DType D>
constexpr int64_t elem_bytes() { return D == DType::kFloat32 ? 4 : 2; }

// Four consecutive elements as float32.
template <DType D>
inline float32x4_t load4(const char* p) {
  if constexpr (D == DType::kFloat32) return vld1q_f32(reinterpret_cast<const float*>(p));
  else if constexpr (D == DType::kBFloat16)
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  else return vcvt_f32_f16(vld1_f16(reinterpret_cast<const float16_t*>(p)));
}

// Eight consecutive elements as two float32x4 (one 128-bit load for the 16-bit dtypes).
template <DType D>
inline void load8(const char* p, float32x4_t& lo, float32x4_t& hi) {
  if constexpr (D == DType::kFloat32) {
    lo = vld1q_f32(reinterpret_cast<const float*>(p));
    hi = vld1q_f32(reinterpret_cast<const float*>(p) + 4);
  } else if constexpr (D == DType::kBFloat16) {
    uint16x8_t h = vld1q_u16(reinterpret_cast<const uint16_t*>(p));
    lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16));
    hi = vreinterpretq_f32_u32(vshll_high_n_u16(h, 16));
  } else {
    float16x8_t h = vld1q_f16(reinterpret_cast<const float16_t*>(p));
    lo = vcvt_f32_f16(vget_low_f16(h));
    hi = vcvt_high_f32_f16(h);
  }
}

// acc[r][:] += a[r][L] * w[k][col0 : col0 + C], for the weight row bk = w[k] + col0.
template <DType D, int R, int C, int L>
inline void fma_row(const char* bk, const float32x4_t (&a)[R], float32x4_t (&acc)[R][C / 4]) {
#pragma GCC unroll 8
  for (int j = 0; j < C / 4; j += 2) {
    float32x4_t w0, w1;
    load8<D>(bk + 4 * j * elem_bytes<D>(), w0, w1);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r][j] = vfmaq_laneq_f32(acc[r][j], w0, a[r], L);
      acc[r][j + 1] = vfmaq_laneq_f32(acc[r][j + 1], w1, a[r], L);
    }
  }
}

// tile[r][col0 : col0 + C] = a_r . b[:, col0 : col0 + C]
template <DType D, int R, int C>
inline void accumulate_pass(const GemmTile& t, int col0, float (&tile)[R][kBlockCols]) {
  constexpr int64_t es = elem_bytes<D>(), row_bytes = kBlockCols * es;
  const char* b = static_cast<const char*>(t.b) + col0 * es;
  const char* a_rows[R];
  float32x4_t acc[R][C / 4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    a_rows[r] = static_cast<const char*>(t.a_rows[r]);
#pragma GCC unroll 16
    for (int j = 0; j < C / 4; ++j) acc[r][j] = vdupq_n_f32(0.0f);
  }
  int64_t k = 0;
  for (; k + 4 <= t.k; k += 4) {
    float32x4_t a[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) a[r] = load4<D>(a_rows[r] + k * es);
    const char* bk = b + k * row_bytes;
    fma_row<D, R, C, 0>(bk, a, acc);
    fma_row<D, R, C, 1>(bk + row_bytes, a, acc);
    fma_row<D, R, C, 2>(bk + 2 * row_bytes, a, acc);
    fma_row<D, R, C, 3>(bk + 3 * row_bytes, a, acc);
  }
  for (; k < t.k; ++k) {
    float32x4_t a[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) a[r] = vdupq_n_f32(simd::load_scalar<D>(a_rows[r], k));
    fma_row<D, R, C, 0>(b + k * row_bytes, a, acc);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < C / 4; ++j) vst1q_f32(&tile[r][col0 + 4 * j], acc[r][j]);
}

template <DType D, int R>
inline void accumulate(const GemmTile& t, float (&tile)[R][kBlockCols]) {
  constexpr int C = pass_cols(R);
  for (int col0 = 0; col0 < kBlockCols; col0 += C) accumulate_pass<D, R, C>(t, col0, tile);
}

template <DType D, int R>
void w13_rows(const GemmTile& t) {
  float tile[R][kBlockCols];
  accumulate<D, R>(t, tile);
  for (int r = 0; r < R; ++r)
    simd::w13_epilogue<D>(t, r, simd::load_f32(tile[r]), simd::load_f32(tile[r] + 16),
                          simd::load_f32(tile[r] + 32), simd::load_f32(tile[r] + 48));
}

template <DType D, int R>
void w2_rows(const GemmTile& t) {
  float tile[R][kBlockCols];
  accumulate<D, R>(t, tile);
  for (int r = 0; r < R; ++r) {
    const simd::f32x16 v[4] = {simd::load_f32(tile[r]), simd::load_f32(tile[r] + 16),
                               simd::load_f32(tile[r] + 32), simd::load_f32(tile[r] + 48)};
    simd::w2_epilogue(t, r, v);
  }
}

template <DType D>
constexpr TileFn kW13[kMaxRows + 1] = {nullptr, w13_rows<D, 1>, w13_rows<D, 2>, w13_rows<D, 3>, w13_rows<D, 4>};
template <DType D>
constexpr TileFn kW2[kMaxRows + 1] = {nullptr, w2_rows<D, 1>, w2_rows<D, 2>, w2_rows<D, 3>, w2_rows<D, 4>};

void w13_tile(const GemmTile& t) {
  switch (t.dtype) {
    case DType::kFloat32: run_row_tiles(t, kW13<DType::kFloat32>, kMaxRows, 4); break;
    case DType::kBFloat16: run_row_tiles(t, kW13<DType::kBFloat16>, kMaxRows, 2); break;
    case DType::kFloat16: run_row_tiles(t, kW13<DType::kFloat16>, kMaxRows, 2); break;
  }
}
void w2_tile(const GemmTile& t) {
  switch (t.dtype) {
    case DType::kFloat32: run_row_tiles(t, kW2<DType::kFloat32>, kMaxRows, 4); break;
    case DType::kBFloat16: run_row_tiles(t, kW2<DType::kBFloat16>, kMaxRows, 4); break;
    case DType::kFloat16: run_row_tiles(t, kW2<DType::kFloat16>, kMaxRows, 4); break;
  }
}

}  // namespace

const KernelTable& kernels_arm_neon() {
  static const KernelTable table{"arm-neon", Layout::kKN, kMaxRows, 0b111u, w13_tile, w2_tile};
  return table;
}

}  // namespace cpumoe
