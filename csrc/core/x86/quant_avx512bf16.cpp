// x86 AVX-512 BF16: fp8_w8a16 and mxfp4_w4a16 tiles with VDPBF16PS, activations bf16.
// Both blocks keep the dense kPairs order per k-pair (fp8: [Kp/2][64][2] bytes, mxfp4: [Kp/2][64] bytes of
// two codes), so 16 columns x one k-pair widen in registers to one zmm of bf16 pairs that VDPBF16PS takes
// with the row's broadcast (a[k], a[k+1]), exactly as the dense tile:
//   fp8: sign-extend the byte to 16 bits, shift by 4 and set the exponent bias: s, e + 112, m is the e4m3
//        value x 2^-8 as a bf16 normal (VDPBF16PS flushes bf16 subnormals, so the bias keeps even e4m3's
//        subnormals m * 2^-9 normal; those lanes come from a table). Exact; 2^8 goes into the f32 scale.
//   mxfp4: zero-extend each byte to 32 bits, copy the high code to bits 16.. and VPERMW looks both codes up
//          (decode avoids the widening by pairing k with k + 2 instead, see Mxfp4Dot).
// Each chunk (fp8: g k, mxfp4: 32 k) sums in f32 and is rescaled per column once.
// Decode (1-2 rows) widens per register tile. Prefill widens each block once into a thread-local bf16
// kPairs block: fp8 unscaled, run by the same chunked tile (3 rows); mxfp4 with its power-of-two scale
// folded in (exact), run by the dense tile.
// Measured on one Xeon (Emerald Rapids) thread against the dense bf16 tile, 1 row streaming 1 GB of
// Kp = 2048 blocks (bf16: 15 GB/s): fp8 1.7x the rows per second (1.55x when 10% of the bytes are zeros or
// subnormals), mxfp4 2.4x, both bound by VDPBF16PS (~1.3 per ns here) plus the widening, not by memory;
// 64 rows: fp8 0.95-1.0x, mxfp4 1.0x (the dense tile's rate).
#include <algorithm>
#include <vector>

#include "kernels_avx512bf16.h"
#include "quant_tiles.h"

