// x86 AVX-512 BF16: VDPBF16PS tiles over the kPairs layout. A block is [K/2][64][2] bf16: for each k-pair
// the 64 columns' two weights sit side by side, so one 64-byte load holds 16 columns x 2 k, and the
// activation pair (a[k], a[k+1]) is a single 32-bit broadcast. A tile keeps up to 6 rows x 64 columns of
// float32 accumulators in 24 zmm registers; each k-pair costs 4 weight loads and 4 x rows dot products.
// Decode (1-2 rows) is a pure weight stream; prefill reuses each block from L2 across row tiles.
#include <immintrin.h>

#include "../simd.h"
#include "kernels_avx512bf16.h"

namespace cpumoe {
namespace {

constexpr int kMaxRows = 6;
// Decode tiles (1-2 rows) stream their block from memory: an L2 prefetch 4 KB ahead gained 4-5% there in an
// interleaved A/B (2 KB and 8 KB less); larger tiles re-read an L2-resident block and gain nothing.
constexpr int kStreamRows = 2;
constexpr int kPrefetchBytes = 4096;

template <int R>
inline void accumulate_pairs(const GemmTile& t, __m512 (&acc)[R][4]) {
  const __m512i* b = static_cast<const __m512i*>(t.b);
  const uint32_t* a[R];
  for (int r = 0; r < R; ++r) {
    a[r] = static_cast<const uint32_t*>(t.a_rows[r]);
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  const int64_t pairs = t.k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512i* bp = b + 4 * p;
    if constexpr (R <= kStreamRows)
      for (int line = 0; line < 4; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(bp) + kPrefetchBytes + 64 * line, _MM_HINT_T1);
    __m512bh w0 = (__m512bh)_mm512_loadu_si512(bp);
    __m512bh w1 = (__m512bh)_mm512_loadu_si512(bp + 1);
    __m512bh w2 = (__m512bh)_mm512_loadu_si512(bp + 2);
    __m512bh w3 = (__m512bh)_mm512_loadu_si512(bp + 3);
    for (int r = 0; r < R; ++r) {
      __m512bh x = (__m512bh)_mm512_set1_epi32(int(a[r][p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, w3);
    }
  }
}

template <int R>
void w13_rows(const GemmTile& t) {
  __m512 acc[R][4];
  accumulate_pairs<R>(t, acc);
  for (int r = 0; r < R; ++r)
    simd::w13_epilogue<DType::kBFloat16>(t, r, (simd::f32x16)acc[r][0], (simd::f32x16)acc[r][1],
                                         (simd::f32x16)acc[r][2], (simd::f32x16)acc[r][3]);
}

template <int R>
void w2_rows(const GemmTile& t) {
  __m512 acc[R][4];
  accumulate_pairs<R>(t, acc);
  for (int r = 0; r < R; ++r) {
    const simd::f32x16 v[4] = {(simd::f32x16)acc[r][0], (simd::f32x16)acc[r][1],
                               (simd::f32x16)acc[r][2], (simd::f32x16)acc[r][3]};
    simd::w2_epilogue(t, r, v);
  }
}

constexpr TileFn kW13[kMaxRows + 1] = {
    nullptr, w13_rows<1>, w13_rows<2>, w13_rows<3>, w13_rows<4>, w13_rows<5>, w13_rows<6>};
constexpr TileFn kW2[kMaxRows + 1] = {
    nullptr, w2_rows<1>, w2_rows<2>, w2_rows<3>, w2_rows<4>, w2_rows<5>, w2_rows<6>};

}  // namespace

void avx512bf16_w13_tile(const GemmTile& t) { run_row_tiles(t, kW13, kMaxRows, 2); }
void avx512bf16_w2_tile(const GemmTile& t) { run_row_tiles(t, kW2, kMaxRows, 4); }

const KernelTable& kernels_x86_avx512bf16() {
  static const KernelTable table{"x86-avx512bf16", Layout::kPairs, kMaxRows,
                                 1u << int(DType::kBFloat16), avx512bf16_w13_tile,
                                 avx512bf16_w2_tile, avx512bf16_decode_attention,
                                 kAvx512Bf16AttentionScope};
  return table;
}

}  // namespace cpumoe
