// Arm BF16 (Armv8.6 BFMMLA): bf16 tiles over the kQuads layout. A block is [K/4][64][4] bf16: for each
// k-quad, column n's four weights are contiguous, so columns 2p and 2p+1 are one 128-bit operand
// (col 2p k0..3, col 2p+1 k0..3). The matching activation operand holds k0..3 of two rows (two 64-bit
// loads), and BFMMLA adds the 2x4 by 4x2 product to a float32x4 [r0c0, r0c1, r1c0, r1c1].
//
// Tiling: rows go in pairs (an odd last row pairs with itself and the copy's output is dropped); a pass
// keeps P row pairs x G column pairs of accumulators, G = 8 for one or two row pairs and 4 for three or
// four, so at most 16 q registers accumulate and the rest hold the P activation operands and the G weight
// operands that GCC's scheduler loads ahead (24 accumulators spill under it). The block's 32 column pairs
// take 32/G passes over k; per k-quad a pass makes G weight loads and P x G BFMMLAs (16 multiply-adds
// each). After a pass, zipping the 64-bit halves of neighbouring column pairs' accumulators gives four
// columns of the pair's first row and four of its second, stored to a float tile for the shared epilogues.
// The fixed-count loops carry `#pragma GCC unroll`: at -O2 GCC does not unroll them otherwise, and the
// accumulator arrays then live in memory.
#include <arm_neon.h>

#include "../simd.h"
#include "mmla.h"

namespace cpumoe {
namespace {

constexpr int kMaxRows = 8;

// Column pairs per pass for a tile of P row pairs.
constexpr int pass_pairs(int P) { return P <= 2 ? 8 : 4; }

// tile[r][2 * pair0 : 2 * (pair0 + G)] = a_r . b[:, same columns]
template <int R, int G>
inline void accumulate_pass(const GemmTile& t, int pair0, float (&tile)[R][kBlockCols]) {
  constexpr int P = (R + 1) / 2;
  const bfloat16_t* a[2 * P];
  for (int i = 0; i < 2 * P; ++i) a[i] = static_cast<const bfloat16_t*>(t.a_rows[i < R ? i : R - 1]);
  const bfloat16_t* b = static_cast<const bfloat16_t*>(t.b) + pair0 * 8;
  float32x4_t acc[P][G];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) acc[p][g] = vdupq_n_f32(0.0f);
  for (int64_t q = 0; q < t.k / 4; ++q) {
    bfloat16x8_t x[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) x[p] = vcombine_bf16(vld1_bf16(a[2 * p] + 4 * q), vld1_bf16(a[2 * p + 1] + 4 * q));
    const bfloat16_t* bq = b + q * kBlockCols * 4;
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const bfloat16x8_t w = vld1q_bf16(bq + 8 * g);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[p][g] = vbfmmlaq_f32(acc[p][g], x[p], w);
    }
  }
  store_pairs<R, P, G>(acc, pair0, tile);
}

template <int R>
inline void accumulate(const GemmTile& t, float (&tile)[R][kBlockCols]) {
  constexpr int G = pass_pairs((R + 1) / 2);
  for (int pair0 = 0; pair0 < kBlockCols / 2; pair0 += G) accumulate_pass<R, G>(t, pair0, tile);
}

template <int R>
void w13_rows(const GemmTile& t) {
  float tile[R][kBlockCols];
  accumulate<R>(t, tile);
  for (int r = 0; r < R; ++r)
    simd::w13_epilogue<DType::kBFloat16>(t, r, simd::load_f32(tile[r]), simd::load_f32(tile[r] + 16),
                                         simd::load_f32(tile[r] + 32), simd::load_f32(tile[r] + 48));
}

template <int R>
void w2_rows(const GemmTile& t) {
  float tile[R][kBlockCols];
  accumulate<R>(t, tile);
  for (int r = 0; r < R; ++r) {
    const simd::f32x16 v[4] = {simd::load_f32(tile[r]), simd::load_f32(tile[r] + 16),
                               simd::load_f32(tile[r] + 32), simd::load_f32(tile[r] + 48)};
    simd::w2_epilogue(t, r, v);
  }
}

constexpr TileFn kW13[kMaxRows + 1] = {nullptr,      w13_rows<1>, w13_rows<2>, w13_rows<3>, w13_rows<4>,
                                       w13_rows<5>, w13_rows<6>, w13_rows<7>, w13_rows<8>};
constexpr TileFn kW2[kMaxRows + 1] = {nullptr,     w2_rows<1>, w2_rows<2>, w2_rows<3>, w2_rows<4>,
                                      w2_rows<5>, w2_rows<6>, w2_rows<7>, w2_rows<8>};

void w13_tile(const GemmTile& t) { run_row_tiles(t, kW13, kMaxRows, 2); }
void w2_tile(const GemmTile& t) { run_row_tiles(t, kW2, kMaxRows, 4); }

}  // namespace

const KernelTable& kernels_arm_bfmmla() {
  static const KernelTable table{"arm-bfmmla", Layout::kQuads, kMaxRows, 1u << int(DType::kBFloat16), w13_tile,
                                 w2_tile};
  return table;
}

}  // namespace cpumoe
