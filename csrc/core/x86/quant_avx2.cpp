// x86 AVX2: int8_w8a8, int4_w4a16 and mxfp4_w4a16 tiles with VPMADDUBSW (u8 x s8 -> int16 pairs) + VPMADDWD
// (-> int32), fp8_w8a16 with FMA in f32. The A8 tiles take the activations signed (unsigned_activations = false), and neither lets VPMADDUBSW saturate:
//   int8: the unsigned operand is |w| (<= 128) and the signed one sign(a, w) = a * sgn(w) (|a| <= 127), so a
//         pair is at most 2 * 128 * 127 = 32512 < 32767; then VPMADDWD by 1 widens each pair to int32.
//   int4: the codes (0..15) are the unsigned operand, so a pair is at most 2 * 15 * 127 = 3810 and eight of
//         them (one 32-k slice: 4 k-octets, low and high nibbles) add in int16 before one VPMADDWD.
// The A8 results are bit-identical to quant_generic's (same float operations and order, -ffp-contract=off).
// A ymm is 8 columns x one k-quad of either block (quant.h), a row's k-quad one 32-bit broadcast. 16 ymm
// registers hold 8 accumulators, so a register pass covers R rows x 64/R columns (R = 1, 2, 4), and a tile
// runs its passes chunk by chunk (below). On one Zen 3 thread at M = 1, streaming 17-35 MB of packed linear
// weights, the whole-block passes (each over every k, a 4 KB L2 prefetch) read int4 at 50% of the read
// probe and fp8 at 54%; chunked with the L1 prefetch, int8 85-95%, int4 and mxfp4 70-83%, fp8 60-70% (then
// compute-bound in VCVTPH2PS's route; Fp8Dot below takes another). In the layer at M = 1, with a 1-row 4-bit
// tile in one pass a chunk (below): int8 86-91%, int4 81-86%, mxfp4 73-83%, fp8 81-84%. From 3 rows up an fp8
// call widens its block once and runs 6-row tiles over it: the layer at M = 2048 went from 0.41x bf16 to
// 0.98-1.22x.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../quant_row.h"
#include "quant_tiles.h"

