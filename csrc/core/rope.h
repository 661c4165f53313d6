// RoPE (rotate_half, as Llama/Qwen) on a step's queries and keys in place, then the keys and values into their
// paged-cache slots: what ~12 small torch ops did per attention layer (cpumoe/models/blocks.py apply_rotary and
// two index_put). Rounds like those ops: in bf16/f16, x*cos, rot(x)*sin and their sum are each rounded to the
// dtype, so the result is bit for bit torch's.
//   q [T][nh][d], k [T][nkv][d], v [T][nkv][dv], cos/sin [T][d] (the token's angles, halves repeated);
//   x[i] <- x[i] cos[i] - x[i + d/2] sin[i],  x[i + d/2] <- x[i + d/2] cos[i + d/2] + x[i] sin[i + d/2]
//   k_cache/v_cache [slots][nkv][d | dv]: row slot[t] <- k[t], v[t]
// With q_norm and k_norm (weights [d], Qwen3's per-head q/k RMSNorm), each head row of q and k is first
// RMS-normalized as rms_norm does it (Llama order: the normalized row rounded, then the weight), bit for bit.
#pragma once
#include <cstdint>

#include "fused_moe.h"
#include "types.h"

namespace cpumoe {

struct RopeCacheArgs {
  void* q = nullptr;                  // [tokens][nh][d], rotated in place
  void* k = nullptr;                  // [tokens][nkv][d], rotated in place
  const void* v = nullptr;            // [tokens][nkv][dv]
  const void* cos = nullptr;          // [tokens][d]
  const void* sin = nullptr;          // [tokens][d]
  void* k_cache = nullptr;            // [slots][nkv][d]
  void* v_cache = nullptr;            // [slots][nkv][dv]
  const int64_t* slots = nullptr;     // [tokens]
  const void* q_norm = nullptr;       // [d] or none: RMSNorm weight of each q head row, before RoPE
  const void* k_norm = nullptr;       // [d] or none: the same for k (given together with q_norm)
  float norm_eps = 1e-6f;
  int64_t tokens = 0, nh = 0, nkv = 0, d = 0, dv = 0;
  DType dtype = DType::kBFloat16;
};

void rope_and_cache(const RopeCacheArgs& args, const Parallel& parallel);

}  // namespace cpumoe
