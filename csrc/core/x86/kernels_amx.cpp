// x86 AMX BF16: TDPBF16PS tile products over the kPairs blocks that x86-avx512bf16 packs ([K/2][64][2] bf16), so
// the two backends share their packed weights. A B tile (16 k-pairs x 16 columns, 64 bytes a row) is read in place
// from a block with the block's 256-byte pair stride; an A tile is 16 activation rows x 32 k, read in place when the
// rows are evenly spaced in memory (w2's intermediate rows, a dense linear's rows, and w13's rows, the tokens routed
// to an expert, once the fused driver has copied them into expert order: KernelTable::sorted_rows) and copied
// together first when they are not. The fp8 prefill of quant_amx.cpp runs here too (kernels_amx.h).
//
// AMX pays where a block is reused across rows: calls of kMinRows rows or more run in tiles of 16 rows (the last
// padded with zero rows), four 16 x 16 float32 accumulator tiles at a time. Decode calls (fewer rows) go
// to the AVX-512 BF16 register tiles, which stream a block from memory as fast as the memory gives it.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "../simd.h"
#include "amx_tiles.h"
#include "kernels_amx.h"
#include "kernels_avx512bf16.h"

namespace cpumoe {
namespace {

using amx::kTileRows;
constexpr int kTilePairs = 16;  // k-pairs per A/B tile (32 bf16 of k)
// Fewest rows that go to AMX. By instruction counts (not measured row by row) a 16-row tile product costs what 2
// rows do on the AVX-512 BF16 tiles: 4 TDPBF16PS of 16 cycles per 16 k-pairs, against 4 VDPBF16PS a row and k-pair
// at two a cycle. From 4 rows AMX is ahead with a margin; below, the AVX-512 tiles stream the block (decode).
constexpr int kMinRows = 4;
constexpr int64_t kPairBytes = kBlockCols * 2 * 2;  // a k-pair of a block: 64 columns x 2 bf16

// c[16][64] = a[16 rows, stride a_stride bytes] . the block's 64 columns over k-pairs [0, pairs), pairs a multiple
// of 16: one A tile against the four B tiles of a k-step, so each k-step reads whole 256-byte rows of the block (a
// 32-row group, two A tiles against two B tiles a half of the block at a time, ran 10% slower at M = 512 and 2048:
// it read the block in two strided passes). stream: the call's first row group, which reads the block from memory.
// after_step(step, steps): amx::pipelined_row_tiles' hook, called after each k-step.
template <class AfterStep>
void sum_tiles(const char* a, int64_t a_stride, const char* b, int64_t pairs, bool stream, AfterStep after_step,
               amx::NextBlockFetch next = {}) {
  amx::zero_accumulators();
  for (int64_t p = 0; p < pairs; p += kTilePairs) {
    if (stream) amx::prefetch_ahead(b + p * kPairBytes, kTilePairs * kPairBytes);
    next.step(p / kTilePairs);
    CPUMOE_AMX_K_STEP(_tile_dpbf16ps, a + p * 4, a_stride, b + p * kPairBytes);
    after_step(p / kTilePairs, pairs / kTilePairs);
  }
}

// The k-pairs past the last whole tile ([from, pairs)), added to c[rows][64] with VDPBF16PS.
void tail_pairs(const char* a, int64_t a_stride, const char* b, int64_t from, int64_t pairs, int rows, float* c) {
  for (int r = 0; r < rows; ++r) {
    const uint32_t* ar = reinterpret_cast<const uint32_t*>(a + r * a_stride);
    __m512 acc[4];
    for (int q = 0; q < 4; ++q) acc[q] = _mm512_loadu_ps(c + r * 64 + 16 * q);
    for (int64_t p = from; p < pairs; ++p) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(int(ar[p]));
      for (int q = 0; q < 4; ++q)
        acc[q] = _mm512_dpbf16_ps(acc[q], x, (__m512bh)_mm512_loadu_si512(b + p * kPairBytes + 64 * q));
    }
    for (int q = 0; q < 4; ++q) _mm512_storeu_ps(c + r * 64 + 16 * q, acc[q]);
  }
}

// c[16][64] for rows [first, first + n) of the call (n <= 16; rows past n are zeros and their sums unused) over a
// widened fp8 block (t.b): chunk_scales, its float32 scales [ceil(k / t.group)][64] (t.group a multiple of 32); each
// chunk of t.group k sums on its own and adds scale * sum, as the AVX-512 BF16 unit's chunked tiles do. The call's
// first row tile widens the block as it goes (BlockWidening), chunk ci + 1 during chunk ci's k-steps: fp8's
// widening read the block from memory with the AMX unit idle, 20% of its samples at M = 2048.
void chunked_group(const GemmTile& t, int first, int n, float* c, const float* chunk_scales,
                   const BlockWidening& widening) {
  int64_t stride;
  const char* a = amx::tile_rows(t.a_rows + first, n, t.k * 2, &stride);
  const char* b = static_cast<const char*>(t.b);
  const int64_t chunks = (t.k + t.group - 1) / t.group;
  const auto end_of = [&](int64_t ci) { return std::min((ci + 1) * t.group, t.k) / 2; };  // k-pairs
  if (first == 0) widening.widen(widening.context, 0, end_of(0));
  const auto next = amx::NextBlockFetch::for_tile(t, first, t.k / 2 / kTilePairs);
  alignas(64) float chunk[kTileRows * 64];
  for (int i = 0; i < n * 64; i += 16) _mm512_store_ps(c + i, _mm512_setzero_ps());
  for (int64_t ci = 0; ci < chunks; ++ci) {
    const int64_t p0 = ci * t.group / 2, p1 = end_of(ci);
    const int64_t next_end = ci + 1 < chunks ? end_of(ci + 1) : p1;
    int64_t widened_to = p1;
    sum_tiles(a + p0 * 4, stride, b + p0 * kPairBytes, p1 - p0, /*stream=*/false, [&](int64_t step, int64_t steps) {
      if (first != 0) return;
      const int64_t upto =
          step + 1 == steps ? next_end : p1 + (next_end - p1) * (step + 1) / steps / kTilePairs * kTilePairs;
      if (upto > widened_to) widening.widen(widening.context, widened_to, upto);
      widened_to = std::max(widened_to, upto);
    }, next.from_step(p0 / kTilePairs));
    amx::store_accumulators(chunk);
    for (int r = 0; r < n; ++r)
      for (int q = 0; q < 4; ++q) {
        float* cr = c + r * 64 + 16 * q;
        _mm512_store_ps(cr, _mm512_fmadd_ps(_mm512_load_ps(chunk + r * 64 + 16 * q),
                                            _mm512_loadu_ps(chunk_scales + ci * 64 + 16 * q), _mm512_load_ps(cr)));
      }
  }
}

// Runs the call's rows in AMX tiles of 16, the last one padded with zero rows; a call of fewer than kMinRows rows goes
// to `fewer_rows` instead (the AVX-512 BF16 tiles). epilogue(r, c_row) finishes row r from its 64 float32 sums.
// widening: the first row tile widens t.b as it goes (BlockWidening); chunk_scales: fp8's chunked sums
// (chunked_group), which come with a widening.
template <typename Epilogue>
void run(const GemmTile& t, Epilogue epilogue, TileFn fewer_rows, const BlockWidening* widening = nullptr,
         const float* chunk_scales = nullptr) {
  if (t.rows < kMinRows && fewer_rows) return fewer_rows(t);
  amx::configure_tiles();
  if (chunk_scales) {
    alignas(64) float c[kTileRows * 64];
    for (int done = 0; done < t.rows;) {
      const int n = std::min(t.rows - done, kTileRows);
      chunked_group(t, done, n, c, chunk_scales, *widening);
      for (int r = 0; r < n; ++r) epilogue(done + r, c + r * 64);
      done += n;
    }
  } else {
    // Plain weights: the AMX unit sums a tile while the vector units finish the one before.
    const char* b = static_cast<const char*>(t.b);
    const int64_t pairs = t.k / 2, whole = pairs / kTilePairs * kTilePairs;
    amx::pipelined_row_tiles<float>(
        t.rows,
        [&](int first, int n, auto after_step) {
          int64_t stride;
          const char* a = amx::tile_rows(t.a_rows + first, n, t.k * 2, &stride);
          if (first != 0 || !widening)
            return sum_tiles(a, stride, b, whole, /*stream=*/first == 0, after_step,
                             amx::NextBlockFetch::for_tile(t, first, whole / kTilePairs));
          // Two k-steps ahead of the tile products; the block is in this thread's scratch, not streamed.
          const auto widen = [&](int64_t step) {
            if (step * kTilePairs < whole)
              widening->widen(widening->context, step * kTilePairs, std::min(whole, (step + 1) * kTilePairs));
          };
          widen(0);
          widen(1);
          sum_tiles(a, stride, b, whole, /*stream=*/false, [&](int64_t step, int64_t steps) {
            widen(step + 2);
            after_step(step, steps);
          });
          if (whole < pairs) widening->widen(widening->context, whole, pairs);
        },
        [&](int first, int r0, int r1, float* c) {
          if (whole < pairs)  // from the rows themselves: the copy tile_rows made may hold the next tile's by now
            for (int r = r0; r < r1; ++r)
              tail_pairs(static_cast<const char*>(t.a_rows[first + r]), 0, b, whole, pairs, 1, c + r * 64);
          for (int r = r0; r < r1; ++r) epilogue(first + r, c + r * 64);
        });
  }
  _tile_release();
}

simd::f32x16 sums(const float* c, int q) { return simd::load_f32(c + 16 * q); }

void amx_w13_tile(const GemmTile& t) {
  run(t, [&](int r, const float* c) {
        simd::w13_epilogue<DType::kBFloat16>(t, r, sums(c, 0), sums(c, 1), sums(c, 2), sums(c, 3));
      }, avx512bf16_w13_tile);
}

void amx_w2_tile(const GemmTile& t) {
  run(t, [&](int r, const float* c) {
        const simd::f32x16 v[4] = {sums(c, 0), sums(c, 1), sums(c, 2), sums(c, 3)};
        simd::w2_epilogue(t, r, v);
      }, avx512bf16_w2_tile);
}

}  // namespace

