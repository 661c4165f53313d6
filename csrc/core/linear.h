// A dense linear layer on the experts' kernels: y[M][N] = x[M][K] . w[N][K]^T (+ bias), with w packed once
// as a single "w2" (pack_w2 with H = N, I = K), so every backend's w2 tile serves it. It exists because at
// decode sizes the projections around the experts are weight streams too, and the tiles stream near the
// memory bandwidth where a general GEMM library does not.
#pragma once
#include <cstdint>

#include "fused_moe.h"

namespace cpumoe {

struct LinearArgs {
  const KernelTable* kernels = nullptr;  // dense weights' tiles (unused when quant is set)
  const QuantKernel* quant = nullptr;    // set: w is quant.h blocks of `format` (one expert's w2 of H = N, I = K)
  QuantFormat format = QuantFormat::kInt8W8A8;
  int64_t group = 0;                     // the tiles' group (quant_packed_shape(...).group)
  bool symmetric = false;                // int4: blocks without zero points (quant.h)
  DType dtype = DType::kBFloat16;        // of x and out
  int64_t M = 0, K = 0, N = 0;
  const void* x = nullptr;      // [M][K]
  const void* w = nullptr;      // pack_w2 layout of [N][K] (one expert)
  const float* bias = nullptr;  // [N] or nullptr
  void* out = nullptr;          // [M][N], dtype
};

void linear(const LinearArgs& args, const Parallel& parallel);

}  // namespace cpumoe