namespace cpumoe {
namespace {

constexpr int kDirectRows = 2;    // register tiles that widen the weights themselves
constexpr int kScratchRows = 3;   // from this many rows a call dequantizes its block once
constexpr int kPrefetchBytes = 4096;

// fp8 e4m3 block: [Kp/2][64][2] bytes, then f32 scale[ceil(Kp/g)][64].
struct Fp8 {
  static constexpr int kPairBytes = 128;
  const uint8_t* b;
  const float* scales;
  int64_t chunk;
  __m512i mag, mag_sign, bias, sign, exp_mask, exp_mask8, subnormal;
  explicit Fp8(const GemmTile& t)
      : b(static_cast<const uint8_t*>(t.b)),
        scales(reinterpret_cast<const float*>(b + 64 * t.k)),
        chunk(t.group),
        mag(_mm512_set1_epi16(0x07F0)),
        mag_sign(_mm512_set1_epi16(int16_t(0x87F0))),
        bias(_mm512_set1_epi16(0x3800)),
        sign(_mm512_set1_epi16(int16_t(0x8000))),
        exp_mask(_mm512_set1_epi16(0x0078)),
        exp_mask8(_mm512_set1_epi8(0x78)) {
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
  // All 64 columns of k-pair p. Zeros and subnormals (e = 0) need the table; real checkpoints have few, so
  // one test per 128-byte row lets most rows skip it (3 ops a vector instead of 6).
  void row(int64_t p, __m512i (&w)[4]) const {
    const __m512i* raw = reinterpret_cast<const __m512i*>(b + kPairBytes * p);
    const bool has_e0 = (_mm512_testn_epi8_mask(_mm512_loadu_si512(raw), exp_mask8) |
                         _mm512_testn_epi8_mask(_mm512_loadu_si512(raw + 1), exp_mask8)) != 0;
    for (int c = 0; c < 4; ++c) w[c] = weights(p, c, has_e0);
  }
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
  void row(int64_t p, __m512i (&w)[4]) const {
    for (int c = 0; c < 4; ++c) w[c] = _mm512_load_si512(b + kPairBytes * p + 64 * c);
  }
  __m512 scale(int64_t chunk_index, int c) const { return _mm512_load_ps(scales + 64 * chunk_index + 16 * c); }
};

// mxfp4 block: [Kp/2][64] bytes (code k | code k+1 << 4), then u8 e8m0 scale[Kp/32][64].
struct Mxfp4 {
  static constexpr int kPairBytes = 64;
  const uint8_t* b;
  const uint8_t* scales;
  int64_t chunk = kMxfp4Group;
  __m512i lut;
  explicit Mxfp4(const GemmTile& t)
      : b(static_cast<const uint8_t*>(t.b)), scales(b + 32 * t.k) {
    alignas(64) uint16_t table[32];
    for (int i = 0; i < 32; ++i) table[i] = f32_to_bf16(kE2m1[i & 15]);  // VPERMW reads 5 index bits
    lut = _mm512_load_si512(table);
  }
  __m512i weights(int64_t p, int c) const {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kPairBytes * p + 16 * c)));
    const __m512i idx = _mm512_or_si512(d, _mm512_slli_epi32(d, 12));  // low word: code k, high word: code k+1
    return _mm512_permutexvar_epi16(idx, lut);
  }
  void row(int64_t p, __m512i (&w)[4]) const {
    for (int c = 0; c < 4; ++c) w[c] = weights(p, c);
  }
  __m512 scale(int64_t chunk_index, int c) const {  // 2^(e - 127) (e = 0 reads as 0)
    const __m512i e = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 64 * chunk_index + 16 * c)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
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
  for (int64_t k0 = 0, chunk = 0; k0 < t.k; k0 += f.chunk, ++chunk) {
    const int64_t k1 = std::min(k0 + f.chunk, t.k);
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = k0 / 2; p < k1 / 2; ++p) {
      for (int l = 0; l < F::kPairBytes / 64; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(f.b) + F::kPairBytes * p + kPrefetchBytes + 64 * l, _MM_HINT_T1);
      __m512i w[4];
      f.row(p, w);
      for (int c = 0; c < 4; ++c)
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)_mm512_set1_epi32(a[r][p]), (__m512bh)w[c]);
    }
    for (int c = 0; c < 4; ++c) {
      const __m512 s = f.scale(chunk, c);
      for (int r = 0; r < R; ++r) tot[r][c] = _mm512_fmadd_ps(acc[r][c], s, tot[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) y[r][c] = (simd::f32x16)tot[r][c];
}

// mxfp4 decode without widening shuffles. A 64-byte k-pair row holds byte n = codes (k, k+1) of column n; its
// dword j holds columns 4j..4j+3. Taking k-pairs (k, k+2) instead of (k, k+1), the word of row p and the
// same word of row p+1 side by side form a VPERMW index whose 16-bit shifts by 0, 4, 8, 12 pick the
// codes (4i, 4i+2), (4i+1, 4i+3) of column 4j and then of 4j+1 (the other words: 4j+2, 4j+3). So 8 weight
// vectors cost 2 dword shifts, 2 blends, 6 word shifts and 8 VPERMW, against 4 ops each when every 16
// bytes are widened first (VPMOVZXBD); measured 1.4x faster in decode. The rows' bf16 pairs are re-paired
// the same way once per call, and accumulator x lane j is column 4j + x, put back in order at the end.
template <int R>
struct Mxfp4Dot {
  static constexpr int kSplit = R == 1 ? 2 : 1;  // a second accumulator set shortens the 1-row chains
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const uint8_t* b = static_cast<const uint8_t*>(t.b);
    const uint8_t* scales = b + 32 * t.k;
    const __m512i lut = Mxfp4(t).lut, high_words = _mm512_set1_epi32(int32_t(0xFFFF0000u));
    const __m512i byte = _mm512_set1_epi32(0xFF);
    // rows re-paired: word order a[4i], a[4i+2], a[4i+1], a[4i+3] for each k-quad
    thread_local std::vector<uint32_t> repaired;
    if (repaired.size() < size_t(R * t.k / 2)) repaired.resize(R * t.k / 2);
    const __m512i swap12 = _mm512_set_epi16(31, 29, 30, 28, 27, 25, 26, 24, 23, 21, 22, 20, 19, 17, 18, 16,
                                            15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0);
    const uint32_t* a[R];
    for (int r = 0; r < R; ++r) {
      uint32_t* dst = repaired.data() + r * t.k / 2;
      const uint16_t* src = static_cast<const uint16_t*>(t.a_rows[r]);
      for (int64_t k = 0; k < t.k; k += 32)
        _mm512_storeu_si512(dst + k / 2, _mm512_permutexvar_epi16(swap12, _mm512_loadu_si512(src + k)));
      a[r] = dst;
    }
    __m512 tot[R][4];
    for (int r = 0; r < R; ++r)
      for (int x = 0; x < 4; ++x) tot[r][x] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < t.k; k0 += kMxfp4Group) {
      __m512 acc[R][4][kSplit];
      for (int r = 0; r < R; ++r)
        for (int x = 0; x < 4; ++x)
          for (int h = 0; h < kSplit; ++h) acc[r][x][h] = _mm512_setzero_ps();
      for (int64_t i = k0 / 4; i < (k0 + kMxfp4Group) / 4; ++i) {  // k-quad i: k-pair rows 2i, 2i + 1
        const uint8_t* bp = b + 128 * i;
        _mm_prefetch(reinterpret_cast<const char*>(bp) + kPrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(bp) + kPrefetchBytes + 64, _MM_HINT_T1);
        const __m512i d0 = _mm512_loadu_si512(bp), d1 = _mm512_loadu_si512(bp + 64);
        const __m512i idx[2] = {_mm512_ternarylogic_epi32(high_words, _mm512_slli_epi32(d1, 16), d0, 0xCA),
                                _mm512_ternarylogic_epi32(high_words, d1, _mm512_srli_epi32(d0, 16), 0xCA)};
        for (int half = 0; half < 2; ++half)
          for (int col = 0; col < 2; ++col) {
            const int x = 2 * half + col;
            const __m512bh even = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(idx[half], 8 * col), lut);
            const __m512bh odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(idx[half], 8 * col + 4), lut);
            for (int r = 0; r < R; ++r) {
              acc[r][x][0] = _mm512_dpbf16_ps(acc[r][x][0], (__m512bh)_mm512_set1_epi32(a[r][2 * i]), even);
              acc[r][x][kSplit - 1] =
                  _mm512_dpbf16_ps(acc[r][x][kSplit - 1], (__m512bh)_mm512_set1_epi32(a[r][2 * i + 1]), odd);
            }
          }
      }
      const __m512i e = _mm512_loadu_si512(scales + 2 * k0);  // 64 bytes: dword j = columns 4j..4j+3
      for (int x = 0; x < 4; ++x) {
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(e, 8 * x), byte), 23));
        for (int r = 0; r < R; ++r) {
          __m512 v = acc[r][x][0];
          if constexpr (kSplit == 2) v = _mm512_add_ps(v, acc[r][x][1]);
          tot[r][x] = _mm512_fmadd_ps(v, s, tot[r][x]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      alignas(64) float strided[4][16], ordered[64];
      for (int x = 0; x < 4; ++x) _mm512_store_ps(strided[x], tot[r][x]);
      for (int n = 0; n < 64; ++n) ordered[n] = strided[n % 4][n / 4];
      for (int c = 0; c < 4; ++c) y[r][c] = simd::load_f32(ordered + 16 * c);
    }
  }
};

