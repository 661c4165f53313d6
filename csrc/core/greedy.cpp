#include "greedy.h"

#include <algorithm>
#include <cmath>

namespace cpumoe {
namespace {

// 16 running maxima with the first index of each, so the loop vectorizes; the row's maximum is then the largest of
// them at the smallest index. A NaN fails every comparison, so it is looked for apart (x != x), in the same pass.
int64_t row_argmax(const float* __restrict x, int64_t vocab) {
  constexpr int kLanes = 16;
  if (vocab <= 0) return kNoToken;
  float best[kLanes];
  int32_t at[kLanes];
  bool nan = false;
  for (int j = 0; j < kLanes; ++j) {
    best[j] = -INFINITY;
    at[j] = int32_t(vocab);  // no index yet: loses every tie
  }
  int64_t k = 0;
  for (; k + kLanes <= vocab; k += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float v = x[k + j];
      nan |= v != v;
      const bool more = v > best[j] || (v == best[j] && at[j] == int32_t(vocab));
      best[j] = more ? v : best[j];
      at[j] = more ? int32_t(k + j) : at[j];
    }
  float top = -INFINITY;
  int64_t index = vocab;
  for (int j = 0; j < kLanes; ++j)
    if (best[j] > top || (best[j] == top && at[j] < index)) top = best[j], index = at[j];
  for (; k < vocab; ++k) {
    nan |= x[k] != x[k];
    if (x[k] > top || (x[k] == top && k < index)) top = x[k], index = k;
  }
  if (nan) return kNoToken;
  return index;
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