namespace cpumoe {
namespace {

// Tiles walk the block in chunks of kChunkK k (4-8 KB of a block at 1 row) and run every column pass of a chunk
// before the next chunk: the block streams from memory once and in order, and the later passes find the chunk
// in L1. Sums that span chunks (int8's whole row, a group wider than a chunk) wait in memory between them.
constexpr int64_t kChunkK = 128;
// How far ahead the stream's prefetches run. Measured at M = 1, old and new tiles in turn: fp8's 1-2-row tile at
// 2 KB ran 1.04-1.05x its speed at 1 KB (3-4 KB no better), where int8 at 2 KB ran 0.93-0.94x.
constexpr int kPrefetchBytes = 1024;
constexpr int kFp8PrefetchBytes = 2048;

// Columns per pass: 8 accumulators (int8); int4 and mxfp4 keep int16 slice sums beside their int32 group sums, so
// a register pass holds 4 + 4, but one row takes all 8 in one pass (the group sums then wait on the stack): a
// chunk read in one pass keeps the prefetches going, where the second pass over it left the memory idle (the
// layer at M = 1 and 8, old and new tiles in turn in one process: int4 1.09-1.14x, mxfp4 1.04-1.09x the speed).
constexpr int int8_vectors(int R) { return R == 1 ? 8 : R == 2 ? 4 : 2; }  // R = 3: 2
constexpr int int4_vectors(int R) { return R == 1 ? 8 : R == 2 ? 2 : 1; }  // R = 3: 1

// A block is its codes, then its metadata (scales, zero points, exponents), and a worker's run of tiles reads
// consecutive blocks. The first pass over a chunk prefetches each k-row it reaches `ahead` bytes ahead into L1,
// and past the codes the stream goes on in the next block's codes, not in this block's metadata, so a tile does
// not start cold (448 tiles a call at M = 1; measured: int4 1.02-1.04x, the others within the noise).
struct CodeStream {
  const uint8_t* b;
  int64_t codes, meta;  // bytes of this block's codes and of its metadata
  int64_t ahead = kPrefetchBytes;
  void prefetch_row(int64_t offset, int bytes) const {
    int64_t at = offset + ahead;
    if (at >= codes) at += meta;
    for (int off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(b + at + off), _MM_HINT_T0);
  }
  // The next block's metadata.
  const uint8_t* next_meta() const { return b + 2 * codes + meta; }
};

// The metadata a group's end reads lies off the stream: it is prefetched into L1 a group ahead (the next block's
// first group at the last group).
inline void prefetch_meta(const void* p, int bytes) {
  for (int off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(p) + off, _MM_HINT_T0);
}

template <int R>
void store_rows(float (&ys)[R][64], simd::f32x16 (&y)[R][4]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) y[r][c] = simd::load_f32(ys[r] + 16 * c);
}

inline __m256i load_i32x8(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store_i32x8(int32_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

template <int R>
struct Int8Dot {
  static constexpr int V = int8_vectors(R);
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const uint8_t* b = static_cast<const uint8_t*>(t.b);
    const float* scale = reinterpret_cast<const float*>(b + 64 * t.k);
    const CodeStream stream{b, 64 * t.k, kInt8MetaBytes};
    const __m256i ones = _mm256_set1_epi16(1);
    const int32_t* a[R];
    for (int r = 0; r < R; ++r) a[r] = static_cast<const int32_t*>(t.a_rows[r]);
    int32_t dots[R][64];  // the exact dot products so far
    prefetch_meta(scale, 256);
    prefetch_meta(stream.next_meta(), 256);
    for (int64_t k0 = 0; k0 < t.k; k0 += kChunkK) {
      const int64_t k1 = std::min(k0 + kChunkK, t.k);
      for (int v0 = 0; v0 < 8; v0 += V) {
        __m256i acc[R][V];
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < V; ++v) acc[r][v] = k0 == 0 ? _mm256_setzero_si256() : load_i32x8(dots[r] + 8 * (v0 + v));
        for (int64_t q = k0 / 4; q < k1 / 4; ++q) {
          const uint8_t* bq = b + 256 * q + 32 * v0;
          if (v0 == 0) stream.prefetch_row(256 * q, 256);
          for (int v = 0; v < V; ++v) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bq + 32 * v));
            const __m256i w_abs = _mm256_abs_epi8(w);
            for (int r = 0; r < R; ++r) {
              const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(a[r][q]), w);
              acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x), ones));
            }
          }
        }
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < V; ++v) store_i32x8(dots[r] + 8 * (v0 + v), acc[r][v]);
      }
    }
    float ys[R][64];
    for (int r = 0; r < R; ++r) {
      const __m256 sa = _mm256_set1_ps(qx86::a8_scale(a[r], t.k));
      for (int n = 0; n < 64; n += 8) {
        const __m256 yw = _mm256_mul_ps(_mm256_cvtepi32_ps(load_i32x8(dots[r] + n)), _mm256_loadu_ps(scale + n));
        _mm256_storeu_ps(ys[r] + n, _mm256_mul_ps(yw, sa));
      }
    }
    store_rows<R>(ys, y);
  }
};

