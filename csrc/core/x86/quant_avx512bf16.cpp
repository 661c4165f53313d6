// x86 AVX-512 BF16: fp8_w8a16 tiles with VDPBF16PS, activations bf16 (mxfp4_w4a16 computes as W4A8 on the
// VNNI unit). The block keeps the dense kPairs order per k-pair ([Kp/2][64][2] bytes), so 16 columns x one
// k-pair widen in registers to one zmm of bf16 pairs that VDPBF16PS takes with the row's broadcast
// (a[k], a[k+1]), exactly as the dense tile: sign-extend the byte to 16 bits, shift by 4 and set the
// exponent bias: s, e + 112, m is the e4m3 value x 2^-8 as a bf16 normal (VDPBF16PS flushes bf16
// subnormals, so the bias keeps even e4m3's subnormals m * 2^-9 normal; those lanes come from a table).
// Exact; 2^8 goes into the f32 scale. Each chunk of g k sums in f32 and is rescaled per column once.
// Decode (1-2 rows) widens per register tile, streaming the codes with a prefetch that skips the block's metadata
// into the next block's codes, and the scales a chunk ahead (as the VNNI unit's tiles; 1.07x at M = 1). Prefill
// widens each block once into a thread-local bf16 kPairs block, unscaled, run by the same chunked tile (6 rows).
// Measured on one Xeon (Emerald Rapids) thread against the dense bf16 tile, 1 row streaming 1 GB of
// Kp = 2048 blocks (bf16: 15 GB/s): 1.7x the rows per second (1.55x when 10% of the bytes are zeros or
// subnormals), bound by VDPBF16PS (~1.3 per ns here) plus the widening, not by memory; 64 rows: 0.95-1.0x
// (the dense tile's rate).
#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels_avx512bf16.h"
#include "quant_tiles.h"

namespace cpumoe {
namespace {

constexpr int kDirectRows = 2;    // register tiles that widen the weights themselves
constexpr int kScratchRows = 3;   // from this many rows a call dequantizes its block once

// fp8 e4m3 block (quant.h): [Kp/2][64][2] bytes, then f32 scale[ceil(Kp/g)][64], then a bit per k-pair set where
// its codes hold a zero exponent field.
struct Fp8 {
  static constexpr int kPairBytes = 128;
  const uint8_t* b;
  const float* scales;
  const uint64_t* zero_exponents;
  int64_t chunk;
  __m512i mag, mag_sign, bias, sign, exp_mask, subnormal;
  explicit Fp8(const GemmTile& t)
      : b(static_cast<const uint8_t*>(t.b)),
        scales(reinterpret_cast<const float*>(b + 64 * t.k)),
        zero_exponents(reinterpret_cast<const uint64_t*>(b + 64 * t.k + fp8_scale_bytes(t.k, t.group))),
        chunk(t.group),
        mag(_mm512_set1_epi16(0x07F0)),
        mag_sign(_mm512_set1_epi16(int16_t(0x87F0))),
        bias(_mm512_set1_epi16(0x3800)),
        sign(_mm512_set1_epi16(int16_t(0x8000))),
        exp_mask(_mm512_set1_epi16(0x0078)) {
    alignas(64) uint16_t table[32] = {};
    for (int m = 0; m < 8; ++m) table[m] = f32_to_bf16(float(m) * (1.0f / 131072.0f));  // m * 2^-17
    subnormal = _mm512_load_si512(table);
  }
  // 16 columns (16c..16c+15) x k-pair p as bf16 pairs, times 2^-8.
  __m512i weights(int64_t p, int c, bool has_e0) const {
    const __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(b + kPairBytes * p + 32 * c)));
    const __m512i t = _mm512_slli_epi16(y, 4);                    // s at bit 15, e at 10..7, m at 6..4
    if (!has_e0) return _mm512_ternarylogic_epi32(t, mag_sign, bias, 0xEA);  // (t & 0x87F0) | 0x3800
    __m512i v = _mm512_ternarylogic_epi32(t, mag, bias, 0xEA);    // (t & 0x07F0) | 0x3800
    const __mmask32 sub = _mm512_testn_epi16_mask(y, exp_mask);  // e == 0: zero or subnormal
    v = _mm512_mask_permutexvar_epi16(v, sub, y, subnormal);
    return _mm512_ternarylogic_epi32(sign, t, v, 0xCA);          // sign from t, the rest from v
  }
  // All 64 columns of k-pair p. Zeros and subnormals (e = 0) need the table; real checkpoints have few (1.4% of
  // the k-pairs of a normally distributed weight), so the k-pairs without any run as their own loop (3 ops a vector
  // instead of 6), found from the block's bit per k-pair (clean_until).
  template <bool HasE0>
  void row(int64_t p, __m512i (&w)[4]) const {
    for (int c = 0; c < 4; ++c) w[c] = weights(p, c, HasE0);
  }
  // The first k-pair in [p, end) whose codes hold a zero exponent field, or end.
  int64_t clean_until(int64_t p, int64_t end) const {
    while (p < end) {
      const uint64_t bits = zero_exponents[p >> 6] >> (p & 63);
      if (bits) return std::min(end, p + __builtin_ctzll(bits));
      p = (p | 63) + 1;
    }
    return end;
  }
  static int64_t meta_bytes(const GemmTile& t) { return fp8_meta_bytes(t.k, t.group); }
  __m512 scale(int64_t chunk_index, int c) const {
    return _mm512_mul_ps(_mm512_loadu_ps(scales + 64 * chunk_index + 16 * c), _mm512_set1_ps(256.0f));
  }
};

