// Causal attention of one prefill chunk over its sequence's keys in one pass (cpumoe/attention/prefill.py's maths,
// flash-style: the scores never leave the core's caches):
//   out[h][t] = sum_j p[h][t][j] v[h / g][j],  p = softmax_j(scale * q[h][t] . k[h / g][j]) over the keys query t
//   sees, with a sink logit per head joining the denominator only (gpt-oss).
// Query t sits at position L - T + t among the L keys (the chunk is the last T positions of its context); it sees
// key j when j <= its position and (window == 0 or j > position - window). Scores, softmax and sums in float32;
// the probabilities are rounded to bf16 before they weight the values, as the blocked torch maths rounds them.
// A row holding a NaN or +inf score comes out NaN, as torch's softmax gives it.
#pragma once
#include <cstdint>

#include "fused_moe.h"
#include "types.h"

namespace cpumoe {

struct PrefillAttentionArgs {
  const void* q = nullptr;  // [nh][T][d], dtype; rows of d contiguous, the strides below between them
  const void* k = nullptr;  // [nkv][L][d]
  const void* v = nullptr;  // [nkv][L][dv]
  void* out = nullptr;      // [T][nh][dv], contiguous
  int64_t q_head_stride = 0, q_token_stride = 0;  // elements
  int64_t k_head_stride = 0, k_token_stride = 0;
  int64_t v_head_stride = 0, v_token_stride = 0;
  int64_t T = 0, L = 0, nh = 0, nkv = 0, d = 0, dv = 0;
  int64_t window = 0;            // 0: none
  const float* sinks = nullptr;  // [nh] or none
  float scale = 1.0f;
  DType dtype = DType::kBFloat16;
};

// Why the fastest backend here with a prefill attention kernel cannot run these arguments, or nullptr when it can.
const char* prefill_attention_unsupported(const PrefillAttentionArgs& args);
// The backend that runs prefill_attention here ("" when none).
const char* prefill_attention_backend();
void prefill_attention(const PrefillAttentionArgs& args, const Parallel& parallel);

}  // namespace cpumoe