// acc[r][v] += the products of R rows' activations with the 4-bit codes of k-octets [s0, s0 + N), columns
// 8 (v0 + v) .. + 7 (quant.h's nibble order), each code turned into VPMADDUBSW's unsigned operand by `operand`
// (int4: the code itself; mxfp4: a table). The products add in int16 over the N octets, so 2N x the largest
// pair must stay below 32768, then widen to int32 once.
template <int R, int V, int N, class Operand>
inline void add_nibble_octets(const CodeStream& stream, int64_t s0, int v0, const int32_t* const (&a)[R],
                              __m256i (&acc)[R][V], Operand operand) {
  const uint8_t* b = stream.b;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256i part[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) part[r][v] = _mm256_setzero_si256();
  for (int64_t s = s0; s < s0 + N; ++s) {
    const uint8_t* bs = b + 256 * s + 32 * v0;
    if (v0 == 0) stream.prefetch_row(256 * s, 256);
    for (int v = 0; v < V; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + 32 * v));
      const __m256i lo = operand(_mm256_and_si256(raw, low4));
      const __m256i hi = operand(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4));
      for (int r = 0; r < R; ++r) {
        part[r][v] = _mm256_add_epi16(part[r][v], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a[r][2 * s])));
        part[r][v] = _mm256_add_epi16(part[r][v], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a[r][2 * s + 1])));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(part[r][v], ones));
}

template <int R>
struct Int4Dot {
  static constexpr int V = int4_vectors(R);
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const uint8_t* b = static_cast<const uint8_t*>(t.b);
    const int64_t Kp = t.k, g = t.group;
    const float* meta = reinterpret_cast<const float*>(b + 32 * Kp);  // per group: scale[64] (, zero[64])
    const int64_t stride = int4_group_floats(t.symmetric);             // floats of a group's metadata
    const CodeStream stream{b, 32 * Kp, 4 * stride * (Kp / g)};
    const qx86::A8Rows<R> rows(t);
    const auto& a = rows.a;
    const auto& sums = rows.sums;
    float ys[R][64] = {};
    int32_t held[R][64];  // a group's int32 sums between its chunks
    prefetch_meta(meta, int(4 * stride));
    for (int64_t k0 = 0; k0 < Kp; k0 += g) {
      prefetch_meta(k0 + g < Kp ? static_cast<const void*>(meta + stride * (k0 / g + 1)) : stream.next_meta(),
                    int(4 * stride));
      for (int64_t c0 = k0; c0 < k0 + g; c0 += kChunkK) {
        const int64_t c1 = std::min(c0 + kChunkK, k0 + g);
        for (int v0 = 0; v0 < 8; v0 += V) {
          __m256i acc[R][V];
          for (int r = 0; r < R; ++r)
            for (int v = 0; v < V; ++v) acc[r][v] = c0 == k0 ? _mm256_setzero_si256() : load_i32x8(held[r] + 8 * (v0 + v));
          for (int64_t k32 = c0; k32 < c1; k32 += 32)  // int16 sums of 4 octets: at most 8 x 3810
            add_nibble_octets<R, V, 4>(stream, k32 / 8, v0, a, acc, [](__m256i code) { return code; });
          if (c1 < k0 + g) {
            for (int r = 0; r < R; ++r)
              for (int v = 0; v < V; ++v) store_i32x8(held[r] + 8 * (v0 + v), acc[r][v]);
            continue;
          }
          const float* scale = meta + stride * (k0 / g);
          const float* sw = scale + 8 * v0;
          const float* zero = int4_zeros(scale, t.symmetric) + 8 * v0;
          for (int r = 0; r < R; ++r) {
            const __m256 sum_a = _mm256_set1_ps(float(qx86::a8_sum(sums[r], k0, k0 + g)));
            for (int v = 0; v < V; ++v) {  // unfused, in quant_generic's order (see the header)
              float* tot = ys[r] + 8 * (v0 + v);
              const __m256 d = _mm256_sub_ps(_mm256_cvtepi32_ps(acc[r][v]),
                                             _mm256_mul_ps(_mm256_loadu_ps(zero + 8 * v), sum_a));
              _mm256_storeu_ps(tot, _mm256_add_ps(_mm256_loadu_ps(tot), _mm256_mul_ps(_mm256_loadu_ps(sw + 8 * v), d)));
            }
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 sa = _mm256_set1_ps(qx86::a8_scale(a[r], Kp));
      for (int n = 0; n < 64; n += 8) _mm256_storeu_ps(ys[r] + n, _mm256_mul_ps(_mm256_loadu_ps(ys[r] + n), sa));
    }
    store_rows<R>(ys, y);
  }
};

// ---- fp8: FMA in f32 over weights widened in registers, activations widened once per call ----

// The rows' bf16 activations as f32 times lift[r] (a power of two), in this thread's scratch.
template <int R>
void widen_rows(const GemmTile& t, const float (&lift)[R], const float* (&a)[R]) {
  thread_local std::vector<float> rows;
  if (rows.size() < size_t(R * t.k)) rows.resize(R * t.k);
  for (int r = 0; r < R; ++r) {
    float* dst = rows.data() + r * t.k;
    const uint16_t* src = static_cast<const uint16_t*>(t.a_rows[r]);
    const __m256 by = _mm256_set1_ps(lift[r]);
    for (int64_t k = 0; k < t.k; k += 8) {
      const __m128i bf16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
      const __m256 f32 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16));
      _mm256_storeu_ps(dst + k, _mm256_mul_ps(f32, by));
    }
    a[r] = dst;
  }
}

