// The softmax of a prefill chunk's attention scores (cpumoe/attention/prefill.py), in one pass over each row where
// torch ran five ops (a float32 copy, the scale, the causal mask, softmax, the cast back):
//   x[j] = float(scores[j]) * scale, or -inf where key j is hidden from the row's query;
//   probs[j] = exp(x[j] - m) / (sum_j exp(x[j] - m) + exp(sink - m)),  m = max(max_j x[j], sink)
// rounded to the scores' dtype. Row i of head h is the query at position first_query + i; key j sits at position
// first_key + j and is seen when first_key + j <= position and (window == 0 or first_key + j > position - window).
// sink: a per-head logit that joins the denominator only (gpt-oss), or none. float32 maths throughout.
#pragma once
#include <cstdint>

#include "fused_moe.h"
#include "types.h"

namespace cpumoe {

struct CausalSoftmaxArgs {
  const void* scores = nullptr;  // [heads][queries][keys], dtype
  void* probs = nullptr;         // [heads][queries][keys], dtype
  const float* sinks = nullptr;  // [heads] or none
  int64_t heads = 0, queries = 0, keys = 0;
  int64_t first_query = 0, first_key = 0, window = 0;  // window 0: none
  float scale = 1.0f;
  DType dtype = DType::kBFloat16;
};

void causal_softmax(const CausalSoftmaxArgs& args, const Parallel& parallel);

}  // namespace cpumoe
