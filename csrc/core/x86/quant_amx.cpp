// x86 AMX INT8: int8_w8a8 tiles with TDPBUSD (u8 x s8 -> int32, four products a lane, like VPDPBUSD) over the blocks
// every backend packs ([Kp/4][64][4] int8, then scale[64] and colsum[64]): a B tile is 16 k-quads x 16 columns,
// read in place with the block's 256-byte quad stride. The A8 rows are the VNNI unit's (u = a + 128), an A tile 16
// of them x 64 k: in place when evenly spaced (the fused driver sorts w13's rows for it, KernelTable::sorted_rows'
// twin), else copied together. The int32 sums are exact, and the rescale repeats quant_avx512vnni's float operations
// in its order (the file builds with -ffp-contract=off), so the results are bit for bit those of the VNNI tiles and
// of quant_generic.
// Calls of fewer than kMinRows rows (decode) run on the VNNI unit's register tiles, which stream the block.
// Below them: int4_w4a16 as W4A8 with TDPBSUD over its widened nibbles (the same bits again), mxfp4_w4a16's W4A8
// products on x86-amx's bf16 tiles over a block widened to exact bf16 values (float32 sums; TDPBSSD a 32-k group at a
// time, the same bits, where an exponent leaves bf16's range), and fp8_w8a16's prefill on the bf16 tiles too.
#include <algorithm>
#include <cstring>
#include <vector>

#include "../quant_row.h"
#include "amx_tiles.h"
#include "kernels_amx.h"
#include "kernels_avx512bf16.h"
#include "quant_tiles.h"

namespace cpumoe {
namespace {

using amx::kTileRows;
constexpr int kMinRows = 4;        // as x86-amx's bf16 tiles
// Fewest rows for the formats whose call widens its block first (int4, mxfp4): below a whole tile the widening
// costs more than the tiles save (qwen3-30b-a3b's layer at M = 128, ~8 rows an expert: mxfp4 34.9 ms from 4 rows,
// 28.6 from 16, 28.1 on the VNNI unit alone; int4 29.1, 26.6, 25.5; at M = 512 16 rows were as fast as 4).
constexpr int kWidenedMinRows = 16;
constexpr int64_t kStepK = 64;     // k per A/B tile: 16 quads
constexpr int64_t kQuadBytes = 256;  // one k-quad of a block: 64 columns x 4 int8

inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

// int8_w8a8 over a call's rows, 16 at a time (amx::pipelined_row_tiles: the AMX unit sums a tile while the vector
// units rescale the one before). The call's first tile reads the block from memory and prefetches it
// (amx::prefetch_ahead); the later ones find it in L2 and fetch the next call's (amx::NextBlockFetch).
struct AmxInt8Rows {
  const GemmTile& t;
  const uint8_t* b;
  int64_t whole;  // k in whole AMX k-steps

  explicit AmxInt8Rows(const GemmTile& t) : t(t), b(static_cast<const uint8_t*>(t.b)), whole(t.k / kStepK * kStepK) {}

  template <class AfterStep>
  void products(int first, int n, AfterStep after_step) const {
    int64_t stride;
    const uint8_t* a = reinterpret_cast<const uint8_t*>(amx::tile_rows(t.a_rows + first, n, t.k, &stride));
    const auto next = amx::NextBlockFetch::for_tile(t, first, whole / kStepK);
    amx::zero_accumulators();
    for (int64_t k = 0; k < whole; k += kStepK) {
      if (first == 0) amx::prefetch_ahead(b + (k / 4) * kQuadBytes, 16 * kQuadBytes);
      next.step(k / kStepK);
      CPUMOE_AMX_K_STEP(_tile_dpbusd, a + k, stride, b + (k / 4) * kQuadBytes);
      after_step(k / kStepK, whole / kStepK);
    }
  }