// What an fp8 tile keeps over a call: its rows widened to f32, its outputs, and a k-chunk's sums held between
// the chunk's parts (a chunk wider than kChunkK).
template <int R>
struct Fp8Rows {
  const float* a[R];
  float ys[R][64] = {};
  float held[R][8][2][8];
  Fp8Rows(const GemmTile& t, const float (&lift)[R]) { widen_rows<R>(t, lift, a); }
};

// The power of two Fp8Dot scales a bf16 row by: the row's largest |a| goes to [2^62, 2^63) (2^127 at most), so
// a product with a weight's f32 (the e4m3 value x 2^-120, at most 448 x 2^-120) stays below 2^-48, and only terms
// below 2^-78 of the largest one could reach the f32 subnormals. Infinities and NaNs are scaled by 2^-66 and stay
// what they are.
inline int fp8_lift_exponent(const void* row, int64_t k) {
  const uint16_t* src = static_cast<const uint16_t*>(row);
  __m256i top = _mm256_setzero_si256();  // the largest |a| bits, lane by lane
  for (int64_t i = 0; i < k; i += 16)
    top = _mm256_max_epu16(top, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)),
                                                  _mm256_set1_epi16(0x7FFF)));
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), top);
  const int biased = *std::max_element(lanes, lanes + 16) >> 7;  // 2^(biased - 127) <= max |a| < 2^(biased - 126)
  return std::min(189 - biased, 127);
}

// The weights' f32s are subnormal for e4m3 subnormals, which MXCSR's denormals-are-zero bit would read as 0: clear it
// for the tile and put it back.
struct SubnormalsKept {
  const unsigned csr = _mm_getcsr();
  SubnormalsKept() {
    if (csr & 0x40) _mm_setcsr(csr & ~0x40u);
  }
  ~SubnormalsKept() {
    if (csr & 0x40) _mm_setcsr(csr);
  }
};

