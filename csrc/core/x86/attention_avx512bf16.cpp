// x86 AVX-512 BF16 decode attention (kernels.h DecodeAttentionArgs) over bf16 caches: both products run on
// VDPBF16PS straight from the cache's bf16, where kernels_fma.inc widens every K and V row to float32 first
// (~2x the instructions; 27 GFLOP/s a Zen 4 thread at qwen3-30b-a3b's heads against 61-64 here).
// - Scores: a tile of 32 keys is transposed as 32-bit (k[2i], k[2i+1]) pairs into keysT [d/2][32], so each pair of
//   q[h] is one broadcast against 32 keys: q . k summed in float32 from exact bf16 products, then scaled.
// - Values: the tile's softmax weights rounded to bf16 (the denominator sums the rounded weights, so those used
//   still sum to one). Two keys' value rows interleaved word by word make one VDPBF16PS add both keys' weighted
//   values into 16 columns. The interleave permutes the columns within each 32; the final store undoes it.
// Head sizes d and dv must be multiples of 32 (a pair per 32-bit lane, 16 lanes); other sizes and the other
// dtypes run the x86-avx512 FMA kernel.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../simd.h"
#include "kernels_avx512bf16.h"
#include "transpose16.h"

namespace cpumoe {
namespace {

constexpr int kTile = 32;        // keys per softmax update
constexpr int kHeads = 16;       // query heads of one KV head held at once (more run in groups)
constexpr int kValueHeads = 8;   // heads whose value accumulators (2 zmm per 32 columns) stay in registers

// Cache lines to bring into L2, a few at each of `steps` steps: the next tile's K and V rows, spread over this
// tile's work (the scores' key pairs, then the values' column chunks and key pairs). Issued all at once before it,
// as they were, a tile's 256 prefetches (qwen3-30b-a3b's heads) left the kernel reading its cache at ~10 GB/s at
// batch 16; spread, the same calls ran 1.5-1.9x faster.
struct SpreadPrefetch {
  const char* const* lines = nullptr;
  int64_t count = 0, per_step = 0;

  SpreadPrefetch(const char* const* lines, int64_t count, int64_t steps)
      : lines(lines), count(count), per_step((count + steps - 1) / steps) {}
  void step(int64_t i) const {
    for (int64_t k = i * per_step, k_end = std::min(count, k + per_step); k < k_end; ++k)
      _mm_prefetch(lines[k], _MM_HINT_T1);
  }
};

// scores[h][0:32] = scale * q[h] . keys for H heads (q: [H][pairs] bf16 pairs, keysT: [pairs][32]); issues
// `ahead`'s prefetches over its pairs steps when given.
template <int H>
inline void tile_scores(const uint32_t* q, int64_t pairs, const uint32_t* keysT, float scale, float* scores,
                        const SpreadPrefetch* ahead) {
  __m512 acc[2 * H];
  for (int j = 0; j < 2 * H; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    if (ahead) ahead->step(i);
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(keysT + i * kTile);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(keysT + i * kTile + 16);
    for (int h = 0; h < H; ++h) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(q[h * pairs + i]));
      acc[2 * h] = _mm512_dpbf16_ps(acc[2 * h], qb, k0);
      acc[2 * h + 1] = _mm512_dpbf16_ps(acc[2 * h + 1], qb, k1);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int h = 0; h < H; ++h) {
    _mm512_storeu_ps(scores + h * kTile, _mm512_mul_ps(acc[2 * h], s));
    _mm512_storeu_ps(scores + h * kTile + 16, _mm512_mul_ps(acc[2 * h + 1], s));
  }
}

// acc[h] += sum over key pairs p < P of probs[h][p] . (values[2p], values[2p+1]) for H heads, acc rows dv apart in
// the interleaved column order (per 32 columns: lanes 4L + j hold column 8L + j, then 16 + 4L + j column 8L + 4 + j).
// Issues `ahead`'s prefetches from step first_step on, one step a (column chunk, key pair), when given.
template <int H>
void add_values(const uint32_t* probs, const uint16_t* const* values, int P, int64_t dv, float* acc,
                const SpreadPrefetch* ahead, int64_t first_step) {
  for (int64_t c = 0; c < dv; c += 32) {
    __m512 lo[H], hi[H];
    for (int h = 0; h < H; ++h) {
      lo[h] = _mm512_loadu_ps(acc + h * dv + c);
      hi[h] = _mm512_loadu_ps(acc + h * dv + c + 16);
    }
    for (int p = 0; p < P; ++p) {
      if (ahead) ahead->step(first_step + (c / 32) * P + p);
      const __m512i x = _mm512_loadu_si512(values[2 * p] + c), y = _mm512_loadu_si512(values[2 * p + 1] + c);
      const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(x, y), vh = (__m512bh)_mm512_unpackhi_epi16(x, y);
      for (int h = 0; h < H; ++h) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(int(probs[h * (kTile / 2) + p]));
        lo[h] = _mm512_dpbf16_ps(lo[h], vl, w);
        hi[h] = _mm512_dpbf16_ps(hi[h], vh, w);
      }
    }
    for (int h = 0; h < H; ++h) {
      _mm512_storeu_ps(acc + h * dv + c, lo[h]);
      _mm512_storeu_ps(acc + h * dv + c + 16, hi[h]);
    }
  }
}