  // Rows first + [r0, r1) from their tile's stored sums: the quads past the last whole k-step, quant_avx512vnni's
  // Int8Dot rescale operation for operation, then the epilogue.
  template <bool W13>
  void finish(int first, int r0, int r1, int32_t* acc) const {
    for (int r = r0; r < r1; ++r) {  // Kp is a multiple of 32, not of 64
      const int32_t* ar = static_cast<const int32_t*>(t.a_rows[first + r]);
      for (int64_t q = whole / 4; q < t.k / 4; ++q) {
        const __m512i x = _mm512_set1_epi32(ar[q]);
        for (int c = 0; c < 4; ++c) {
          const __m512i w = _mm512_loadu_si512(b + q * kQuadBytes + 64 * c);
          _mm512_store_si512(acc + 64 * r + 16 * c, dpbusd(_mm512_load_si512(acc + 64 * r + 16 * c), x, w));
        }
      }
    }
    const float* scale = reinterpret_cast<const float*>(b + 64 * t.k);
    const int32_t* colsum = reinterpret_cast<const int32_t*>(scale + 64);
    __m512 sw[4];
    __m512i offset[4];
    for (int c = 0; c < 4; ++c) {
      sw[c] = _mm512_loadu_ps(scale + 16 * c);
      offset[c] = _mm512_slli_epi32(_mm512_loadu_si512(colsum + 16 * c), 7);  // 128 * colsum
    }
    for (int r = r0; r < r1; ++r) {
      const __m512 sa = _mm512_set1_ps(qx86::a8_scale(t.a_rows[first + r], t.k));
      simd::f32x16 y[4];
      for (int c = 0; c < 4; ++c) {
        const __m512i sums = _mm512_load_si512(acc + 64 * r + 16 * c);
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums, offset[c])), sw[c]);
        y[c] = (simd::f32x16)_mm512_mul_ps(v, sa);
      }
      if constexpr (W13) simd::w13_epilogue<DType::kFloat32>(t, first + r, y[0], y[1], y[2], y[3]);
      else simd::w2_epilogue(t, first + r, y);
    }
  }

  template <bool W13>
  void run() const {
    amx::pipelined_row_tiles<int32_t>(
        t.rows, [&](int first, int n, auto after_step) { products(first, n, after_step); },
        [&](int first, int r0, int r1, int32_t* acc) { finish<W13>(first, r0, r1, acc); });
  }
};

// The 4-bit codes of a block in int4_w4a16's nibble order (quant.h) as bytes in the int8 quad layout, each 64 of them
// through map (codes 0..15 in, the bytes to store out): k-octet s's low nibbles become quad 2s, its high ones 2s + 1.
// k-octets [s0, s1).
template <class Map>
void widen_nibbles(const uint8_t* b, int64_t s0, int64_t s1, uint8_t* dst, Map map) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t s = s0; s < s1; ++s)
    for (int c = 0; c < 4; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(b) + qx86::kWidenAheadBytes + 256 * s + 64 * c, _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(b + 256 * s + 64 * c);
      _mm512_store_si512(dst + 512 * s + 64 * c, map(_mm512_and_si512(raw, low4)));
      _mm512_store_si512(dst + 512 * s + 256 + 64 * c, map(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4)));
    }
}

// A block widened as its call's first row tile runs: int4_tile starts it (metadata copied, no codes yet), and that
// tile's AmxInt4Dot widens a group ahead of its tile products, so the vector units read the codes from memory while
// the AMX unit sums (widened in a pass of their own before the tiles, the codes' read left the AMX unit idle: 12% of
// int4's samples at M = 2048; this way, calls alternated in one process, qwen3-30b-a3b's layer took 0.96x the time at
// M = 2048 and 0.985x at M = 512). The later row tiles find the block whole.
struct Int4Widening {
  const uint8_t* codes = nullptr;  // the packed block; null once widened
  uint8_t* dst = nullptr;
  int64_t k = 0, widened = 0;  // k widened so far
  bool symmetric = false;

  void through(int64_t k_end) {  // widens k up to k_end
    if (!codes || k_end <= widened) return;
    k_end = std::min(k_end, k);
    if (symmetric) {
      const __m512i eight = _mm512_set1_epi8(8);
      widen_nibbles(codes, widened / 8, k_end / 8, dst, [&](__m512i c) { return _mm512_sub_epi8(c, eight); });
    } else {
      widen_nibbles(codes, widened / 8, k_end / 8, dst, [](__m512i c) { return c; });
    }
    widened = k_end;
    if (widened == k) codes = nullptr;
  }
};
thread_local Int4Widening int4_widening;