// fp8 at 1-2 rows: no float conversion instruction. In a 16-bit lane, the byte in the high half shifted right by 4
// (arithmetic) and masked to s 0000 eeee mmm 0000 is the bf16 of its e4m3 value x 2^-120 (subnormals included, as
// bf16 subnormals), so a 32-bit mask takes the high lane's as an f32 and a shift of 16 the low lane's. The low byte
// gets there as 16 x itself, signed, by VPMADDUBSW, which runs beside the shifts. A dword of the block is 2 columns
// x a k-pair, so 32 bytes give 4 f32 vectors: 16 columns' even and odd halves at k and k + 1, which the even and
// odd accumulators of the 16 take in turn: 3 shifts, a VPMADDUBSW, 4 ands and 4 FMAs where the fp16 route spends
// 4 unpacks, 4 shifts, 4 ands and 4 VCVTPH2PS (one Zen 3 thread, weights in L1: 24-25 GB/s against 12; 20-21
// with a fourth and fifth shift in place of the VPMADDUBSW). The activations are scaled up when widened
// (fp8_lift_exponent), so products of small weights and activations stay clear of the f32 subnormals, and each
// chunk's end scales back.
template <int R>
struct Fp8Dot {
  static constexpr int W = R == 1 ? 4 : R == 2 ? 2 : 1;  // 16-column vectors per pass: 2W accumulators a row
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const SubnormalsKept kept;
    const uint8_t* b = static_cast<const uint8_t*>(t.b);
    const float* scales = reinterpret_cast<const float*>(b + 64 * t.k);
    const int64_t chunks = (t.k + t.group - 1) / t.group;
    const CodeStream stream{b, 64 * t.k, fp8_meta_bytes(t.k, t.group), kFp8PrefetchBytes};
    const __m256i mask = _mm256_set1_epi32(int32_t(0x87F00000u));
    const __m256i times16 = _mm256_set1_epi16(0x0010);  // u8 16 at each low byte, 0 at each high one
    float lift[R], unlift[R][2];  // 2^S; 2^(120 - S) in two factors, each a normal f32
    for (int r = 0; r < R; ++r) {
      const int S = fp8_lift_exponent(t.a_rows[r], t.k), half = (120 - S) / 2;
      lift[r] = std::ldexp(1.0f, S);
      unlift[r][0] = std::ldexp(1.0f, half);
      unlift[r][1] = std::ldexp(1.0f, 120 - S - half);
    }
    Fp8Rows<R> rows(t, lift);
    prefetch_meta(scales, 256);
    for (int64_t k0 = 0, chunk = 0; k0 < t.k; k0 += t.group, ++chunk) {
      const int64_t k1 = std::min(k0 + t.group, t.k);
      prefetch_meta(chunk + 1 < chunks ? static_cast<const void*>(scales + 64 * (chunk + 1)) : stream.next_meta(), 256);
      for (int64_t c0 = k0; c0 < k1; c0 += kChunkK) {
        const int64_t c1 = std::min(c0 + kChunkK, k1);
        for (int w0 = 0; w0 < 4; w0 += W) {
          __m256 even[R][W], odd[R][W];  // columns 16 (w0 + w) + 0, 2, .., 14 and 1, 3, .., 15 (by 128-bit lane)
          for (int r = 0; r < R; ++r)
            for (int w = 0; w < W; ++w) {
              even[r][w] = c0 == k0 ? _mm256_setzero_ps() : _mm256_loadu_ps(rows.held[r][w0 + w][0]);
              odd[r][w] = c0 == k0 ? _mm256_setzero_ps() : _mm256_loadu_ps(rows.held[r][w0 + w][1]);
            }
          for (int64_t p = c0 / 2; p < c1 / 2; ++p) {
            const uint8_t* bp = b + 128 * p + 32 * w0;
            if (w0 == 0) stream.prefetch_row(128 * p, 128);
            __m256 x0[R], x1[R];
            for (int r = 0; r < R; ++r) {
              x0[r] = _mm256_broadcast_ss(rows.a[r] + 2 * p);
              x1[r] = _mm256_broadcast_ss(rows.a[r] + 2 * p + 1);
            }
            for (int w = 0; w < W; ++w) {
              const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 32 * w));
              const __m256i high = _mm256_srai_epi16(raw, 4);                         // k + 1
              const __m256i low = _mm256_maddubs_epi16(times16, raw);                // k
              const __m256 even_k = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(low, 16), mask));
              const __m256 even_k1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(high, 16), mask));
              const __m256 odd_k = _mm256_castsi256_ps(_mm256_and_si256(low, mask));
              const __m256 odd_k1 = _mm256_castsi256_ps(_mm256_and_si256(high, mask));
              for (int r = 0; r < R; ++r) {
                even[r][w] = _mm256_fmadd_ps(even_k, x0[r], even[r][w]);
                odd[r][w] = _mm256_fmadd_ps(odd_k, x0[r], odd[r][w]);
                even[r][w] = _mm256_fmadd_ps(even_k1, x1[r], even[r][w]);
                odd[r][w] = _mm256_fmadd_ps(odd_k1, x1[r], odd[r][w]);
              }
            }
          }
          if (c1 < k1) {
            for (int r = 0; r < R; ++r)
              for (int w = 0; w < W; ++w) {
                _mm256_storeu_ps(rows.held[r][w0 + w][0], even[r][w]);
                _mm256_storeu_ps(rows.held[r][w0 + w][1], odd[r][w]);
              }
            continue;
          }
          for (int w = 0; w < W; ++w) {
            const int n = 16 * (w0 + w);
            const __m256 s0 = _mm256_loadu_ps(scales + 64 * chunk + n);
            const __m256 s8 = _mm256_loadu_ps(scales + 64 * chunk + n + 8);
            for (int r = 0; r < R; ++r) {
              const __m256 lo = _mm256_unpacklo_ps(even[r][w], odd[r][w]);
              const __m256 hi = _mm256_unpackhi_ps(even[r][w], odd[r][w]);
              const __m256 u0 = _mm256_set1_ps(unlift[r][0]), u1 = _mm256_set1_ps(unlift[r][1]);
              const __m256 sum0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x20), u0), u1);  // 0..7
              const __m256 sum8 = _mm256_mul_ps(_mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x31), u0), u1);  // 8..15
              float* out = rows.ys[r] + n;
              _mm256_storeu_ps(out, _mm256_fmadd_ps(sum0, s0, _mm256_loadu_ps(out)));
              _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(sum8, s8, _mm256_loadu_ps(out + 8)));
            }
          }
        }
      }
    }
    store_rows<R>(rows.ys, y);
  }
};