// bf16 pairs (16 columns x 2 k) times a per-column f32 scale, rounded back to bf16 pairs.
inline __m512i scale_pairs(__m512i w, __m512 s) {
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
  const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(odd, s), _mm512_mul_ps(even, s));
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, packed);
}

// This thread's grow-only scratch of at least `bytes`, 64-byte aligned.
inline uint8_t* scratch(int64_t bytes) {
  struct alignas(64) Line { uint8_t bytes[64]; };
  thread_local std::vector<Line> lines;
  if (lines.size() < size_t((bytes + 63) / 64)) lines.resize((bytes + 63) / 64);
  return lines.data()->bytes;
}

// mxfp4 as a dense bf16 kPairs block with the scale folded in (exact: the scale is a power of two).
const void* dequantize_mxfp4(const GemmTile& t) {
  const Mxfp4 f(t);
  __m512i* dst = reinterpret_cast<__m512i*>(scratch(128 * t.k));
  for (int64_t k0 = 0, chunk = 0; k0 < t.k; k0 += f.chunk, ++chunk) {
    __m512 s[4];
    for (int c = 0; c < 4; ++c) s[c] = f.scale(chunk, c);
    for (int64_t p = k0 / 2; p < (k0 + f.chunk) / 2; ++p) {
      __m512i w[4];
      f.row(p, w);
      for (int c = 0; c < 4; ++c) _mm512_store_si512(dst + 4 * p + c, scale_pairs(w[c], s[c]));
    }
  }
  return dst;
}