// int4_w4a16 as W4A8, as the VNNI unit computes it: the block's nibbles widened once per call into the int8 quad
// layout (codes 0..15 as u8: k-octet s's low nibbles are quad 2s, its high ones quad 2s + 1), its group metadata
// copied behind them; then TDPBSUD (signed activations x unsigned codes), one group of g k at a time, and the VNNI
// unit's per-group float operations in its order: tot += scale * (sum - zero * sum_g(a)), y = tot * a's scale.
// Symmetric weights (zero 8) widen to q - 8 instead and take TDPBSSD: the int32 sums are then sum - 8 * sum_g(a),
// which the float subtraction gives exactly too (integers below 2^24), so the bits stay and the group's rescale
// loses its subtraction and the activation sums.
const void* start_int4_widening(const GemmTile& t) {
  const uint8_t* b = static_cast<const uint8_t*>(t.b);
  const int64_t meta_bytes = 4 * int4_group_floats(t.symmetric) * (t.k / t.group);
  uint8_t* dst = qx86::scratch(64 * t.k + meta_bytes);
  std::memcpy(dst + 64 * t.k, b + 32 * t.k, meta_bytes);
  int4_widening = Int4Widening{b, dst, t.k, 0, t.symmetric};
  return dst;
}

template <int R>
struct AmxInt4Dot {  // over start_int4_widening's block
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const uint8_t* b = static_cast<const uint8_t*>(t.b);
    const int64_t Kp = t.k, g = t.group, stride_meta = int4_group_floats(t.symmetric);
    const float* meta = reinterpret_cast<const float*>(b + 64 * Kp);
    int64_t stride;
    const uint8_t* a = reinterpret_cast<const uint8_t*>(amx::tile_rows(t.a_rows, R, t.k, &stride));
    const qx86::A8Rows<R> rows(t);
    __m512 tot[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) tot[r][c] = _mm512_setzero_ps();
    // Group G + 1's tile products are issued before group G's rescale, so the AMX unit sums one group while the
    // vector units rescale the one before (and a group's sums are read well after their tile stores).
    alignas(64) int32_t acc[2][kTileRows * 64];
    const auto products = [&](int64_t k0) {
      amx::zero_accumulators();
      if (t.symmetric) {
        for (int64_t k = k0; k < k0 + g; k += kStepK)
          CPUMOE_AMX_K_STEP(_tile_dpbssd, a + k, stride, b + (k / 4) * kQuadBytes);
      } else {
        for (int64_t k = k0; k < k0 + g; k += kStepK)
          CPUMOE_AMX_K_STEP(_tile_dpbsud, a + k, stride, b + (k / 4) * kQuadBytes);
      }
    };
    int4_widening.through(2 * g);
    products(0);
    for (int64_t k0 = 0; k0 < Kp; k0 += g) {
      const int32_t* sums_g = acc[(k0 / g) & 1];
      amx::store_accumulators(acc[(k0 / g) & 1]);
      if (k0 + g < Kp) products(k0 + g);
      int4_widening.through(k0 + 3 * g);  // the group after, while the AMX unit sums this one
      const float* scale = meta + stride_meta * (k0 / g);
      if (t.symmetric) {  // the sums are sum - 8 * sum_g(a) already, in integers: the float operations' exact result
        for (int c = 0; c < 4; ++c) {
          const __m512 sw = _mm512_loadu_ps(scale + 16 * c);
          for (int r = 0; r < R; ++r) {
            const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(sums_g + 64 * r + 16 * c));
            tot[r][c] = _mm512_add_ps(tot[r][c], _mm512_mul_ps(sw, v));
          }
        }
        continue;
      }
      const float* zeros = int4_zeros(scale, t.symmetric);
      __m512 sum_a[R];
      for (int r = 0; r < R; ++r) sum_a[r] = _mm512_set1_ps(float(qx86::a8_sum(rows.sums[r], k0, k0 + g)));
      for (int c = 0; c < 4; ++c) {
        const __m512 sw = _mm512_loadu_ps(scale + 16 * c), zero = _mm512_loadu_ps(zeros + 16 * c);
        for (int r = 0; r < R; ++r) {  // unfused, in quant_generic's order
          const __m512 sums = _mm512_cvtepi32_ps(_mm512_load_si512(sums_g + 64 * r + 16 * c));
          const __m512 v = _mm512_sub_ps(sums, _mm512_mul_ps(zero, sum_a[r]));
          tot[r][c] = _mm512_add_ps(tot[r][c], _mm512_mul_ps(sw, v));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sa = _mm512_set1_ps(qx86::a8_scale(rows.a[r], Kp));
      for (int c = 0; c < 4; ++c) y[r][c] = (simd::f32x16)_mm512_mul_ps(tot[r][c], sa);
    }
  }
};

