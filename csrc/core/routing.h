// Top-k routing in one pass per token, for the decode step: router logits [M][E] -> weights float32 [M][k],
// ids int32 [M][k]. The same maths as cpumoe/routing.py's select_experts without expert groups (that module
// documents each model's settings and keeps the grouped and custom modes):
//   scores = softmax(logits) | sigmoid(logits), float32;  choice = logits, or scores + bias when a bias is given
//   ids = the k largest choices, largest first, equal choices by lower expert id; NaN counts as the largest
//   weights = scores[ids], divided by (their sum + 1e-20) when renormalizing, then times scale.
#pragma once
#include <cstdint>

#include "fused_moe.h"
#include "types.h"

namespace cpumoe {

struct RoutingArgs {
  const void* logits = nullptr;  // [M][E], dtype
  DType dtype = DType::kFloat32;
  int64_t M = 0, E = 0, top_k = 0;
  bool sigmoid = false;          // scoring: sigmoid instead of softmax
  bool renormalize = false;
  const float* bias = nullptr;   // [E] selection bias (DeepSeek-V3's e_score_correction_bias) or nullptr
  float scale = 1.0f;            // routed_scaling_factor
  float* weights = nullptr;      // [M][top_k]
  int32_t* ids = nullptr;        // [M][top_k]
};

void route(const RoutingArgs& args, const Parallel& parallel);

}  // namespace cpumoe
