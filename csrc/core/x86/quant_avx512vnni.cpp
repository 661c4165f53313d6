// x86 AVX-512 VNNI: int8_w8a8, int4_w4a16 and mxfp4_w4a16 tiles with VPDPBUSD (u8 x s8 -> int32, four products a lane).
//   int8: a block is [Kp/4][64][4] int8, so one 64-byte load is 16 columns x one k-quad and a row's k-quad
//         is one 32-bit broadcast. VPDPBUSD wants one unsigned operand: the activations come as
//         u = a + 128 (unsigned_activations) and 128 * colsum[n] is taken off once at the end. Up to
//         6 rows x 64 columns of int32 accumulators (24 zmm); exact integer sums, one f32 rescale.
//   int4: the codes (0..15) are the unsigned operand and the signed activations the signed one, so no
//         offset at all: a 64-byte load & 0xF is 16 columns x one k-quad and >> 4 the next quad. Each group
//         (g k) ends with tot += scale * (acc - zero * sum_G(a)) in f32; 4 rows (16 int32 + 16 f32 zmm).
// Results are bit-identical to quant_generic's: the same float operations in the same order, none fused
// (the file builds with -ffp-contract=off), so the per-token int8 re-quantization of the w13 output never
// rounds differently from backend to backend (one flipped level costs ~1/127 of the row's largest value).
// Decode tiles (1-2 rows) stream the block from memory with a prefetch into L1 (qx86::kStreamAheadBytes ahead).
// Past the codes it skips the block's scales and goes on in the next block's codes (the next tile of
// a worker's run), and the scales are prefetched a group ahead, the next block's first group at the last: a
// tile that started cold cost ~0.7 us, and a quantized block is 4-8x smaller than a bf16 one (at M = 1, in an
// A/B within one process: int4 1.16x, mxfp4 1.24x, int8 1.05x the speed). Measured on one Xeon (Emerald Rapids)
// thread against the dense bf16 tile on the same shapes, 1 row streaming 1 GB of Kp = 2048 blocks (bf16: 15 GB/s):
// int8 2.1x the rows per second, int4 g128 3.5x (g32 2.85x, as its bytes allow); 64 rows: int8 2.9-3.2x, int4 g128
// 3.8-4.6x.
#include "../quant_row.h"
#include "quant_tiles.h"

namespace cpumoe {
namespace {

// acc + the dot products of u8 (unsigned bytes) and s8 (signed bytes), four to a lane: VPDPBUSD. Written as inline
// asm because GCC 12 wraps _mm512_dpbusd_epi32's accumulator in a register copy there and back at every call,
// and in the 6-row int8 tile spills the accumulators to the stack each k-quad: that tile ran at 340 GOP/s,
// the bf16 tile's rate, where VNNI does twice the multiply-adds per instruction.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

constexpr int kStreamRows = 2;

// Streaming tiles prefetch `lines` lines at p + ahead.
template <int R>
inline void prefetch_lines(const void* p, int lines, int64_t ahead = qx86::kStreamAheadBytes) {
  if constexpr (R <= kStreamRows)
    for (int l = 0; l < lines; ++l)
      qx86::prefetch_stream(static_cast<const char*>(p) + ahead + 64 * l);
}

// Lines of the codes kStreamAheadBytes past byte `off` of a block of `codes` code bytes then `tail` bytes of
// scales: past the codes the stream goes on in the next block's codes (a run's next tile), not in this block's
// scales.
template <int R>
inline void prefetch_codes(const uint8_t* b, int64_t off, int64_t codes, int64_t tail, int lines) {
  if constexpr (R <= kStreamRows) {
    int64_t at = off + qx86::kStreamAheadBytes;
    if (at >= codes) at += tail;
    for (int l = 0; l < lines; ++l) qx86::prefetch_stream(b + at + 64 * l);
  }
}

template <int R>
struct Int8Dot {
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const __m512i* b = static_cast<const __m512i*>(t.b);
    const int32_t* a[R];
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r) {
      a[r] = static_cast<const int32_t*>(t.a_rows[r]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
    }
    const int64_t quads = t.k / 4;
    // The scales and column sums the end reads lie past the codes, off the stream (M = 1 and 8: 0.99x, 0.97x).
    prefetch_lines<R>(b + t.k, kInt8MetaBytes / 64, 0);
    for (int64_t q = 0; q < quads; ++q) {
      const __m512i* bq = b + 4 * q;
      prefetch_codes<R>(static_cast<const uint8_t*>(t.b), 256 * q, 64 * t.k, kInt8MetaBytes, 4);
      const __m512i w0 = _mm512_loadu_si512(bq), w1 = _mm512_loadu_si512(bq + 1);
      const __m512i w2 = _mm512_loadu_si512(bq + 2), w3 = _mm512_loadu_si512(bq + 3);
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_set1_epi32(a[r][q]);
        acc[r][0] = dpbusd(acc[r][0], x, w0);
        acc[r][1] = dpbusd(acc[r][1], x, w1);
        acc[r][2] = dpbusd(acc[r][2], x, w2);
        acc[r][3] = dpbusd(acc[r][3], x, w3);
      }
    }
    const float* scale = reinterpret_cast<const float*>(b + t.k);  // after 64 * Kp bytes
    const int32_t* colsum = reinterpret_cast<const int32_t*>(scale + 64);
    for (int c = 0; c < 4; ++c) {
      const __m512 sw = _mm512_loadu_ps(scale + 16 * c);
      const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(colsum + 16 * c), 7);  // 128 * colsum
      for (int r = 0; r < R; ++r) {
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], offset)), sw);
        y[r][c] = (simd::f32x16)_mm512_mul_ps(v, _mm512_set1_ps(qx86::a8_scale(a[r], t.k)));
      }
    }
  }
};

