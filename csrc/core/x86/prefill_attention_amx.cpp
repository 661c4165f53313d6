// x86 AMX prefill attention (prefill_attention.h): both products on the tile unit, flash-style. The blocked torch
// maths it replaces (prefill.py: two bmm's a 64-query block with the softmax between, the scores written out in
// bf16 and read back three times) ran a 512-token prompt of qwen3-30b-a3b's heads in 8.3-9.3 ms a layer.
// - Each KV head's keys and values are first laid out once for the tiles, shared by its g query heads and every
//   query tile: keys as B tiles of Q . K^T ([L/16 tiles][d/2 pairs][16 keys] 32-bit pairs), values as B tiles of
//   P . V ([L/2 key pairs][dv][2]); both zero past the last key (a zero value row times a weight of 0 is 0, a stale
//   row's NaN would not be).
// - An item is 16 queries of one head: per step of 32 keys, the scores (two 16 x 16 float32 tiles, queries as
//   rows, q's rows read in place), the online softmax a query row at a time on the vector units, the weights
//   rounded to bf16 as one A tile, and the output rows [16][dv] float32 updated in place through the accumulator
//   tiles. Steps wholly inside every row's window skip the masking.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../simd.h"
#include "amx_tiles.h"
#include "kernels_amx.h"
#include "transpose16.h"

namespace cpumoe {
namespace {

constexpr int kRows = 16;  // queries a tile
constexpr int kStep = 32;  // keys a step: two score tiles, one k-step of P . V

struct Layouts {
  uint32_t* keys;    // [nkv][Lp/16][d/2][16]
  uint32_t* values;  // [nkv][Lp/2][dv]
  int64_t Lp;        // keys rounded up to a step
  uint32_t* key_tile(const PrefillAttentionArgs& a, int64_t kv, int64_t j) const {  // j a multiple of 16
    return keys + (kv * Lp + j) * (a.d / 2);
  }
  uint32_t* value_pairs(const PrefillAttentionArgs& a, int64_t kv, int64_t j) const {  // j even
    return values + (kv * Lp + j) / 2 * a.dv;
  }
};

// Keys [16 t, 16 t + 16) of KV head kv: 16 x 16 transposes of their 32-bit pairs; and their values, two rows'
// columns interleaved.
void lay_out_tile(const PrefillAttentionArgs& a, const Layouts& lay, int64_t kv, int64_t t) {
  const uint16_t* k = static_cast<const uint16_t*>(a.k) + kv * a.k_head_stride;
  const uint16_t* v = static_cast<const uint16_t*>(a.v) + kv * a.v_head_stride;
  const int64_t j0 = 16 * t;
  uint32_t* kt = lay.key_tile(a, kv, j0);
  __m512 r[16];
  for (int64_t c = 0; c < a.d / 32; ++c) {
    for (int j = 0; j < 16; ++j)
      r[j] = j0 + j < a.L ? _mm512_loadu_ps(k + (j0 + j) * a.k_token_stride + 32 * c) : _mm512_setzero_ps();
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_store_ps(kt + (16 * c + i) * 16, r[i]);
  }
  alignas(64) static const int16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t j = j0; j < j0 + 16; j += 2) {
    uint32_t* pairs = lay.value_pairs(a, kv, j);
    for (int64_t c = 0; c < a.dv; c += 32) {
      const __m512i x = j < a.L ? _mm512_loadu_si512(v + j * a.v_token_stride + c) : _mm512_setzero_si512();
      const __m512i y = j + 1 < a.L ? _mm512_loadu_si512(v + (j + 1) * a.v_token_stride + c) : _mm512_setzero_si512();
      _mm512_store_si512(pairs + c, _mm512_permutex2var_epi16(x, low, y));
      _mm512_store_si512(pairs + c + 16, _mm512_permutex2var_epi16(x, high, y));
    }
  }
}

struct Scratch {
  float* scores;   // [16][32]
  uint16_t* p;     // [16][32] bf16
  float* sums;     // [16][16]: each row's denominator, in lanes (summed across them at the end)
  float* acc;      // [16][dv]
  uint16_t* q;     // [16][d] bf16, a tile of fewer than 16 queries padded with zero rows
  explicit Scratch(const PrefillAttentionArgs& a) {
    thread_local std::vector<uint32_t> words;
    uint32_t* base = amx::aligned_words(words, kRows * kStep * 3 / 2 + kRows * 16 + kRows * a.dv + kRows * a.d / 2);
    scores = reinterpret_cast<float*>(base);
    p = reinterpret_cast<uint16_t*>(base + kRows * kStep);
    sums = reinterpret_cast<float*>(base + kRows * kStep * 3 / 2);
    acc = sums + kRows * 16;
    q = reinterpret_cast<uint16_t*>(acc + kRows * a.dv);
  }
};

// Queries [16 qt, 16 qt + n) of query head `head`.
void query_tile(const PrefillAttentionArgs& a, const Layouts& lay, int64_t head, int64_t qt) {
  const int64_t g = a.nh / a.nkv, kv = head / g, t0 = kRows * qt, n = std::min<int64_t>(kRows, a.T - t0);
  const int64_t first_position = a.L - a.T + t0;  // of the tile's first query
  const Scratch w(a);
  const uint16_t* q = static_cast<const uint16_t*>(a.q) + head * a.q_head_stride + t0 * a.q_token_stride;
  int64_t q_stride = 2 * a.q_token_stride;  // bytes
  if (n < kRows) {
    std::memset(w.q, 0, 2 * kRows * a.d);
    for (int r = 0; r < n; ++r) std::memcpy(w.q + r * a.d, q + r * a.q_token_stride, 2 * a.d);
    q = w.q;
    q_stride = 2 * a.d;
  }
  // Row r's visible keys [lo[r], hi[r]); rows past n see none.
  int64_t lo[kRows], hi[kRows];
  for (int r = 0; r < kRows; ++r) {
    const int64_t position = first_position + r;
    hi[r] = r < n ? position + 1 : 0;
    lo[r] = r < n && a.window > 0 ? std::max<int64_t>(0, position - a.window + 1) : 0;
  }
  const int64_t key_begin = lo[0] / kStep * kStep, key_end = hi[n - 1];
  const int64_t lo_max = lo[n - 1], hi_min = hi[0];

  const float neg_inf = -std::numeric_limits<float>::infinity();
  float m[kRows];
  bool unbounded[kRows];  // a NaN or +inf score: the row comes out NaN
  std::fill(m, m + kRows, neg_inf);
  std::fill(w.sums, w.sums + kRows * 16, 0.0f);
  std::fill(unbounded, unbounded + kRows, false);
  std::fill(w.acc, w.acc + kRows * a.dv, 0.0f);
  const __m512 scale = _mm512_set1_ps(a.scale), minus_inf = _mm512_set1_ps(neg_inf);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);