// fp8 widened to Fp8Widened's layout. Folding its scales into bf16 as mxfp4 does would round w * scale
// (up to 7.5e-3 of the largest output in the harness); the chunked tile keeps them in f32 at no cost here.
const void* widen_fp8(const GemmTile& t) {
  const Fp8 f(t);
  const int64_t chunks = (t.k + t.group - 1) / t.group;
  uint8_t* dst = scratch(128 * t.k + 256 * chunks);
  for (int64_t p = 0; p < t.k / 2; ++p) {
    __m512i w[4];
    f.row(p, w);
    for (int c = 0; c < 4; ++c) _mm512_store_si512(dst + 256 * p + 64 * c, w[c]);
  }
  float* scales = reinterpret_cast<float*>(dst + 128 * t.k);
  for (int64_t chunk = 0; chunk < chunks; ++chunk)
    for (int c = 0; c < 4; ++c) _mm512_store_ps(scales + 64 * chunk + 16 * c, f.scale(chunk, c));
  return dst;
}

template <int R>
struct Fp8Dot {
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) { chunked_dot<Fp8, R>(t, y); }
};
template <int R>
struct Fp8WidenedDot {
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) { chunked_dot<Fp8Widened, R>(t, y); }
};

// Below kScratchRows rows the register tiles widen the weights themselves; from there a call widens its
// block once (fp8: 3-row chunked tiles, 12 + 12 accumulators; mxfp4: the dense 6-row tile).
struct Fp8Tiles {
  using Direct = qx86::Tiles<Fp8Dot, DType::kBFloat16, kDirectRows>;
  using Widened = qx86::Tiles<Fp8WidenedDot, DType::kBFloat16, 3>;
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

struct Mxfp4Tiles {
  using Direct = qx86::Tiles<Mxfp4Dot, DType::kBFloat16, kDirectRows>;
  static void w13(const GemmTile& t) {
    if (t.rows < kScratchRows) return Direct::w13(t);
    GemmTile dense = t;
    dense.b = dequantize_mxfp4(t);
    avx512bf16_w13_tile(dense);
  }
  static void w2(const GemmTile& t) {
    if (t.rows < kScratchRows) return Direct::w2(t);
    GemmTile dense = t;
    dense.b = dequantize_mxfp4(t);
    avx512bf16_w2_tile(dense);
  }
};

}  // namespace

const QuantKernel* quant_x86_avx512bf16(QuantFormat f) {
  static const QuantKernel fp8{6, false, Fp8Tiles::w13, Fp8Tiles::w2};
  static const QuantKernel mxfp4{6, false, Mxfp4Tiles::w13, Mxfp4Tiles::w2};
  switch (f) {
    case QuantFormat::kFp8W8A16: return &fp8;
    case QuantFormat::kMxfp4W4A16: return &mxfp4;
    default: return nullptr;
  }
}

}  // namespace cpumoe
