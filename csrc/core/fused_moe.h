// The fused MoE experts driver:
//
//   topk_ids/weights -> sort (token, slot) rows by local expert (counting sort; expert_map drops experts
//   not on this shard) -> w13 tiles with the activation fused (rows x 32 intermediate columns) ->
//   w2 tiles scaled by the router weight (rows x 64 hidden columns, float32) -> combine: each token sums
//   its k rows in slot order.
//
// Work is split into (expert, row chunk, block) items pulled from an atomic counter by every worker, so
// skewed routing still balances; each item writes its own outputs and the combine order is fixed, so the
// result does not depend on the number of threads.
#pragma once
#include <cstdint>
#include <functional>

#include "kernels.h"
#include "quant.h"

namespace cpumoe {

// run(workers, body): body(worker) for workers in [0, workers), concurrently. A pool may leave out helpers that are
// not free in time (the caller always runs body(0)): parallel_items, which hands out items from a shared counter,
// is right either way; code that needs every index to run (the bandwidth probe) must be given a Parallel that
// runs them all.
struct Parallel {
  int workers = 1;
  std::function<void(int, const std::function<void(int)>&)> run;
};

struct FusedMoeArgs {
  const KernelTable* kernels = nullptr;  // dense weights' tiles (unused when quant is set)
  const QuantKernel* quant = nullptr;    // set: w13/w2 are quant.h blocks of `format`
  QuantFormat format = QuantFormat::kInt8W8A8;
  int64_t group13 = 0, group2 = 0;       // quantized: the tiles' group for w13 (K = H) and w2 (K = Ip)
  bool symmetric13 = false, symmetric2 = false;  // int4: w13 / w2 blocks without zero points (quant.h)
  DType dtype = DType::kBFloat16;
  Activation act = Activation::kSilu;
  int64_t M = 0, H = 0, I = 0, topk = 0;  // I: the packed (padded) intermediate size
  int64_t local_experts = 0;    // experts in the packed weights
  int64_t global_experts = 0;   // range of topk_ids (== local_experts without expert_map)
  const void* hidden = nullptr;          // [M][H]
  const float* topk_weights = nullptr;   // [M][topk]
  const int32_t* topk_ids = nullptr;     // [M][topk]
  const int32_t* expert_map = nullptr;   // [global_experts] -> local id or -1; nullptr = identity
  bool apply_router_weight_on_input = false;
  const void* w13 = nullptr;             // packed, see pack.h (quant.h when quantized)
  const void* w2 = nullptr;
  const float* w13_bias = nullptr;       // [E][Ip/32][64] (gate 32, up 32 per block) or nullptr
  const float* w2_bias = nullptr;        // [E][Hp] or nullptr
  void* out = nullptr;                   // [M][H]
};

// Throws std::invalid_argument naming the problem (e.g. an expert id out of range).
void fused_moe(const FusedMoeArgs& args, const Parallel& parallel);

// The calling thread's fused_moe calls that returned so far, and the last one's time from entry to return: what a
// benchmark reads to tell the kernel's time from the Python, dispatch and routing around it.
struct KernelClock {
  int64_t calls = 0;
  int64_t last_ns = 0;
};
KernelClock fused_moe_clock();

// Runs fn(i) for i in [0, n) over all workers, items handed out dynamically.
void parallel_items(const Parallel& parallel, int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace cpumoe