namespace {

// fp8's block, widened by the AVX-512 BF16 unit into its scratch block as the tiles go.
struct Fp8Widening {
  const GemmTile& codes;
  uint8_t* block;
  static void widen(const void* self, int64_t begin, int64_t end) {
    const auto* w = static_cast<const Fp8Widening*>(self);
    avx512bf16_widen_fp8_pairs(w->codes, begin, end, w->block);
  }
};

template <bool W13>
void fp8_tile(const GemmTile& t) {
  GemmTile wide = t;
  uint8_t* block = avx512bf16_fp8_widened_block(t);
  wide.b = block;
  const Fp8Widening context{t, block};
  const BlockWidening widening{Fp8Widening::widen, &context};
  const float* chunk_scales = reinterpret_cast<const float*>(block + 128 * t.k);
  if constexpr (W13)
    run(wide, [&](int r, const float* c) {
          simd::w13_epilogue<DType::kBFloat16>(wide, r, sums(c, 0), sums(c, 1), sums(c, 2), sums(c, 3));
        }, nullptr, &widening, chunk_scales);
  else
    run(wide, [&](int r, const float* c) {
          const simd::f32x16 v[4] = {sums(c, 0), sums(c, 1), sums(c, 2), sums(c, 3)};
          simd::w2_epilogue(wide, r, v);
        }, nullptr, &widening, chunk_scales);
}

}  // namespace

