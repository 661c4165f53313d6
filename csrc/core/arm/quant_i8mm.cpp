// Arm I8MM (Armv8.6 SMMLA, vmmlaq_s32): int8_w8a8, int4_w4a16 and mxfp4_w4a16 tiles (block layouts in
// ../quant.h; mxfp4's codes sit in int4's order and go through a TBL to kMxfp4Twice).
// SMMLA multiplies a 2x8 int8 operand (two activation rows, 8 consecutive k each) by an 8x2 one (two
// columns, 8 consecutive k each, stored as column 0's 8 bytes then column 1's) into an int32x4
// [r0c0, r0c1, r1c0, r1c1]: 32 multiply-adds per instruction, twice SDOT's.
//
// Weight operands: both layouts give 4 columns x 4 k in one 16-byte load (int8: [Kp/4][64][4] at k-quad
// q, columns 4u..4u+3; int4: quarter u of a k-octet, low nibbles k 0..3 and high nibbles k 4..7), so
// zipping the 32-bit lanes of the k 0..3 vector with the k 4..7 vector (int8: the next k-quad; int4: the
// high nibbles) gives two SMMLA operands, columns (4u, 4u+1) and (4u+2, 4u+3) over 8 k. Activations are
// signed int8 (QuantKernel::unsigned_activations = false), two 64-bit loads per row pair and k-octet.
//
// Tiling, as kernels_bfmmla.cpp: rows go in pairs (an odd last row pairs with itself and the copy's output
// is dropped); a pass keeps P row pairs x G column pairs of int32x4 accumulators over the whole k (int8)
// or over one group (int4, which also keeps as many float32x4 sums: per group the integer dot becomes
// scale * (acc - zero * sum_a), one convert, FMLS and FMLA per accumulator). At most 16 q registers hold
// accumulators: int8 G = 8 for P <= 2 and 4 for P = 3, 4; int4 G = 8, 4, 2, 2 for P = 1..4. Per k-octet
// and 4 columns a pass makes 2 weight loads + 2 zips (int8) or 1 load, AND, USHR + 2 zips (int4), and 2P
// SMMLAs. After a pass, zipping the 64-bit halves of neighbouring column pairs' accumulators gives four
// columns of each row, stored to a float tile for the shared epilogue (quant_arm.h).
// One row (decode) wastes half of each SMMLA on the duplicated row; quant_dotprod.cpp's SDOT tiles do
// the same work with no zips, so a CPU with both would do better with those for a single row.
#include "mmla.h"
#include "quant_arm.h"

namespace cpumoe {
namespace {

constexpr int kMaxRows = 8;

// Column pairs per pass for P row pairs.
constexpr int int8_pass_pairs(int P) { return P <= 2 ? 8 : 4; }
constexpr int int4_pass_pairs(int P) { return P == 1 ? 8 : (P == 2 ? 4 : 2); }

// SMMLA operands of columns 4u..4u+3 at one k-octet: w0 = columns (4u, 4u+1), w1 = (4u+2, 4u+3).
inline void int8_operands(const int8_t* octet, int u, int8x16_t& w0, int8x16_t& w1) {
  const int32x4_t k0 = vreinterpretq_s32_s8(vld1q_s8(octet + 16 * u));        // k-quad 2s
  const int32x4_t k4 = vreinterpretq_s32_s8(vld1q_s8(octet + 256 + 16 * u));  // k-quad 2s + 1
  w0 = vreinterpretq_s8_s32(vzip1q_s32(k0, k4));
  w1 = vreinterpretq_s8_s32(vzip2q_s32(k0, k4));
}
template <QuantFormat F>
inline void nibble_operands(const uint8_t* octet, int u, int8x16_t& w0, int8x16_t& w1) {
  int8x16_t lo, hi;
  nibble_operands<F>(vld1q_u8(octet + 16 * u), lo, hi);
  const int32x4_t k0 = vreinterpretq_s32_s8(lo), k4 = vreinterpretq_s32_s8(hi);
  w0 = vreinterpretq_s8_s32(vzip1q_s32(k0, k4));
  w1 = vreinterpretq_s8_s32(vzip2q_s32(k0, k4));
}

// Row pair p's activations at k-octet s.
template <int P>
inline void load_rows(const int8_t* const (&a)[2 * P], int64_t s, int8x16_t (&x)[P]) {
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) x[p] = vcombine_s8(vld1_s8(a[2 * p] + 8 * s), vld1_s8(a[2 * p + 1] + 8 * s));
}

// int8: tile[r][2 * pair0 ...] = a_r . w (integer dot, as float32) for G column pairs.
template <int R, int P, int G>
inline void int8_pass(const GemmTile& t, const int8_t* const (&a)[2 * P], int pair0, float (&tile)[R][kBlockCols]) {
  const int8_t* b = static_cast<const int8_t*>(t.b) + 8 * pair0;  // 16 bytes per 4 columns
  int32x4_t acc[P][G];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) acc[p][g] = vdupq_n_s32(0);
  for (int64_t s = 0; s < t.k / 8; ++s) {
    int8x16_t x[P];
    load_rows<P>(a, s, x);
    const int8_t* octet = b + 512 * s;  // k-quads 2s, 2s + 1
#pragma GCC unroll 4
    for (int u = 0; u < G / 2; ++u) {
      int8x16_t w0, w1;
      int8_operands(octet, u, w0, w1);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        acc[p][2 * u] = vmmlaq_s32(acc[p][2 * u], x[p], w0);
        acc[p][2 * u + 1] = vmmlaq_s32(acc[p][2 * u + 1], x[p], w1);
      }
    }
  }
  float32x4_t f[P][G];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) f[p][g] = vcvtq_f32_s32(acc[p][g]);
  store_pairs<R, P, G>(f, pair0, tile);
}

