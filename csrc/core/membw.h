// Memory read bandwidth of this machine, measured the way the decode kernels read weights: every worker
// streams its own contiguous slice of one large buffer with the widest loads available.
#pragma once
#include <cstdint>

#include "fused_moe.h"

namespace cpumoe {

struct BandwidthResult {
  double best_gbps;     // best repetition
  double median_gbps;
};

BandwidthResult measure_read_bandwidth(int64_t bytes, int repetitions, const Parallel& parallel);

}  // namespace cpumoe
