// RMSNorm over the last dimension, as transformers computes it (cpumoe/models/blocks.py rms_norm_reference):
//   r = 1 / sqrt(mean(x^2) + eps) in float32;
//   Llama/Qwen order:  y = dtype(weight * dtype(x * r))   (the normalized row rounded, then the weight)
//   gpt-oss order:     y = dtype(weight * (x * r))        (weight_in_float: the weight in float32, then the cast)
// One fused pass per row where torch runs ~7 ops; rows are split over the thread pool when there are many.
// With a residual, the row is first x + residual rounded to the dtype (torch's add), written to `sum`, then
// normalized: the residual add before a pre-norm, in the same pass (add_rms_norm).
#pragma once
#include <cmath>
#include <cstdint>

#include "fused_moe.h"
#include "types.h"

namespace cpumoe {

struct RmsNormArgs {
  const void* x = nullptr;       // [rows][dim], dtype
  const void* weight = nullptr;  // [dim], dtype
  void* out = nullptr;           // [rows][dim], dtype
  const void* residual = nullptr;  // [rows][dim], dtype, or none
  void* sum = nullptr;           // [rows][dim], dtype: x + residual (with a residual)
  int64_t rows = 0, dim = 0;
  float eps = 1e-6f;
  DType dtype = DType::kBFloat16;
  bool weight_in_float = false;
};

void rms_norm(const RmsNormArgs& args, const Parallel& parallel);

// 1 / sqrt(mean(x^2) + eps) of row[0:dim], summed in 16 running sums then their total: every RMSNorm of cpumoe
// (rms_norm, rope_and_cache's q/k norm) sums in this one order, so they round alike.
inline float inv_rms(const float* __restrict row, int64_t dim, float eps) {
  float partial[16] = {};  // 16 running sums, so the loop vectorizes
  int64_t k = 0;
  for (; k + 16 <= dim; k += 16)
    for (int j = 0; j < 16; ++j) partial[j] += row[k + j] * row[k + j];
  float sum = 0.0f;
  for (int j = 0; j < 16; ++j) sum += partial[j];
  for (; k < dim; ++k) sum += row[k] * row[k];
  return 1.0f / std::sqrt(sum / float(dim) + eps);
}

}  // namespace cpumoe