void amx_fp8_w13_tile(const GemmTile& t) { fp8_tile<true>(t); }
void amx_fp8_w2_tile(const GemmTile& t) { fp8_tile<false>(t); }

void amx_scaled_w13_tile(const GemmTile& t, const float* row_scales, const BlockWidening* widening) {
  run(t, [&](int r, const float* c) {
        const __m512 s = _mm512_set1_ps(row_scales[r]);
        simd::f32x16 v[4];
        for (int q = 0; q < 4; ++q) v[q] = (simd::f32x16)_mm512_mul_ps(_mm512_load_ps(c + 16 * q), s);
        if (t.dtype == DType::kFloat32) simd::w13_epilogue<DType::kFloat32>(t, r, v[0], v[1], v[2], v[3]);
        else simd::w13_epilogue<DType::kBFloat16>(t, r, v[0], v[1], v[2], v[3]);
      }, nullptr, widening);
}

void amx_scaled_w2_tile(const GemmTile& t, const float* row_scales, const BlockWidening* widening) {
  run(t, [&](int r, const float* c) {
        const __m512 s = _mm512_set1_ps(row_scales[r]);
        simd::f32x16 v[4];
        for (int q = 0; q < 4; ++q) v[q] = (simd::f32x16)_mm512_mul_ps(_mm512_load_ps(c + 16 * q), s);
        simd::w2_epilogue(t, r, v);
      }, nullptr, widening);
}

const KernelTable& kernels_x86_amx() {
  // max_rows: the fused driver cuts an expert's rows into chunks of a multiple of it, so that every chunk but an
  // expert's last fills whole AMX tiles.
  static const KernelTable table{"x86-amx", Layout::kPairs, kTileRows, 1u << int(DType::kBFloat16), amx_w13_tile,
                                 amx_w2_tile, amx_decode_attention, kAmxAttentionScope, /*sorted_rows=*/true};
  return table;
}

}  // namespace cpumoe