template <int R>
struct Int4Dot {
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const uint8_t* b = static_cast<const uint8_t*>(t.b);
    const int64_t Kp = t.k, g = t.group;
    const float* meta = reinterpret_cast<const float*>(b + 32 * Kp);  // per group: scale[64] (, zero[64])
    const int64_t stride = int4_group_floats(t.symmetric);             // floats of a group's metadata
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const qx86::A8Rows<R> rows(t);
    const auto& a = rows.a;
    const auto& sums = rows.sums;
    __m512 tot[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) tot[r][c] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < Kp; k0 += g) {
      // The next group's scales and zeros lie past the codes, off the stream the prefetch above follows.
      if (k0 + g < Kp) prefetch_lines<R>(meta + stride * ((k0 + g) / g), int(stride / 16), 0);
      else prefetch_lines<R>(b + 2 * (32 * Kp) + 4 * stride * (Kp / g), int(stride / 16), 0);  // the next block's
      // Streaming tiles take the high nibbles in place (16 q) into accumulators of their own: an AND instead
      // of a shift and an AND, and two independent dot chains (6% at M = 1 in an interleaved A/B); acc_hi is a
      // multiple of 16, so acc + acc_hi / 16 is exact. Larger tiles would spill the extra accumulators.
      __m512i acc[R][4], acc_hi[R][4];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = acc_hi[r][c] = _mm512_setzero_si512();
      for (int64_t s = k0 / 8; s < (k0 + g) / 8; ++s) {  // k-octets: 256 bytes, 64 columns x 8 k
        const __m512i* bs = reinterpret_cast<const __m512i*>(b + 256 * s);
        prefetch_codes<R>(b, 256 * s, 32 * Kp, 4 * stride * (Kp / g), 4);
        for (int c = 0; c < 4; ++c) {
          const __m512i raw = _mm512_loadu_si512(bs + c);
          const __m512i lo = _mm512_and_si512(raw, low4);
          for (int r = 0; r < R; ++r) acc[r][c] = dpbusd(acc[r][c], lo, _mm512_set1_epi32(a[r][2 * s]));
          if constexpr (R <= kStreamRows) {
            const __m512i hi16 = _mm512_andnot_si512(low4, raw);
            for (int r = 0; r < R; ++r)
              acc_hi[r][c] = dpbusd(acc_hi[r][c], hi16, _mm512_set1_epi32(a[r][2 * s + 1]));
          } else {
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            for (int r = 0; r < R; ++r)
              acc[r][c] = dpbusd(acc[r][c], hi, _mm512_set1_epi32(a[r][2 * s + 1]));
          }
        }
      }
      if constexpr (R <= kStreamRows)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_add_epi32(acc[r][c], _mm512_srai_epi32(acc_hi[r][c], 4));
      const float* scale = meta + stride * (k0 / g);
      const float* zeros = int4_zeros(scale, t.symmetric);
      __m512 sum_a[R];
      for (int r = 0; r < R; ++r) sum_a[r] = _mm512_set1_ps(float(qx86::a8_sum(sums[r], k0, k0 + g)));
      for (int c = 0; c < 4; ++c) {
        const __m512 sw = _mm512_loadu_ps(scale + 16 * c), zero = _mm512_loadu_ps(zeros + 16 * c);
        for (int r = 0; r < R; ++r) {  // unfused, in quant_generic's order (see the header)
          const __m512 v = _mm512_sub_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_mul_ps(zero, sum_a[r]));
          tot[r][c] = _mm512_add_ps(tot[r][c], _mm512_mul_ps(sw, v));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sa = _mm512_set1_ps(qx86::a8_scale(a[r], Kp));
      for (int c = 0; c < 4; ++c) y[r][c] = (simd::f32x16)_mm512_mul_ps(tot[r][c], sa);
    }
  }
};