using AddValuesFn = void (*)(const uint32_t*, const uint16_t* const*, int, int64_t, float*, const SpreadPrefetch*,
                            int64_t);
constexpr AddValuesFn kAddValues[kValueHeads + 1] = {nullptr,         add_values<1>, add_values<2>,
                                                     add_values<3>,   add_values<4>, add_values<5>,
                                                     add_values<6>,   add_values<7>, add_values<8>};

// The order of an accumulator row's columns in each 32 (lanes 4L + j hold column 8L + j, lanes 16 + 4L + j column
// 8L + 4 + j, as VPUNPCKLWD / VPUNPCKHWD of two value rows leave them), for avx512bf16_store_attention_row.
constexpr int32_t kInterleavedColumns[32] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23,
                                             8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

void attention_rows(const DecodeAttentionArgs& a, int64_t s, int64_t kv_head) {
  const int64_t g = a.nh / a.nkv, d = a.d, dv = a.dv, pairs = d / 2;
  const int64_t begin = a.key_begin[s], end = a.key_end[s];
  const PagedHeadRows<uint16_t> rows(a, s, kv_head);
  const auto add_lines = [](const uint16_t* row, int64_t bytes, const char** lines) {  // -> lines added
    const char* first = reinterpret_cast<const char*>(row);
    int64_t n = 0;
    for (int64_t off = 0; off < bytes; off += 64) lines[n++] = first + off;
    return n;
  };
  // one thread's scratch. Floats: acc [kHeads][dv], scores [kHeads][kTile]. Words: q [kHeads][pairs], keysT
  // [pairs][kTile], probs [kHeads][kTile / 2] (bf16 pairs), a zero row standing in for the keys past a tile's end.
  thread_local std::vector<float> floats;
  thread_local std::vector<uint32_t> words;
  thread_local std::vector<const char*> lines;  // the next tile's K and V rows, line by line
  lines.resize(kTile * ((d * 2 + 63) / 64 + (dv * 2 + 63) / 64));
  floats.resize(kHeads * (dv + kTile));
  const int64_t zero_words = std::max(pairs, dv / 2);
  words.resize(kHeads * pairs + pairs * kTile + kHeads * kTile / 2 + zero_words);
  float* acc = floats.data();
  float* scores = acc + kHeads * dv;
  uint32_t* q = words.data();
  uint32_t* keysT = q + kHeads * pairs;
  uint32_t* probs = keysT + pairs * kTile;
  std::fill(probs + kHeads * kTile / 2, probs + kHeads * kTile / 2 + zero_words, 0u);
  const uint16_t* zeros = reinterpret_cast<const uint16_t*>(probs + kHeads * kTile / 2);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t h0 = 0; h0 < g; h0 += kHeads) {
    const int G = int(g - h0 < kHeads ? g - h0 : kHeads);
    const int64_t head0 = kv_head * g + h0;  // first query head of this group
    float m[kHeads], l[kHeads];
    for (int h = 0; h < G; ++h) {
      std::memcpy(q + h * pairs, static_cast<const uint16_t*>(a.q) + (s * a.nh + head0 + h) * d, d * 2);
      std::fill(acc + h * dv, acc + (h + 1) * dv, 0.0f);
      m[h] = -std::numeric_limits<float>::infinity();
      l[h] = 0.0f;
    }
    for (int64_t j0 = begin; j0 < end; j0 += kTile) {
      const int T = int(end - j0 < kTile ? end - j0 : kTile);
      const uint16_t* keys[kTile];
      const uint16_t* values[kTile];
      for (int t = 0; t < kTile; ++t) {
        keys[t] = t < T ? rows.key(j0 + t) : zeros;
        values[t] = t < T ? rows.value(j0 + t) : zeros;
      }
      // the next tile's rows into L2 while this one computes (rows a KV-head stride apart in scattered blocks: the
      // hardware prefetcher does not follow them), spread over the scores and values of the first heads. Into L1,
      // or two tiles ahead, was slower at batch 16; all of a sequence's rows at its start changed nothing.
      int64_t n_lines = 0;
      for (int64_t j = j0 + T, j_end = std::min(end, j0 + T + kTile); j < j_end; ++j) {
        n_lines += add_lines(rows.key(j), d * 2, lines.data() + n_lines);
        n_lines += add_lines(rows.value(j), dv * 2, lines.data() + n_lines);
      }
      const int P = (T + 1) / 2;  // key pairs of the values
      const SpreadPrefetch ahead(lines.data(), n_lines, pairs + (dv / 32) * P);
      const SpreadPrefetch* pending = n_lines ? &ahead : nullptr;  // for the first scores call
      for (int kb = 0; kb < kTile; kb += 16)
        for (int64_t c = 0; c < pairs; c += 16) {
          __m512 r[16];
          for (int u = 0; u < 16; ++u) r[u] = _mm512_castsi512_ps(_mm512_loadu_si512(keys[kb + u] + 2 * c));
          transpose16(r);
          for (int u = 0; u < 16; ++u) _mm512_storeu_si512(keysT + (c + u) * kTile + kb, _mm512_castps_si512(r[u]));
        }
      int h = 0;
      for (; h + 8 <= G; h += 8, pending = nullptr)
        tile_scores<8>(q + h * pairs, pairs, keysT, a.scale, scores + h * kTile, pending);
      for (; h + 4 <= G; h += 4, pending = nullptr)
        tile_scores<4>(q + h * pairs, pairs, keysT, a.scale, scores + h * kTile, pending);
      for (; h < G; ++h, pending = nullptr)
        tile_scores<1>(q + h * pairs, pairs, keysT, a.scale, scores + h * kTile, pending);
      const uint32_t valid = T == kTile ? ~0u : (1u << T) - 1;
      const __mmask16 valid0 = __mmask16(valid), valid1 = __mmask16(valid >> 16);
      for (h = 0; h < G; ++h) {
        const __m512 s0 = _mm512_mask_mov_ps(neg_inf, valid0, _mm512_loadu_ps(scores + h * kTile));
        const __m512 s1 = _mm512_mask_mov_ps(neg_inf, valid1, _mm512_loadu_ps(scores + h * kTile + 16));
        const float tile_max = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
        const float m_new = tile_max > m[h] ? tile_max : m[h];
        if (m_new != m[h]) {  // rescale what earlier tiles summed (e^-inf = 0 on the first)
          const float correction = std::exp(m[h] - m_new);
          l[h] *= correction;
          const __m512 c = _mm512_set1_ps(correction);
          for (int64_t i = 0; i < dv; i += 16)
            _mm512_storeu_ps(acc + h * dv + i, _mm512_mul_ps(_mm512_loadu_ps(acc + h * dv + i), c));
          m[h] = m_new;
        }
        const __m512 mv = _mm512_set1_ps(m_new);
        const __m512 p0 = _mm512_maskz_mov_ps(valid0, (__m512)simd::vexp((simd::f32x16)_mm512_sub_ps(s0, mv)));
        const __m512 p1 = _mm512_maskz_mov_ps(valid1, (__m512)simd::vexp((simd::f32x16)_mm512_sub_ps(s1, mv)));
        const __m512i rounded = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);  // word t = key t's weight
        _mm512_storeu_si512(probs + h * (kTile / 2), rounded);
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(rounded, 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int(0xffff0000u))));
        l[h] += _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
      }
      for (h = 0; h < G; h += kValueHeads) {
        const int H = G - h < kValueHeads ? G - h : kValueHeads;
        kAddValues[H](probs + h * (kTile / 2), values, P, dv, acc + h * dv, h == 0 && n_lines ? &ahead : nullptr,
                      pairs);
      }
    }
    for (int h = 0; h < G; ++h) {
      float denom = l[h];
      if (a.sinks) denom += std::exp(a.sinks[head0 + h] - m[h]);
      const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;  // no keys and no sink: zeros
      avx512bf16_store_attention_row(acc + h * dv, dv, inv, kInterleavedColumns,
                                     static_cast<uint16_t*>(a.out) + (s * a.nh + head0 + h) * dv);
    }
  }
}

}  // namespace

void avx512bf16_store_attention_row(const float* acc, int64_t dv, float inv, const int32_t (&order)[32],
                                    uint16_t* out) {
  const __m512i first = _mm512_loadu_si512(order), second = _mm512_loadu_si512(order + 16);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < dv; c += 32) {
    const __m512 lo = _mm512_loadu_ps(acc + c), hi = _mm512_loadu_ps(acc + c + 16);
    simd::store<DType::kBFloat16>(out + c, (simd::f32x16)_mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale));
    simd::store<DType::kBFloat16>(out + c + 16,
                                  (simd::f32x16)_mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale));
  }
}

const char* const kAvx512Bf16AttentionScope =
    "takes bf16 caches with head sizes a multiple of 32; other dtypes and head sizes run x86-avx512's float32 FMA "
    "kernel";

void avx512bf16_decode_attention(const DecodeAttentionArgs& a, int64_t s, int64_t kv_head) {
  if (a.dtype == DType::kBFloat16 && a.d % 32 == 0 && a.dv % 32 == 0)
    attention_rows(a, s, kv_head);
  else
    kernels_x86_avx512().attention(a, s, kv_head);
}

}  // namespace cpumoe