// fp8 widened once for prefill (widen_fp8): exact bf16 pairs (x 2^-8) in the dense kPairs order, then the
// block's scales already x 256: [Kp/2][64][2] bf16, f32 scale[ceil(Kp/g)][64].
struct Fp8Widened {
  static constexpr int kPairBytes = 256;
  const uint8_t* b;
  const float* scales;
  int64_t chunk;
  explicit Fp8Widened(const GemmTile& t)
      : b(static_cast<const uint8_t*>(t.b)), scales(reinterpret_cast<const float*>(b + 128 * t.k)), chunk(t.group) {}
  template <bool HasE0>
  void row(int64_t p, __m512i (&w)[4]) const {
    for (int c = 0; c < 4; ++c) w[c] = _mm512_load_si512(b + kPairBytes * p + 64 * c);
  }
  int64_t clean_until(int64_t, int64_t end) const { return end; }
  __m512 scale(int64_t chunk_index, int c) const { return _mm512_load_ps(scales + 64 * chunk_index + 16 * c); }
  static int64_t meta_bytes(const GemmTile& t) { return fp8_scale_bytes(t.k, t.group); }
};

// y[r][c] = sum over chunks of scale * (the chunk's bf16 dot), R rows, widening the weights per k-pair.
template <class F, int R>
void chunked_dot(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
  const F f(t);
  const int32_t* a[R];
  __m512 tot[R][4];
  for (int r = 0; r < R; ++r) {
    a[r] = static_cast<const int32_t*>(t.a_rows[r]);
    for (int c = 0; c < 4; ++c) tot[r][c] = _mm512_setzero_ps();
  }
  const int64_t chunks = (t.k + f.chunk - 1) / f.chunk;
  const int64_t codes = F::kPairBytes * (t.k / 2), tail = F::meta_bytes(t);
  const char* b = reinterpret_cast<const char*>(f.b);
  for (int64_t k0 = 0, chunk = 0; k0 < t.k; k0 += f.chunk, ++chunk) {
    const int64_t k1 = std::min(k0 + f.chunk, t.k);
    if constexpr (R <= kDirectRows) {  // streaming from memory (the widened block of prefill is in cache)
      // The next chunk's scales lie past the codes, off the stream; after the last chunk, the next block's first.
      const char* next_scales = chunk + 1 < chunks ? b + codes + 256 * (chunk + 1) : b + 2 * codes + tail;
      for (int l = 0; l < 4; ++l) _mm_prefetch(next_scales + 64 * l, _MM_HINT_T1);
    }
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    const auto pair = [&](int64_t p, auto has_e0) {
      int64_t at = F::kPairBytes * p + qx86::kStreamAheadBytes;
      if (R <= kDirectRows && at >= codes) at += tail;  // past the codes: on in the next block's (a run's next tile)
      for (int l = 0; l < F::kPairBytes / 64; ++l) qx86::prefetch_stream(b + at + 64 * l);
      __m512i w[4];
      f.template row<decltype(has_e0)::value>(p, w);
      for (int c = 0; c < 4; ++c)
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)_mm512_set1_epi32(a[r][p]), (__m512bh)w[c]);
    };
    for (int64_t p = k0 / 2, end = k1 / 2; p < end;) {
      for (const int64_t clean = f.clean_until(p, end); p < clean; ++p) pair(p, std::false_type{});
      if (p < end) pair(p++, std::true_type{});
    }
    for (int c = 0; c < 4; ++c) {
      const __m512 s = f.scale(chunk, c);
      for (int r = 0; r < R; ++r) tot[r][c] = _mm512_fmadd_ps(acc[r][c], s, tot[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) y[r][c] = (simd::f32x16)tot[r][c];
}

}  // namespace

