// x86 AMX decode attention (kernels.h DecodeAttentionArgs) over bf16 caches, both products on the tile unit. On
// VDPBF16PS (attention_avx512bf16.cpp) the products bound the kernel: qwen3-30b-a3b's heads at batch 16 read their
// cache at 10-12 GB/s here, in L3 or not. Per sequence, KV head and group of up to 16 query heads, 32 keys a step
// (two tiles of 16 keys, each in one cache block: block sizes a multiple of 16), nothing of the cache transposed:
// - Scores transposed, keys x heads = K x q^T: 16 keys' rows are an A tile read in place (a slot apart), q's
//   dimension pairs x heads the B tile. Keys of a tile outside [key_begin, key_end) are read and masked.
// - The softmax runs along the keys with the heads across the lanes (a scores row is one key's 16 heads); weights
//   are rounded to bf16 and the denominator sums the rounded ones, as x86-avx512bf16's kernel does.
// - Values, heads x columns = P x V with V's rows read in place as B tiles: the tile unit takes a B row as 16 column
//   pairs, so 16 keys' rows of 32 columns give the even columns against weights in the low halves of P's pairs
//   (zero high halves) and the odd ones against weights in the high halves. Twice the tile products, no interleave
//   of V (as VDPBF16PS needs); P's 16 x 16 transposes are the only shuffles. A tile holding keys outside the range
//   has its valid rows copied beside zeros, since a weight of 0 times a stale row's NaN would be NaN.
// Head sizes d and dv must be multiples of 32; other sizes, dtypes and block sizes run x86-avx512bf16's kernel.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../simd.h"
#include "amx_tiles.h"
#include "kernels_amx.h"
#include "kernels_avx512bf16.h"
#include "transpose16.h"

