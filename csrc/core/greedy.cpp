#include "greedy.h"

#include <algorithm>
#include <cmath>
#if defined(__SSE2__)
#include <emmintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace cpumoe {
namespace {

// Two passes over the row: its maximum, with a NaN check beside it (a NaN fails every comparison), then the first
// index that holds the maximum. On x86 both run 16 logits a step in SSE registers (the baseline ISA; GCC would not
// vectorize either loop by itself): one pass carrying each lane's index ran at 1.1 ns a logit, 39 us for 32768
// logits and 175 us for Qwen3's 151936, a row a step. On AArch64 the same in NEON.
#if defined(__SSE2__)
// The maximum of x's whole 16-logit blocks, and whether they hold a NaN; k moves past them.
float max_of_blocks(const float* x, int64_t vocab, int64_t& k, bool& nan) {
  __m128 m[4], unordered = _mm_setzero_ps();
  for (auto& v : m) v = _mm_set1_ps(-INFINITY);
  for (; k + 16 <= vocab; k += 16)
    for (int j = 0; j < 4; ++j) {
      const __m128 v = _mm_loadu_ps(x + k + 4 * j);
      unordered = _mm_or_ps(unordered, _mm_cmpunord_ps(v, v));
      m[j] = _mm_max_ps(v, m[j]);  // v > m ? v : m
    }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(m[0], m[1]), _mm_max_ps(m[2], m[3])));
  nan = _mm_movemask_ps(unordered) != 0;
  return std::max(std::max(lanes[0], lanes[1]), std::max(lanes[2], lanes[3]));
}

// The start of the first whole 16-logit block holding top, or of the tail after the blocks when none does.
int64_t first_block_holding(const float* x, int64_t vocab, float top) {
  const __m128 t = _mm_set1_ps(top);
  int64_t k = 0;
  for (; k + 16 <= vocab; k += 16) {
    __m128 eq = _mm_setzero_ps();
    for (int j = 0; j < 4; ++j) eq = _mm_or_ps(eq, _mm_cmpeq_ps(_mm_loadu_ps(x + k + 4 * j), t));
    if (_mm_movemask_ps(eq)) break;
  }
  return k;
}
#elif defined(__aarch64__)
// The same on NEON (every AArch64 core has it): four q registers a 16-logit step.
float max_of_blocks(const float* x, int64_t vocab, int64_t& k, bool& nan) {
  float32x4_t m[4];
  uint32x4_t ordered = vdupq_n_u32(~0u);  // lanes stay all-ones while every value equals itself (no NaN)
  for (auto& v : m) v = vdupq_n_f32(-INFINITY);
  for (; k + 16 <= vocab; k += 16)
    for (int j = 0; j < 4; ++j) {
      const float32x4_t v = vld1q_f32(x + k + 4 * j);
      ordered = vandq_u32(ordered, vceqq_f32(v, v));
      m[j] = vmaxq_f32(v, m[j]);  // a NaN propagates into it; such a row has no token anyway
    }
  nan = vminvq_u32(ordered) == 0;
  return vmaxvq_f32(vmaxq_f32(vmaxq_f32(m[0], m[1]), vmaxq_f32(m[2], m[3])));
}

int64_t first_block_holding(const float* x, int64_t vocab, float top) {
  const float32x4_t t = vdupq_n_f32(top);
  int64_t k = 0;
  for (; k + 16 <= vocab; k += 16) {
    uint32x4_t eq = vdupq_n_u32(0);
    for (int j = 0; j < 4; ++j) eq = vorrq_u32(eq, vceqq_f32(vld1q_f32(x + k + 4 * j), t));
    if (vmaxvq_u32(eq)) break;
  }
  return k;
}
#else  // the scalar loops of row_argmax take the whole row
float max_of_blocks(const float*, int64_t, int64_t&, bool& nan) {
  nan = false;
  return -INFINITY;
}

int64_t first_block_holding(const float*, int64_t, float) { return 0; }
#endif

int64_t row_argmax(const float* __restrict x, int64_t vocab) {
  if (vocab <= 0) return kNoToken;
  int64_t k = 0;
  bool nan = false;
  float top = max_of_blocks(x, vocab, k, nan);
  for (; k < vocab; ++k) nan |= x[k] != x[k], top = x[k] > top ? x[k] : top;
  if (nan) return kNoToken;
  for (k = first_block_holding(x, vocab, top); k < vocab; ++k)  // the first of equal maxima, as torch.argmax
    if (x[k] == top) return k;                                  // (-inf everywhere: index 0)
  return kNoToken;  // unreachable: top is one of the row's values
}

}  // namespace

void greedy_tokens(const float* logits, int64_t rows, int64_t vocab, int64_t* out, const Parallel& parallel) {
  auto row = [&](int64_t r) { out[r] = row_argmax(logits + r * vocab, vocab); };
  if (rows * vocab < (int64_t(1) << 18)) {  // a decode step's one row: the pool's hand-off costs more than it saves
    for (int64_t r = 0; r < rows; ++r) row(r);
    return;
  }
  parallel_items(parallel, rows, row);
}

}  // namespace cpumoe