// mxfp4: the codes sit in int4's nibble order, so the same two vectors per 64 bytes come out of a mask and a
// shift; VPSHUFB then maps each code to kMxfp4Twice + 12 (0..24), the unsigned operand. The accumulators
// start each 32-k group at -12 x the group's activation sum, so they end at the signed dot exactly, and
// the group's power-of-two scale is one shift of its exponent byte.
template <int R>
struct Mxfp4Dot {
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const uint8_t* b = static_cast<const uint8_t*>(t.b);
    const int64_t Kp = t.k;
    const uint8_t* exps = b + 32 * Kp;  // [Kp/32][64]
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    alignas(16) int8_t table[16];
    for (int q = 0; q < 16; ++q) table[q] = int8_t(kMxfp4Twice[q] + kMxfp4Offset);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
    const qx86::A8Rows<R> rows(t);
    const auto& a = rows.a;
    const auto& sums = rows.sums;
    __m512 tot[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) tot[r][c] = _mm512_setzero_ps();
    for (int64_t G = 0; G < Kp / kMxfp4Group; ++G) {
      if (G + 1 < Kp / kMxfp4Group) prefetch_lines<R>(exps + 64 * G, 1, 64);  // the next group's exponents
      else prefetch_lines<R>(b + 2 * (32 * Kp) + 2 * Kp, 1, 0);  // the next block's first group's
      __m512i acc[R][4];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_set1_epi32(-kMxfp4Offset * sums[r][G]);
      for (int64_t s = 4 * G; s < 4 * G + 4; ++s) {  // k-octets: 256 bytes, 64 columns x 8 k
        const __m512i* bs = reinterpret_cast<const __m512i*>(b + 256 * s);
        prefetch_codes<R>(b, 256 * s, 32 * Kp, 2 * Kp, 4);
        for (int c = 0; c < 4; ++c) {
          const __m512i raw = _mm512_loadu_si512(bs + c);
          const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(raw, low4));
          const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4));
          for (int r = 0; r < R; ++r) {
            acc[r][c] = dpbusd(acc[r][c], lo, _mm512_set1_epi32(a[r][2 * s]));
            acc[r][c] = dpbusd(acc[r][c], hi, _mm512_set1_epi32(a[r][2 * s + 1]));
          }
        }
      }
      for (int c = 0; c < 4; ++c) {
        const __m512i e =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(exps + 64 * G + 16 * c)));
        const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));  // 2^(e - 127); e = 0 gives 0
        for (int r = 0; r < R; ++r)  // scale x acc is exact, so this rounds once, as quant_generic's
          tot[r][c] = _mm512_add_ps(tot[r][c], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(acc[r][c])));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 half_sa = _mm512_set1_ps(qx86::a8_scale(a[r], Kp) * 0.5f);
      for (int c = 0; c < 4; ++c) y[r][c] = (simd::f32x16)_mm512_mul_ps(tot[r][c], half_sa);
    }
  }
};

using Int8Tiles = qx86::Tiles<Int8Dot, DType::kFloat32, 6>;
using Int4Tiles = qx86::Tiles<Int4Dot, DType::kFloat32, 4>;
using Mxfp4Tiles = qx86::Tiles<Mxfp4Dot, DType::kFloat32, 4>;

}  // namespace

const QuantKernel* quant_x86_avx512vnni(QuantFormat f) {
  static const QuantKernel int8{6, true, Int8Tiles::w13, Int8Tiles::w2, write_quantized_row};
  static const QuantKernel int4{4, false, Int4Tiles::w13, Int4Tiles::w2, write_quantized_row};
  static const QuantKernel mxfp4{4, false, Mxfp4Tiles::w13, Mxfp4Tiles::w2, write_quantized_row};
  switch (f) {
    case QuantFormat::kInt8W8A8: return &int8;
    case QuantFormat::kInt4W4A16: return &int4;
    case QuantFormat::kMxfp4W4A16: return &mxfp4;
    default: return nullptr;
  }
}

}  // namespace cpumoe