// ---- fp8 prefill: the block widened once per call ----

// From this many rows a call widens its block once and runs Fp8WidenedDot over it; fewer rows widen in registers.
constexpr int kFp8ScratchRows = 3;

// The block as Fp8Dot widens it in registers, written out: the fp16 of each e4m3 value x 2^-8 in the block's own
// [Kp/2][64][2] order (256 bytes a k-pair), then the f32 scales x 256, [ceil(Kp/g)][64].
const void* widen_fp8(const GemmTile& t) {
  const uint8_t* b = static_cast<const uint8_t*>(t.b);
  const int64_t codes = 64 * t.k, chunks = (t.k + t.group - 1) / t.group;
  uint8_t* dst = qx86::scratch(2 * codes + 256 * chunks);
  const __m128i zero = _mm_setzero_si128(), clear14 = _mm_set1_epi16(int16_t(0xBFFF));
  for (int64_t i = 0; i < codes; i += 16) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i));
    __m128i* out = reinterpret_cast<__m128i*>(dst + 2 * i);
    _mm_store_si128(out, _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(zero, raw), 1), clear14));
    _mm_store_si128(out + 1, _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(zero, raw), 1), clear14));
  }
  const float* scales = reinterpret_cast<const float*>(b + codes);
  float* wide_scales = reinterpret_cast<float*>(dst + 2 * codes);
  const __m256 unscale = _mm256_set1_ps(256.0f);
  for (int64_t n = 0; n < 64 * chunks; n += 8)
    _mm256_store_ps(wide_scales + n, _mm256_mul_ps(_mm256_loadu_ps(scales + n), unscale));
  return dst;
}

