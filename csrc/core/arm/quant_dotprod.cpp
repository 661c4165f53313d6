// Arm dot product (Armv8.2 SDOT, vdotq_laneq_s32): int8_w8a8, int4_w4a16 and mxfp4_w4a16 tiles (block layouts in
// ../quant.h). SDOT by lane adds to each int32 lane i the dot of bytes 4i..4i+3 of the first operand with
// one 4-byte lane of the second: with 4 columns x 4 k as the first operand and an activation k-quad as
// the lane, one instruction adds 4 columns' k-quad dots (16 multiply-adds).
//
// Weight operands: int8's [Kp/4][64][4] gives 4 columns x 4 k in one 16-byte load at k-quad q, used as
// is; int4's quarter u of a k-octet (columns 4u..4u+3) gives k 0..3 in its low nibbles (AND 0xF) and k
// 4..7 in its high ones (USHR 4); mxfp4's codes, in the same order, go through a TBL to kMxfp4Twice. Activations are signed int8 (QuantKernel::unsigned_activations =
// false): one 16-byte load per row feeds four k-quads through SDOT's lane index.
//
// Tiling, as kernels_neon.cpp: R rows x C columns of int32x4 accumulators for the whole k (int8), C = 64,
// 32, 16, 16 for R = 1..4, or per group (int4, which also keeps as many float32x4 sums: per group the
// integer dot becomes scale * (acc - zero * sum_a), one convert, FMLS and FMLA per accumulator), C = 32,
// 16, 8, 8; at most 16 q registers hold accumulators. The block's 64 columns take 64/C passes over k. Per
// 16 k and 4 columns a pass makes 4 weight loads (int8) or 2 loads, 2 AND, 2 USHR (int4), and 4R SDOTs;
// one 16-byte activation load per row.
#include "quant_arm.h"

namespace cpumoe {
namespace {

constexpr int kMaxRows = 4;

// Columns per pass for R rows.
constexpr int int8_pass_cols(int R) { return R == 1 ? 64 : (R == 2 ? 32 : 16); }
constexpr int int4_pass_cols(int R) { return R == 1 ? 32 : (R == 2 ? 16 : 8); }

template <int R>
inline void load_rows(const A8Row (&rows)[R], int64_t k, int8x16_t (&x)[R]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) x[r] = vld1q_s8(rows[r].q + k);
}

// acc[r][u] += w(columns 4u.., one k-quad) . x[r] lane L (the same k-quad of row r), for C / 4 column quads.
template <int L, int R, int U>
inline void sdot_quads(const int8x16_t (&w)[U], const int8x16_t (&x)[R], int32x4_t (&acc)[R][U]) {
#pragma GCC unroll 16
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r][u] = vdotq_laneq_s32(acc[r][u], w[u], x[r], L);
}

// int8: k-quad q of columns col0 .. col0 + 4U - 1 into acc, with activation lane L.
template <int L, int R, int U>
inline void int8_quad(const int8_t* b, int64_t q, const int8x16_t (&x)[R], int32x4_t (&acc)[R][U]) {
  int8x16_t w[U];
#pragma GCC unroll 16
  for (int u = 0; u < U; ++u) w[u] = vld1q_s8(b + 256 * q + 16 * u);
  sdot_quads<L, R, U>(w, x, acc);
}

// int4 / mxfp4: k-octet s (lanes L, L + 1 of x) of the columns into acc.
template <QuantFormat F, int L, int R, int U>
inline void nibble_octet(const uint8_t* b, int64_t s, const int8x16_t (&x)[R], int32x4_t (&acc)[R][U]) {
  int8x16_t lo[U], hi[U];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) nibble_operands<F>(vld1q_u8(b + 256 * s + 16 * u), lo[u], hi[u]);
  sdot_quads<L, R, U>(lo, x, acc);
  sdot_quads<L + 1, R, U>(hi, x, acc);
}

