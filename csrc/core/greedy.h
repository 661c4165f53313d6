// Greedy sampling: each row's argmax over float32 logits, as torch.argmax picks it (the first of equal maxima), and
// kNoToken for a row that holds a NaN (no token is "the most likely" there; torch.argmax would land on the NaN).
// Two passes a row (greedy.cpp) and one call a step, where the sampler ran argmax, gather, isnan and masked_fill:
// four torch ops, each run cold after a decode step's weights have streamed through the caches.
#pragma once
#include <cstdint>

#include "fused_moe.h"

namespace cpumoe {

constexpr int64_t kNoToken = -1;

// logits [rows][vocab] -> out [rows]; rows are split over the pool when there are several.
void greedy_tokens(const float* logits, int64_t rows, int64_t vocab, int64_t* out, const Parallel& parallel);

}  // namespace cpumoe