// mxfp4_w4a16 as W4A8 (quant.h): the codes widened once per call through kMxfp4Twice into the int8 quad layout
// (signed, -12..12; int4's nibble order, so widen_nibbles), the e8m0 exponents copied behind them; then
// TDPBSSD (signed x signed) a 32-k group at a time, with tiles configured for 32 bytes of k (an A row of 32, B
// tiles of 8 quads): a group is half an AMX k-step. Each group's exact int32 sums are rescaled as the VNNI unit
// does, tot += 2^(e - 127) x sum in group order, so the bits are the VNNI tiles'.
// A TDPBSSD over 32 k took as long as one over 64 (int8's), so this runs at about the bf16 tiles' multiply-adds a
// second, less the rescale: qwen3-30b-a3b's layer at M = 2048 in 202 ms against bf16's 162 (the VNNI unit: 265).
// Without the rescale it took 172-175 ms; software-pipelining the tile products of a batch ahead of the previous
// batch's rescale did not help (208-212 ms).
constexpr int64_t kMxfp4StepK = kMxfp4Group;

const void* widen_mxfp4(const GemmTile& t) {
  const uint8_t* b = static_cast<const uint8_t*>(t.b);
  uint8_t* dst = qx86::scratch(64 * t.k + 2 * t.k);
  alignas(16) int8_t table[16];
  for (int q = 0; q < 16; ++q) table[q] = kMxfp4Twice[q];
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(table)));
  widen_nibbles(b, 0, t.k / 8, dst, [&](__m512i codes) { return _mm512_shuffle_epi8(lut, codes); });
  std::memcpy(dst + 64 * t.k, b + 32 * t.k, 2 * t.k);
  return dst;
}

template <int R>
struct AmxMxfp4Dot {  // over widen_mxfp4's block
  static void run(const GemmTile& t, simd::f32x16 (&y)[R][4]) {
    const uint8_t* b = static_cast<const uint8_t*>(t.b);
    const int64_t groups = t.k / kMxfp4StepK;
    const uint8_t* exps = b + 64 * t.k;  // [groups][64]
    int64_t stride;
    const uint8_t* a = reinterpret_cast<const uint8_t*>(amx::tile_rows(t.a_rows, R, t.k, &stride));
    // The sums of kBatch groups are stored side by side, then each total is read and written once a batch, not
    // once a group (fewer memory operations; the layer took 202 ms either way).
    constexpr int kBatch = 4;
    alignas(64) int32_t acc[kBatch][kTileRows * 64];
    alignas(64) float tot[R * 64];  // set by the first batch
    for (int64_t G0 = 0; G0 < groups; G0 += kBatch) {
      const int n = int(std::min<int64_t>(kBatch, groups - G0));
      for (int j = 0; j < n; ++j) {
        amx::zero_accumulators();
        CPUMOE_AMX_K_STEP(_tile_dpbssd, a + kMxfp4StepK * (G0 + j), stride,
                          b + (kMxfp4StepK / 4) * kQuadBytes * (G0 + j));
        amx::store_accumulators(acc[j]);
      }
      for (int c = 0; c < 4; ++c) {
        __m512 scale[kBatch];
        for (int j = 0; j < n; ++j) {  // 2^(e - 127); e = 0 gives 0
          const __m128i e8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(exps + 64 * (G0 + j) + 16 * c));
          scale[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(e8), 23));
        }
        for (int r = 0; r < R; ++r) {
          // scale x sum is exact (a power of two times an integer below 2^16), so the fused multiply-add rounds
          // once, where the VNNI unit's add does: the same bits.
          __m512 v = G0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(tot + 64 * r + 16 * c);
          for (int j = 0; j < n; ++j)
            v = _mm512_fmadd_ps(scale[j], _mm512_cvtepi32_ps(_mm512_load_si512(acc[j] + 64 * r + 16 * c)), v);
          _mm512_store_ps(tot + 64 * r + 16 * c, v);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 half_sa = _mm512_set1_ps(qx86::a8_scale(t.a_rows[r], t.k) * 0.5f);
      for (int c = 0; c < 4; ++c) y[r][c] = (simd::f32x16)_mm512_mul_ps(_mm512_load_ps(tot + 64 * r + 16 * c), half_sa);
    }
  }
};

