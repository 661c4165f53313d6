// Decode attention over the paged KV cache: one query token per sequence against its cached keys, every
// (sequence, KV head) pair an item for the thread pool. The maths of cpumoe/models/blocks.py's
// decode_attention_reference: softmax(scale * q . K) V over keys [key_begin, key_end) of each sequence's block
// table, in float32, with an optional sink logit per head in the denominator (gpt-oss).
#pragma once
#include <string>

#include "fused_moe.h"
#include "kernels.h"

namespace cpumoe {

// The first available backend (fastest first) whose unit has an attention kernel; *name gets its name.
const KernelTable& attention_kernel(std::string* name = nullptr);

// Runs `kernel`'s attention (one with an attention kernel) over every (sequence, KV head).
void decode_attention(const DecodeAttentionArgs& args, const KernelTable& kernel, const Parallel& parallel);

}  // namespace cpumoe