namespace cpumoe {
namespace {

constexpr int kKeys = 32;            // keys a step: two 16-row tiles
constexpr int kHeads = 16;           // query heads of one KV head at once: a scores row, an output tile's rows
constexpr int kTileWords = 16 * 16;  // 32-bit words in a 16-row x 64-byte tile

// This thread's scratch, 64-byte aligned, in 32-bit words: q^T [d/32][16 pairs][16 heads]; scores [32 keys][16
// heads] float32; P [2 key tiles][low, high][16 heads][16 keys]; two key tiles' value rows [16][dv / 2] for tiles
// with keys outside the range; the accumulators [16 heads][dv] float32, per 32 columns the 16 even ones then the odd.
struct Scratch {
  uint32_t *q, *p, *v;
  float *scores, *acc;
  Scratch(int64_t d, int64_t dv) {
    thread_local std::vector<uint32_t> words;
    const int64_t q_words = d / 32 * kTileWords;
    uint32_t* base =
        amx::aligned_words(words, q_words + kKeys * kHeads + 4 * kTileWords + 2 * 16 * dv / 2 + kHeads * dv);
    q = base;
    scores = reinterpret_cast<float*>(q + q_words);
    p = reinterpret_cast<uint32_t*>(scores + kKeys * kHeads);
    v = p + 4 * kTileWords;
    acc = reinterpret_cast<float*>(v + 2 * 16 * dv / 2);
  }
};

// The order of an accumulator row's columns in each 32: the 16 even ones, then the 16 odd ones.
constexpr int32_t kEvenOddColumns[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                         8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

void attention_rows(const DecodeAttentionArgs& a, int64_t s, int64_t kv_head) {
  const int64_t g = a.nh / a.nkv, d = a.d, dv = a.dv;
  const int64_t begin = a.key_begin[s], end = a.key_end[s];
  const PagedHeadRows<uint16_t> rows(a, s, kv_head);
  const Scratch w(d, dv);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale = _mm512_set1_ps(a.scale);
  const int64_t steps = d / 32;
  amx::configure_tiles();
  for (int64_t h0 = 0; h0 < g; h0 += kHeads) {
    const int G = int(g - h0 < kHeads ? g - h0 : kHeads);
    const int64_t head0 = kv_head * g + h0;
    std::fill(w.q, w.q + steps * kTileWords, 0u);
    for (int h = 0; h < G; ++h) {
      const uint16_t* q = static_cast<const uint16_t*>(a.q) + (s * a.nh + head0 + h) * d;
      for (int64_t i = 0; i < d / 2; ++i) std::memcpy(w.q + i * kHeads + h, q + 2 * i, 4);
    }
    std::fill(w.acc, w.acc + kHeads * dv, 0.0f);
    __m512 m = neg_inf, l = _mm512_setzero_ps();
    for (int64_t j0 = begin / 16 * 16; j0 < end; j0 += kKeys) {
      const auto valid = [&](int64_t j) { return j0 + j >= begin && j0 + j < end; };
      const int tiles = j0 + 16 < end ? 2 : 1;
      // each key tile's first K and V rows, and the next step's, whose rows go to L2 during the softmax (rows a
      // KV-head stride apart in scattered blocks: the hardware prefetcher does not follow them)
      const uint16_t* k_rows[2] = {rows.key(j0), nullptr};
      const uint16_t* v_rows[2] = {rows.value(j0), nullptr};
      if (tiles == 2) {
        k_rows[1] = rows.key(j0 + 16);
        v_rows[1] = rows.value(j0 + 16);
      }
      const int64_t next_keys = std::min<int64_t>(kKeys, std::max<int64_t>(0, end - j0 - kKeys));
      const char* next_k[2] = {nullptr, nullptr};
      const char* next_v[2] = {nullptr, nullptr};
      for (int t = 0; 16 * t < next_keys; ++t) {
        next_k[t] = reinterpret_cast<const char*>(rows.key(j0 + kKeys + 16 * t));
        next_v[t] = reinterpret_cast<const char*>(rows.value(j0 + kKeys + 16 * t));
      }
      // scores: tile 0 the first 16 keys, tile 1 the next
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t i = 0; i < steps; ++i) {
        _tile_loadd(6, w.q + i * kTileWords, 64);
        _tile_loadd(4, k_rows[0] + 32 * i, 2 * rows.k_slot);
        _tile_dpbf16ps(0, 4, 6);
        if (tiles == 2) {
          _tile_loadd(5, k_rows[1] + 32 * i, 2 * rows.k_slot);
          _tile_dpbf16ps(1, 5, 6);
        }
      }
      _tile_stored(0, w.scores, 64);
      _tile_stored(1, w.scores + 16 * kHeads, 64);
      // softmax over the step's keys, every head at once
      __m512 row[kKeys];
      __m512 tile_max = neg_inf;
      for (int j = 0; j < kKeys; ++j) {
        row[j] = valid(j) ? _mm512_mul_ps(_mm512_load_ps(w.scores + j * kHeads), scale) : neg_inf;
        tile_max = _mm512_max_ps(tile_max, row[j]);
      }
      const __m512 m_new = _mm512_max_ps(m, tile_max);
      const __m512 correction = (__m512)simd::vexp((simd::f32x16)_mm512_sub_ps(m, m_new));  // ~0 on the first step
      m = m_new;
      __m512 sum = _mm512_setzero_ps();
      for (int t = 0; t < tiles; ++t) {
        __m512 weights[16];  // key j's weights of the 16 heads, rounded to bf16 (as float32 bits)
        for (int j = 0; j < 16; ++j) {
          const int64_t key = 16 * t + j;
          if (key < next_keys) {
            const char* k_next = next_k[t] + j * 2 * rows.k_slot;
            const char* v_next = next_v[t] + j * 2 * rows.v_slot;
            for (int64_t b = 0; b < 2 * d; b += 64) _mm_prefetch(k_next + b, _MM_HINT_T1);
            for (int64_t b = 0; b < 2 * dv; b += 64) _mm_prefetch(v_next + b, _MM_HINT_T1);
          }
          const __m512 p = valid(key) ? (__m512)simd::vexp((simd::f32x16)_mm512_sub_ps(row[key], m_new))
                                      : _mm512_setzero_ps();
          weights[j] = _mm512_castsi512_ps(
              _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p)), 16));
          sum = _mm512_add_ps(sum, weights[j]);
        }
        transpose16(weights);  // row h: head h's weights of the 16 keys
        uint32_t* high = w.p + (2 * t + 1) * kTileWords;
        uint32_t* low = w.p + 2 * t * kTileWords;
        for (int h = 0; h < kHeads; ++h) {
          const __m512i x = _mm512_castps_si512(weights[h]);
          _mm512_store_si512(high + 16 * h, x);
          _mm512_store_si512(low + 16 * h, _mm512_srli_epi32(x, 16));
        }
      }
      l = _mm512_fmadd_ps(l, correction, sum);
      // what earlier steps summed, rescaled where the running maximum rose
      alignas(64) float c[kHeads];
      _mm512_store_ps(c, correction);
      for (__mmask16 rose = _mm512_cmp_ps_mask(correction, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) & ((1u << G) - 1);
           rose; rose &= rose - 1) {
        float* acc = w.acc + __builtin_ctz(rose) * dv;
        const __m512 f = _mm512_set1_ps(c[__builtin_ctz(rose)]);
        for (int64_t i = 0; i < dv; i += 16) _mm512_storeu_ps(acc + i, _mm512_mul_ps(_mm512_loadu_ps(acc + i), f));
      }
      // value rows: in place, or a tile with keys outside the range copied beside zero rows
      const uint16_t* values[2];
      int64_t value_stride[2];
      for (int t = 0; t < tiles; ++t) {
        values[t] = v_rows[t];
        value_stride[t] = 2 * rows.v_slot;
        if (valid(16 * t) && valid(16 * t + 15)) continue;
        uint16_t* copy = reinterpret_cast<uint16_t*>(w.v) + t * 16 * dv;
        for (int j = 0; j < 16; ++j) {
          if (valid(16 * t + j)) std::memcpy(copy + j * dv, v_rows[t] + j * rows.v_slot, 2 * dv);
          else std::memset(copy + j * dv, 0, 2 * dv);
        }
        values[t] = copy;
        value_stride[t] = 2 * dv;
      }
      // values: per 32 columns, the even ones into tile 0 and the odd into tile 1
      _tile_loadd(2, w.p, 64);
      _tile_loadd(3, w.p + kTileWords, 64);
      if (tiles == 2) {
        _tile_loadd(4, w.p + 2 * kTileWords, 64);
        _tile_loadd(5, w.p + 3 * kTileWords, 64);
      }
      for (int64_t c32 = 0; c32 < dv; c32 += 32) {
        _tile_loadd(0, w.acc + c32, 4 * dv);
        _tile_loadd(1, w.acc + c32 + 16, 4 * dv);
        _tile_loadd(6, values[0] + c32, value_stride[0]);
        _tile_dpbf16ps(0, 2, 6);
        _tile_dpbf16ps(1, 3, 6);
        if (tiles == 2) {
          _tile_loadd(7, values[1] + c32, value_stride[1]);
          _tile_dpbf16ps(0, 4, 7);
          _tile_dpbf16ps(1, 5, 7);
        }
        _tile_stored(0, w.acc + c32, 4 * dv);
        _tile_stored(1, w.acc + c32 + 16, 4 * dv);
      }
    }
    alignas(64) float m_out[kHeads], l_out[kHeads];
    _mm512_store_ps(m_out, m);
    _mm512_store_ps(l_out, l);
    for (int h = 0; h < G; ++h) {
      float denom = l_out[h];
      if (a.sinks) denom += std::exp(a.sinks[head0 + h] - m_out[h]);
      const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;  // no keys and no sink: zeros
      avx512bf16_store_attention_row(w.acc + h * dv, dv, inv, kEvenOddColumns,
                                     static_cast<uint16_t*>(a.out) + (s * a.nh + head0 + h) * dv);
    }
  }
  _tile_release();
}

}  // namespace

const char* const kAmxAttentionScope =
    "takes bf16 caches with head sizes a multiple of 32 and block sizes a multiple of 16; the rest run "
    "x86-avx512bf16's kernel";

void amx_decode_attention(const DecodeAttentionArgs& a, int64_t s, int64_t kv_head) {
  if (a.dtype == DType::kBFloat16 && a.d % 32 == 0 && a.dv % 32 == 0 && a.block_size % 16 == 0)
    attention_rows(a, s, kv_head);
  else
    avx512bf16_decode_attention(a, s, kv_head);
}

}  // namespace cpumoe