using AmxInt4Tiles = qx86::Tiles<AmxInt4Dot, DType::kFloat32, kTileRows>;
using AmxMxfp4Tiles = qx86::Tiles<AmxMxfp4Dot, DType::kFloat32, kTileRows>;

// From kWidenedMinRows rows and for groups of whole AMX k-steps (64 k); the VNNI unit's tiles otherwise.
template <bool W13>
void int4_tile(const GemmTile& t) {
  if (t.rows < kWidenedMinRows || t.group % kStepK != 0) {
    const QuantKernel* vnni = quant_x86_avx512vnni(QuantFormat::kInt4W4A16);
    return W13 ? vnni->w13_tile(t) : vnni->w2_tile(t);
  }
  GemmTile wide = t;
  wide.b = start_int4_widening(t);
  amx::configure_tiles();
  if constexpr (W13) AmxInt4Tiles::w13(wide);
  else AmxInt4Tiles::w2(wide);
  _tile_release();
}

// fp8_w8a16 from kMinRows rows (its other path, the AVX-512 BF16 unit's, is slower: at M = 128 51.7 ms from 4 rows,
// 79.5 from 16): the AVX-512 BF16 unit widens the block to bf16 (as its own prefill does) while the first row tile
// runs, and x86-amx's tiles take it (chunk by chunk of g k, each rescaled in float32). A g that is not a multiple
// of 32 (an AMX k-step) stays on the AVX-512 BF16 unit.
template <bool W13>
void fp8_tile(const GemmTile& t) {
  const QuantKernel* avx512 = quant_x86_avx512bf16(QuantFormat::kFp8W8A16);
  if (t.rows < kMinRows || t.group % 32 != 0) return W13 ? avx512->w13_tile(t) : avx512->w2_tile(t);
  W13 ? amx_fp8_w13_tile(t) : amx_fp8_w2_tile(t);
}

