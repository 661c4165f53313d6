// RMSNorm over the last dimension, as transformers computes it (cpumoe/models/blocks.py rms_norm_reference):
//   r = 1 / sqrt(mean(x^2) + eps) in float32;
//   Llama/Qwen order:  y = dtype(weight * dtype(x * r))   (the normalized row rounded, then the weight)
//   gpt-oss order:     y = dtype(weight * (x * r))        (weight_in_float: the weight in float32, then the cast)
// One fused pass per row where torch runs ~7 ops; rows are split over the thread pool when there are many.
#pragma once
#include <cstdint>

#include "fused_moe.h"
#include "types.h"

namespace cpumoe {

struct RmsNormArgs {
  const void* x = nullptr;       // [rows][dim], dtype
  const void* weight = nullptr;  // [dim], dtype
  void* out = nullptr;           // [rows][dim], dtype
  int64_t rows = 0, dim = 0;
  float eps = 1e-6f;
  DType dtype = DType::kBFloat16;
  bool weight_in_float = false;
};

void rms_norm(const RmsNormArgs& args, const Parallel& parallel);

}  // namespace cpumoe