// Fp8Dot's sums over the widened block, 6 rows x 8 columns a pass (12 accumulators, 2 weight vectors and a
// broadcast: 15 ymm), as the dense AVX2 tile: one VCVTPH2PS per 4 columns x a k-pair, and each weight vector
// serves 6 rows.
template <int R>
struct Fp8WidenedDot {
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const uint8_t* b = static_cast<const uint8_t*>(t.b);
    const float* scales = reinterpret_cast<const float*>(b + 128 * t.k);
    float unit[R];
    std::fill(unit, unit + R, 1.0f);
    Fp8Rows<R> rows(t, unit);
    for (int64_t k0 = 0, chunk = 0; k0 < t.k; k0 += t.group, ++chunk) {
      const int64_t k1 = std::min(k0 + t.group, t.k);
      for (int64_t c0 = k0; c0 < k1; c0 += kChunkK) {
        const int64_t c1 = std::min(c0 + kChunkK, k1);
        for (int v = 0; v < 8; ++v) {
          __m256 acc[R][2];
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h)
              acc[r][h] = c0 == k0 ? _mm256_setzero_ps() : _mm256_loadu_ps(rows.held[r][v][h]);
          for (int64_t p = c0 / 2; p < c1 / 2; ++p) {
            const __m128i* bp = reinterpret_cast<const __m128i*>(b + 256 * p + 32 * v);
            const __m256 lo = _mm256_cvtph_ps(_mm_load_si128(bp)), hi = _mm256_cvtph_ps(_mm_load_si128(bp + 1));
            for (int r = 0; r < R; ++r) {
              const __m256 x =
                  _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(rows.a[r] + 2 * p)));
              acc[r][0] = _mm256_fmadd_ps(lo, x, acc[r][0]);  // columns 0..3 of the 8, k and k + 1
              acc[r][1] = _mm256_fmadd_ps(hi, x, acc[r][1]);  // columns 4..7
            }
          }
          if (c1 < k1) {
            for (int r = 0; r < R; ++r)
              for (int h = 0; h < 2; ++h) _mm256_storeu_ps(rows.held[r][v][h], acc[r][h]);
            continue;
          }
          const __m256 s = _mm256_load_ps(scales + 64 * chunk + 8 * v);
          for (int r = 0; r < R; ++r) {
            const __m256 sum = _mm256_castpd_ps(_mm256_permute4x64_pd(
                _mm256_castps_pd(_mm256_hadd_ps(acc[r][0], acc[r][1])), 0xD8));  // columns 0..7
            _mm256_storeu_ps(rows.ys[r] + 8 * v, _mm256_fmadd_ps(sum, s, _mm256_loadu_ps(rows.ys[r] + 8 * v)));
          }
        }
      }
    }
    store_rows<R>(rows.ys, y);
  }
};

struct Fp8Tiles {
  using Direct = qx86::Tiles<Fp8Dot, DType::kBFloat16, 4>;
  using Widened = qx86::Tiles<Fp8WidenedDot, DType::kBFloat16, 6>;
  static void w13(const GemmTile& t) {
    if (t.rows < kFp8ScratchRows) return Direct::w13(t);
    GemmTile wide = t;
    wide.b = widen_fp8(t);
    Widened::w13_by(wide, Widened::even_rows(t));
  }
  static void w2(const GemmTile& t) {
    if (t.rows < kFp8ScratchRows) return Direct::w2(t);
    GemmTile wide = t;
    wide.b = widen_fp8(t);
    Widened::w2_by(wide, Widened::even_rows(t));
  }
};