// fp8 widened to Fp8Widened's layout. Folding its scales into bf16 would round w * scale
// (up to 7.5e-3 of the largest output in the harness); the chunked tile keeps them in f32 at no cost here.
uint8_t* avx512bf16_fp8_widened_block(const GemmTile& t) {
  const Fp8 f(t);
  const int64_t chunks = (t.k + t.group - 1) / t.group;
  uint8_t* dst = qx86::scratch(128 * t.k + 256 * chunks);
  float* scales = reinterpret_cast<float*>(dst + 128 * t.k);
  for (int64_t chunk = 0; chunk < chunks; ++chunk)
    for (int c = 0; c < 4; ++c) _mm512_store_ps(scales + 64 * chunk + 16 * c, f.scale(chunk, c));
  return dst;
}

void avx512bf16_widen_fp8_pairs(const GemmTile& t, int64_t begin, int64_t end, uint8_t* dst) {
  const Fp8 f(t);
  const char* ahead = static_cast<const char*>(t.b) + qx86::kWidenAheadBytes;
  const auto pair = [&](int64_t p, auto has_e0) {
    _mm_prefetch(ahead + Fp8::kPairBytes * p, _MM_HINT_T0);
    _mm_prefetch(ahead + Fp8::kPairBytes * p + 64, _MM_HINT_T0);
    __m512i w[4];
    f.template row<decltype(has_e0)::value>(p, w);
    for (int c = 0; c < 4; ++c) _mm512_store_si512(dst + 256 * p + 64 * c, w[c]);
  };
  for (int64_t p = begin; p < end;) {
    for (const int64_t clean = f.clean_until(p, end); p < clean; ++p) pair(p, std::false_type{});
    if (p < end) pair(p++, std::true_type{});
  }
}

namespace {

// The whole block at once, for this unit's own prefill.
const void* widen_fp8(const GemmTile& t) {
  uint8_t* dst = avx512bf16_fp8_widened_block(t);
  avx512bf16_widen_fp8_pairs(t, 0, t.k / 2, dst);
  return dst;
}

}  // namespace

namespace {

template <int R>
struct Fp8Dot {
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) { chunked_dot<Fp8, R>(t, y); }
};
template <int R>
struct Fp8WidenedDot {
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) { chunked_dot<Fp8Widened, R>(t, y); }
};

// Below kScratchRows rows the register tiles widen the weights themselves; from there a call widens its
// block once and runs 6-row chunked tiles: 24 accumulators in registers, the chunk totals on the stack (touched
// once a chunk). 3-row tiles, with both in registers, ran at 0.88x the bf16 layer at M = 2048; 6-row, 0.93x.
struct Fp8Tiles {
  using Direct = qx86::Tiles<Fp8Dot, DType::kBFloat16, kDirectRows>;
  using Widened = qx86::Tiles<Fp8WidenedDot, DType::kBFloat16, 6>;
  static void w13(const GemmTile& t) {
    if (t.rows < kScratchRows) return Direct::w13(t);
    GemmTile wide = t;
    wide.b = widen_fp8(t);
    Widened::w13(wide);
  }
  static void w2(const GemmTile& t) {
    if (t.rows < kScratchRows) return Direct::w2(t);
    GemmTile wide = t;
    wide.b = widen_fp8(t);
    Widened::w2(wide);
  }
};

}  // namespace

const QuantKernel* quant_x86_avx512bf16(QuantFormat f) {
  static const QuantKernel fp8{6, false, Fp8Tiles::w13, Fp8Tiles::w2};
  switch (f) {
    case QuantFormat::kFp8W8A16: return &fp8;
    default: return nullptr;
  }
}

}  // namespace cpumoe