// int8: tile[r][col0 : col0 + C] = a_r . w (integer dot, as float32).
template <int R, int C>
inline void int8_pass(const GemmTile& t, const A8Row (&rows)[R], int col0, float (&tile)[R][kBlockCols]) {
  constexpr int U = C / 4;
  const int8_t* b = static_cast<const int8_t*>(t.b) + 4 * col0;
  int32x4_t acc[R][U];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) acc[r][u] = vdupq_n_s32(0);
  for (int64_t k = 0; k < t.k; k += 16) {
    int8x16_t x[R];
    load_rows<R>(rows, k, x);
    const int64_t q = k / 4;
    int8_quad<0, R, U>(b, q, x, acc);
    int8_quad<1, R, U>(b, q + 1, x, acc);
    int8_quad<2, R, U>(b, q + 2, x, acc);
    int8_quad<3, R, U>(b, q + 3, x, acc);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int u = 0; u < U; ++u) vst1q_f32(&tile[r][col0 + 4 * u], vcvtq_f32_s32(acc[r][u]));
}

// int4: tile[r][col0 : col0 + C] = sum_G scale[G] * (a_r . q over G - zero[G] * sum of a_r over G);
// mxfp4: sum_G 2^(e_G - 128) * (a_r . kMxfp4Twice[q] over G).
template <QuantFormat F, int R, int C>
inline void nibble_pass(const GemmTile& t, const A8Row (&rows)[R], int col0, float (&tile)[R][kBlockCols]) {
  constexpr int U = C / 4;
  const uint8_t* b = static_cast<const uint8_t*>(t.b) + 4 * col0;
  float32x4_t facc[R][U];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) facc[r][u] = vdupq_n_f32(0.0f);
  for (int64_t grp = 0; grp < t.k / t.group; ++grp) {
    const int64_t k0 = grp * t.group;
    int32x4_t acc[R][U];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) acc[r][u] = vdupq_n_s32(0);
    for (int64_t k = k0; k < k0 + t.group; k += 16) {  // g is a multiple of 32
      int8x16_t x[R];
      load_rows<R>(rows, k, x);
      nibble_octet<F, 0, R, U>(b, k / 8, x, acc);
      nibble_octet<F, 2, R, U>(b, k / 8 + 1, x, acc);
    }
    if constexpr (F == QuantFormat::kMxfp4W4A16) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const float32x4_t s = mxfp4_half_scales4(t, grp, col0 + 4 * u);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) facc[r][u] = vfmaq_f32(facc[r][u], vcvtq_f32_s32(acc[r][u]), s);
      }
      continue;
    }
    const float* scale = int4_group_meta(t, grp) + col0;
    const float* zero = int4_zeros(scale - col0, t.symmetric) + col0;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float sum_a = a8_group_sum(rows[r], k0, t.group);
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u)
        facc[r][u] = vfmaq_f32(facc[r][u], vfmsq_n_f32(vcvtq_f32_s32(acc[r][u]), vld1q_f32(zero + 4 * u), sum_a),
                               vld1q_f32(scale + 4 * u));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) vst1q_f32(&tile[r][col0 + 4 * u], facc[r][u]);
}

template <QuantFormat F, int R>
inline void accumulate(const GemmTile& t, const A8Row (&rows)[R], float (&tile)[R][kBlockCols]) {
  if constexpr (F == QuantFormat::kInt8W8A8) {
    constexpr int C = int8_pass_cols(R);
    for (int col0 = 0; col0 < kBlockCols; col0 += C) int8_pass<R, C>(t, rows, col0, tile);
  } else {
    constexpr int C = int4_pass_cols(R);
    for (int col0 = 0; col0 < kBlockCols; col0 += C) nibble_pass<F, R, C>(t, rows, col0, tile);
  }
}

struct Dotprod {
  static constexpr int kMaxRows = ::cpumoe::kMaxRows;
  template <QuantFormat F, int R>
  static void accumulate(const GemmTile& t, const A8Row (&rows)[R], float (&tile)[R][kBlockCols]) {
    ::cpumoe::accumulate<F, R>(t, rows, tile);
  }
};

}  // namespace

const QuantKernel* quant_arm_dotprod(QuantFormat f) { return a8_kernel<Dotprod>(f); }

}  // namespace cpumoe