// int4: tile[r][2 * pair0 ...] = sum_G scale[G] * (a_r . q over G - zero[G] * sum of a_r over G);
// mxfp4: sum_G 2^(e_G - 128) * (a_r . kMxfp4Twice[q] over G).
template <QuantFormat F, int R, int P, int G>
inline void nibble_pass(const GemmTile& t, const A8Row (&rows)[R], const int8_t* const (&a)[2 * P], int pair0,
                      float (&tile)[R][kBlockCols]) {
  const uint8_t* b = static_cast<const uint8_t*>(t.b) + 8 * pair0;
  const int64_t octets = t.group / 8;
  float32x4_t facc[P][G];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) facc[p][g] = vdupq_n_f32(0.0f);
  for (int64_t grp = 0; grp < t.k / t.group; ++grp) {
    int32x4_t acc[P][G];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[p][g] = vdupq_n_s32(0);
    for (int64_t s = grp * octets; s < (grp + 1) * octets; ++s) {
      int8x16_t x[P];
      load_rows<P>(a, s, x);
      const uint8_t* octet = b + 256 * s;
#pragma GCC unroll 4
      for (int u = 0; u < G / 2; ++u) {
        int8x16_t w0, w1;
        nibble_operands<F>(octet, u, w0, w1);
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          acc[p][2 * u] = vmmlaq_s32(acc[p][2 * u], x[p], w0);
          acc[p][2 * u + 1] = vmmlaq_s32(acc[p][2 * u + 1], x[p], w1);
        }
      }
    }
    if constexpr (F == QuantFormat::kMxfp4W4A16) {
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        const float32x2_t s2 = mxfp4_half_scales2(t, grp, 2 * (pair0 + g));
        const float32x4_t s = vcombine_f32(s2, s2);
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) facc[p][g] = vfmaq_f32(facc[p][g], vcvtq_f32_s32(acc[p][g]), s);
      }
      continue;
    }
    const float* scale = int4_group_meta(t, grp);
    const float* zero = int4_zeros(scale, t.symmetric);
    float32x4_t sum_a[P];  // [S(r0), S(r0), S(r1), S(r1)], as the accumulators' rows
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const int64_t k0 = grp * t.group;
      sum_a[p] = vcombine_f32(vdup_n_f32(a8_group_sum(rows[2 * p], k0, t.group)),
                              vdup_n_f32(a8_group_sum(rows[2 * p + 1 < R ? 2 * p + 1 : R - 1], k0, t.group)));
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const int col = 2 * (pair0 + g);
      const float32x2_t s2 = vld1_f32(scale + col), z2 = vld1_f32(zero + col);
      const float32x4_t s = vcombine_f32(s2, s2), z = vcombine_f32(z2, z2);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p)
        facc[p][g] = vfmaq_f32(facc[p][g], vfmsq_f32(vcvtq_f32_s32(acc[p][g]), z, sum_a[p]), s);
    }
  }
  store_pairs<R, P, G>(facc, pair0, tile);
}

template <QuantFormat F, int R>
inline void accumulate(const GemmTile& t, const A8Row (&rows)[R], float (&tile)[R][kBlockCols]) {
  constexpr int P = (R + 1) / 2;
  const int8_t* a[2 * P];
  for (int i = 0; i < 2 * P; ++i) a[i] = rows[i < R ? i : R - 1].q;
  if constexpr (F == QuantFormat::kInt8W8A8) {
    constexpr int G = int8_pass_pairs(P);
    for (int pair0 = 0; pair0 < kBlockCols / 2; pair0 += G) int8_pass<R, P, G>(t, a, pair0, tile);
  } else {
    constexpr int G = int4_pass_pairs(P);
    for (int pair0 = 0; pair0 < kBlockCols / 2; pair0 += G) nibble_pass<F, R, P, G>(t, rows, a, pair0, tile);
  }
}

struct I8mm {
  static constexpr int kMaxRows = ::cpumoe::kMaxRows;
  template <QuantFormat F, int R>
  static void accumulate(const GemmTile& t, const A8Row (&rows)[R], float (&tile)[R][kBlockCols]) {
    ::cpumoe::accumulate<F, R>(t, rows, tile);
  }
};

}  // namespace

const QuantKernel* quant_arm_i8mm(QuantFormat f) { return a8_kernel<I8mm>(f); }

}  // namespace cpumoe