  for (int64_t j0 = key_begin; j0 < key_end; j0 += kStep) {
    // scores: tile 0 keys [j0, j0 + 16), tile 1 the next 16
    _tile_zero(0);
    _tile_zero(1);
    const uint32_t* k0 = lay.key_tile(a, kv, j0);
    const uint32_t* k1 = lay.key_tile(a, kv, j0 + 16);
    for (int64_t c = 0; c < a.d / 32; ++c) {
      _tile_loadd(4, reinterpret_cast<const char*>(q) + 64 * c, q_stride);
      _tile_loadd(6, k0 + 16 * 16 * c, 64);
      _tile_loadd(7, k1 + 16 * 16 * c, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, w.scores, 4 * kStep);
    _tile_stored(1, w.scores + 16, 4 * kStep);

    // every row sees all 32 keys: no masks
    const bool whole = j0 + kStep <= hi_min && j0 >= lo_max;
    for (int r = 0; r < kRows; ++r) {
      __m512 x[2];
      __mmask16 seen[2] = {0xffff, 0xffff};
      for (int h = 0; h < 2; ++h) {
        x[h] = _mm512_mul_ps(_mm512_load_ps(w.scores + r * kStep + 16 * h), scale);
        if (!whole) {
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(int(j0 + 16 * h)));
          seen[h] = _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(int(lo[r]))) &
                    _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(int(hi[r])));
          x[h] = _mm512_mask_blend_ps(seen[h], minus_inf, x[h]);
        }
        if (_mm512_mask_cmp_ps_mask(seen[h], x[h], inf, _CMP_NLT_UQ)) unbounded[r] = true;
      }
      uint16_t* p_row = w.p + r * kStep;
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(x[0], x[1])));
      if (m_new == neg_inf || unbounded[r]) {  // no key seen yet, or a NaN row: weights 0
        std::memset(p_row, 0, 2 * kStep);
        continue;
      }
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 e[2];
      for (int h = 0; h < 2; ++h)
        e[h] = _mm512_maskz_mov_ps(seen[h], (__m512)simd::vexp((simd::f32x16)_mm512_sub_ps(x[h], mv)));
      const __m512i bf = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]);  // keys 0-15 low, 16-31 high
      _mm512_store_si512(p_row, bf);
      // the denominator sums the rounded weights, as the torch maths sums what it multiplies
      const __m512 rounded_low = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
          _mm512_castsi512_si256(bf)), 16));
      const __m512 rounded_high = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
          _mm512_extracti64x4_epi64(bf, 1)), 16));
      float* sums = w.sums + 16 * r;
      __m512 sum = _mm512_load_ps(sums);
      if (m_new != m[r]) {  // what earlier steps summed, rescaled to the new maximum
        const __m512 f = _mm512_set1_ps(m[r] == neg_inf ? 0.0f : std::exp(m[r] - m_new));
        sum = _mm512_mul_ps(sum, f);
        float* acc = w.acc + r * a.dv;
        for (int64_t i = 0; i < a.dv; i += 16) _mm512_store_ps(acc + i, _mm512_mul_ps(_mm512_load_ps(acc + i), f));
        m[r] = m_new;
      }
      _mm512_store_ps(sums, _mm512_add_ps(sum, _mm512_add_ps(rounded_low, rounded_high)));
    }

    // values: acc[16][dv] += P[16][32 keys] . V[32 keys][dv], four column tiles at a time
    _tile_loadd(4, w.p, 2 * kStep);
    const uint32_t* pairs = lay.value_pairs(a, kv, j0);
    for (int64_t c0 = 0; c0 < a.dv; c0 += 64) {
      const int tiles = int(std::min<int64_t>(4, (a.dv - c0) / 16));
      float* acc = w.acc + c0;
      const int64_t acc_stride = 4 * a.dv, pair_stride = 4 * a.dv;
      _tile_loadd(0, acc, acc_stride);
      _tile_loadd(1, acc + 16, acc_stride);
      _tile_loadd(6, pairs + c0, pair_stride);
      _tile_loadd(7, pairs + c0 + 16, pair_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_stored(0, acc, acc_stride);
      _tile_stored(1, acc + 16, acc_stride);
      if (tiles == 4) {
        _tile_loadd(2, acc + 32, acc_stride);
        _tile_loadd(3, acc + 48, acc_stride);
        _tile_loadd(6, pairs + c0 + 32, pair_stride);
        _tile_loadd(7, pairs + c0 + 48, pair_stride);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(3, 4, 7);
        _tile_stored(2, acc + 32, acc_stride);
        _tile_stored(3, acc + 48, acc_stride);
      }
    }
  }

  for (int r = 0; r < n; ++r) {
    float denom = _mm512_reduce_add_ps(_mm512_load_ps(w.sums + 16 * r));
    if (a.sinks) denom += std::exp(a.sinks[head] - m[r]);
    const float inv = unbounded[r] ? std::numeric_limits<float>::quiet_NaN() : 1.0f / denom;
    const float* acc = w.acc + r * a.dv;
    uint16_t* out = static_cast<uint16_t*>(a.out) + ((t0 + r) * a.nh + head) * a.dv;
    for (int64_t i = 0; i < a.dv; i += 16) {
      const __m512 y = _mm512_mul_ps(_mm512_load_ps(acc + i), _mm512_set1_ps(inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

}  // namespace

void amx_prefill_attention(const PrefillAttentionArgs& a, const Parallel& parallel) {
  if (a.T == 0) return;
  Layouts lay;
  lay.Lp = (a.L + kStep - 1) / kStep * kStep;
  static thread_local std::vector<uint32_t> keys, values;
  lay.keys = amx::aligned_words(keys, a.nkv * lay.Lp * a.d / 2);
  lay.values = amx::aligned_words(values, a.nkv * lay.Lp * a.dv / 2);
  const int64_t key_tiles = lay.Lp / 16;
  parallel_items(parallel, a.nkv * key_tiles, [&](int64_t i) { lay_out_tile(a, lay, i / key_tiles, i % key_tiles); });
  // Items heaviest first (the last query tiles see the most keys), so the guided runs end on light ones.
  const int64_t query_tiles = (a.T + kRows - 1) / kRows;
  parallel_items(parallel, a.nh * query_tiles, [&](int64_t i) {
    amx::configure_tiles();
    query_tile(a, lay, i % a.nh, query_tiles - 1 - i / a.nh);
    _tile_release();
  });
}

}  // namespace cpumoe