// mxfp4: int4's loop with a table: VPSHUFB maps each code to kMxfp4Twice + 12 (0..24), the unsigned operand;
// a pair is then up to 2 * 24 * 127 = 6096, so the int16 sums widen every 2 k-octets (4 pairs). Each 32-k
// group's int32 sums start at -12 x the group's activation sum and end at the signed dot exactly.
template <int R>
struct Mxfp4Dot {
  static constexpr int V = int4_vectors(R);
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const uint8_t* b = static_cast<const uint8_t*>(t.b);
    const int64_t Kp = t.k;
    const uint8_t* exps = b + 32 * Kp;  // [Kp/32][64]
    const CodeStream stream{b, 32 * Kp, 2 * Kp};
    alignas(16) int8_t table[16];
    for (int q = 0; q < 16; ++q) table[q] = int8_t(kMxfp4Twice[q] + kMxfp4Offset);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
    const qx86::A8Rows<R> rows(t);
    const auto& a = rows.a;
    const auto& sums = rows.sums;
    float ys[R][64] = {};
    const int chunk_meta = int(64 * (kChunkK / kMxfp4Group));  // a chunk's exponents
    prefetch_meta(exps, chunk_meta);
    for (int64_t c0 = 0; c0 < Kp; c0 += kChunkK) {
      const int64_t c1 = std::min(c0 + kChunkK, Kp);
      prefetch_meta(c1 < Kp ? exps + 64 * (c1 / kMxfp4Group) : stream.next_meta(), chunk_meta);
      for (int v0 = 0; v0 < 8; v0 += V) {
        __m256 tot[R][V];
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < V; ++v) tot[r][v] = _mm256_loadu_ps(ys[r] + 8 * (v0 + v));
        for (int64_t G = c0 / kMxfp4Group; G < c1 / kMxfp4Group; ++G) {
          __m256i acc[R][V];
          for (int r = 0; r < R; ++r)
            for (int v = 0; v < V; ++v) acc[r][v] = _mm256_set1_epi32(-kMxfp4Offset * sums[r][G]);
          for (int64_t s0 = 4 * G; s0 < 4 * G + 4; s0 += 2)  // int16 sums of 2 octets: at most 4 x 6096
            add_nibble_octets<R, V, 2>(stream, s0, v0, a, acc,
                                       [lut](__m256i code) { return _mm256_shuffle_epi8(lut, code); });
          for (int v = 0; v < V; ++v) {
            const __m128i e = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(exps + 64 * G + 8 * (v0 + v)));
            const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(e), 23));  // 2^(e - 127)
            for (int r = 0; r < R; ++r)  // scale x acc is exact: one rounding per group, as quant_generic's
              tot[r][v] = _mm256_add_ps(tot[r][v], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(acc[r][v])));
          }
        }
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < V; ++v) _mm256_storeu_ps(ys[r] + 8 * (v0 + v), tot[r][v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 half_sa = _mm256_set1_ps(qx86::a8_scale(a[r], Kp) * 0.5f);
      for (int n = 0; n < 64; n += 8) _mm256_storeu_ps(ys[r] + n, _mm256_mul_ps(_mm256_loadu_ps(ys[r] + n), half_sa));
    }
    store_rows<R>(ys, y);
  }
};

using Int8Tiles = qx86::Tiles<Int8Dot, DType::kFloat32, 4>;
using Int4Tiles = qx86::Tiles<Int4Dot, DType::kFloat32, 4>;
using Mxfp4Tiles = qx86::Tiles<Mxfp4Dot, DType::kFloat32, 4>;

}  // namespace

const QuantKernel* quant_x86_avx2(QuantFormat f) {
  static const QuantKernel int8{4, false, Int8Tiles::w13, Int8Tiles::w2, write_quantized_row};
  static const QuantKernel int4{4, false, Int4Tiles::w13, Int4Tiles::w2, write_quantized_row};
  static const QuantKernel fp8{6, false, Fp8Tiles::w13, Fp8Tiles::w2};
  static const QuantKernel mxfp4{4, false, Mxfp4Tiles::w13, Mxfp4Tiles::w2, write_quantized_row};
  switch (f) {
    case QuantFormat::kInt8W8A8: return &int8;
    case QuantFormat::kInt4W4A16: return &int4;
    case QuantFormat::kFp8W8A16: return &fp8;
    default: return &mxfp4;
  }
}

}  // namespace cpumoe