// mxfp4_w4a16's prefill on the bf16 tiles: a call's first row tile widens its block to bf16 values as it goes
// (BlockWidening), kE2m1[q] x 2^(e - 127) (exact: an e2m1 value has two significant bits, and its power of two goes
// into the bf16 exponent), in x86-amx's kPairs order, and the rows bring their A8 codes as bf16 too
// (write_row_bf16_codes); the tiles then sum the same exact products as the W4A8 groups above, in float32, with no
// per-group rescale: only each row's scale, once.
// The TDPBSSD tiles above stay for blocks whose exponents would leave bf16's normal range (1 or past 252).
// qwen3-30b-a3b's layer at M = 2048 took 140-143 ms against the TDPBSSD tiles' 192-202 (bf16: 139-145).
void write_row_bf16_codes(const float* x, int64_t K, int64_t Kp, bool unsigned_activations, uint8_t* dst) {
  write_quantized_row(x, K, Kp, unsigned_activations, dst);  // signed codes: mxfp4's tiles take s8 activations
  const int8_t* q = reinterpret_cast<const int8_t*>(dst);
  uint8_t* out = dst + quant_row_stride(Kp);
  for (int64_t k = 0; k < Kp; k += 32) {
    const auto codes_at = [&](int64_t i) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
    };
    const __m512 lo = codes_at(k), hi = codes_at(k + 16);
    _mm512_storeu_si512(out + 2 * k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// Every exponent of the block 0 (a zero group) or in [2, 252], so that each nonzero value is a normal bf16.
bool mxfp4_exps_fit_bf16(const GemmTile& t) {
  const uint8_t* exps = static_cast<const uint8_t*>(t.b) + 32 * t.k;
  __mmask64 bad = 0;
  for (int64_t i = 0; i < 2 * t.k; i += 64) {
    const __m512i e = _mm512_loadu_si512(exps + i);
    bad |= _mm512_cmpeq_epi8_mask(e, _mm512_set1_epi8(1)) | _mm512_cmpgt_epu8_mask(e, _mm512_set1_epi8(char(252)));
  }
  return bad == 0;
}

// Groups [G0, G1) of the block (32 k each: 16 k-pairs, an AMX k-step) into dst.
void widen_mxfp4_bf16(const GemmTile& t, int64_t G0, int64_t G1, uint8_t* dst) {
  const uint8_t* b = static_cast<const uint8_t*>(t.b);
  const uint8_t* exps = b + 32 * t.k;
  alignas(64) uint16_t table[32] = {};
  for (int q = 0; q < 16; ++q) {
    uint32_t bits;
    std::memcpy(&bits, &kE2m1[q], 4);
    table[q] = uint16_t(bits >> 16);
  }
  const __m512i lut = _mm512_load_si512(table);
  alignas(64) uint16_t column[32];  // word i of a converted half: its column, i / 4
  alignas(64) int32_t even[16];     // dword 2n of a (v0, v1) pair of halves: column n's first k-pair
  for (int i = 0; i < 32; ++i) column[i] = uint16_t(i / 4);
  for (int n = 0; n < 16; ++n) even[n] = 2 * n;
  const __m512i col0 = _mm512_load_si512(column), col1 = _mm512_add_epi16(col0, _mm512_set1_epi16(8));
  const __m512i pick_even = _mm512_load_si512(even), pick_odd = _mm512_add_epi32(pick_even, _mm512_set1_epi32(1));
  const __m512i low4 = _mm512_set1_epi8(0x0F), seven = _mm512_set1_epi16(7);
  for (int64_t G = G0; G < G1; ++G)
    for (int c = 0; c < 4; ++c) {
      // The 16 columns' exponents, one word each, spread to the 4 words of a column's k-quad; their bf16 exponent
      // offsets (e - 127) << 7, and which columns are live (e > 0: a zero group gives zeros).
      const __m512i e16 = _mm512_castsi256_si512(
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(exps + 64 * G + 16 * c))));
      const __m512i e_lo = _mm512_permutexvar_epi16(col0, e16), e_hi = _mm512_permutexvar_epi16(col1, e16);
      const __mmask32 live_lo = _mm512_test_epi16_mask(e_lo, e_lo), live_hi = _mm512_test_epi16_mask(e_hi, e_hi);
      const __m512i bias = _mm512_set1_epi16(127);
      const __m512i off_lo = _mm512_slli_epi16(_mm512_sub_epi16(e_lo, bias), 7);
      const __m512i off_hi = _mm512_slli_epi16(_mm512_sub_epi16(e_hi, bias), 7);
      for (int64_t s = G * kMxfp4Group / 8; s < (G + 1) * kMxfp4Group / 8; ++s) {
        _mm_prefetch(reinterpret_cast<const char*>(b) + qx86::kWidenAheadBytes + 256 * s + 64 * c, _MM_HINT_T0);
        const __m512i raw = _mm512_loadu_si512(b + 256 * s + 64 * c);
        for (int half = 0; half < 2; ++half) {  // low nibbles: k 8s..8s+3 (pairs 4s, 4s+1); high: the next four
          const __m512i codes = half ? _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4) : _mm512_and_si512(raw, low4);
          const __m512i w_lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(codes));
          const __m512i w_hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(codes, 1));
          // +-0 codes and dead columns give +0; the others their value with the exponent offset added
          const __m512i v_lo = _mm512_maskz_add_epi16(_mm512_test_epi16_mask(w_lo, seven) & live_lo,
                                                      _mm512_permutexvar_epi16(w_lo, lut), off_lo);
          const __m512i v_hi = _mm512_maskz_add_epi16(_mm512_test_epi16_mask(w_hi, seven) & live_hi,
                                                      _mm512_permutexvar_epi16(w_hi, lut), off_hi);
          uint8_t* pair = dst + 256 * (4 * s + 2 * half) + 64 * c;
          _mm512_store_si512(pair, _mm512_permutex2var_epi32(v_lo, pick_even, v_hi));
          _mm512_store_si512(pair + 256, _mm512_permutex2var_epi32(v_lo, pick_odd, v_hi));
        }
      }
    }
}

// mxfp4's block, widened into dst as a call's first row tile goes (BlockWidening).
struct Mxfp4Widening {
  const GemmTile& t;
  uint8_t* dst;
  static void widen(const void* self, int64_t begin, int64_t end) {  // k-pairs, 16 to a group
    const auto* w = static_cast<const Mxfp4Widening*>(self);
    widen_mxfp4_bf16(w->t, begin / 16, (end + 15) / 16, w->dst);
  }
};

template <bool W13>
void mxfp4_tile(const GemmTile& t) {
  if (t.rows < kWidenedMinRows) {
    const QuantKernel* vnni = quant_x86_avx512vnni(QuantFormat::kMxfp4W4A16);
    return W13 ? vnni->w13_tile(t) : vnni->w2_tile(t);
  }
  if (mxfp4_exps_fit_bf16(t)) {
    thread_local std::vector<const void*> codes;
    thread_local std::vector<float> scales;
    codes.resize(t.rows);
    scales.resize(t.rows);
    for (int r = 0; r < t.rows; ++r) {
      codes[r] = static_cast<const uint8_t*>(t.a_rows[r]) + quant_row_stride(t.k);
      scales[r] = qx86::a8_scale(t.a_rows[r], t.k);
    }
    GemmTile wide = t;
    uint8_t* dst = qx86::scratch(128 * t.k);
    wide.b = dst;
    wide.a_rows = codes.data();
    const Mxfp4Widening context{t, dst};
    const BlockWidening widening{Mxfp4Widening::widen, &context};
    return W13 ? amx_scaled_w13_tile(wide, scales.data(), &widening)
               : amx_scaled_w2_tile(wide, scales.data(), &widening);
  }
  GemmTile wide = t;
  wide.b = widen_mxfp4(t);
  amx::configure_tiles(kMxfp4StepK);
  if constexpr (W13) AmxMxfp4Tiles::w13(wide);
  else AmxMxfp4Tiles::w2(wide);
  _tile_release();
}

template <bool W13>
void int8_tile(const GemmTile& t) {
  if (t.rows < kMinRows) {
    const QuantKernel* vnni = quant_x86_avx512vnni(QuantFormat::kInt8W8A8);
    return W13 ? vnni->w13_tile(t) : vnni->w2_tile(t);
  }
  amx::configure_tiles();
  AmxInt8Rows(t).run<W13>();
  _tile_release();
}

}  // namespace

const QuantKernel* quant_x86_amx(QuantFormat f) {
  static const QuantKernel int8{kTileRows, true, int8_tile<true>, int8_tile<false>, write_quantized_row,
                                /*sorted_rows=*/true};
  static const QuantKernel fp8{kTileRows, false, fp8_tile<true>, fp8_tile<false>, nullptr, /*sorted_rows=*/true};
  static const QuantKernel int4{kTileRows, false, int4_tile<true>, int4_tile<false>, write_quantized_row,
                                /*sorted_rows=*/true};
  static const QuantKernel mxfp4{kTileRows, false, mxfp4_tile<true>, mxfp4_tile<false>, write_row_bf16_codes,
                                 /*sorted_rows=*/true, /*bf16_codes=*/true};
  switch (f) {
    case QuantFormat::kInt8W8A8: return &int8;
    case QuantFormat::kInt4W4A16: return &int4;
    case QuantFormat::kFp8W8A16: return &fp8;
    case QuantFormat::kMxfp4W4A16: return &mxfp4;
  }
  return nullptr;
}

}  // namespace cpumoe
