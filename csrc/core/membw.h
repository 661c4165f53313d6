// Memory read bandwidth of this machine, measured the way the decode kernels read weights: every worker
// streams its own contiguous slice of one large buffer with the widest loads available.
#pragma once
#include <cstdint>

#include "fused_moe.h"

namespace cpumoe {

// Owns a buffer (first touched by the worker that reads each slice) and times one full read of it per
// call; a benchmark interleaves read_gbps() with the calls it measures, so both see the same machine state
// (and the read leaves no weights in the caches).
class ReadBandwidthProbe {
 public:
  ReadBandwidthProbe(int64_t bytes, const Parallel& parallel);
  ~ReadBandwidthProbe();
  ReadBandwidthProbe(const ReadBandwidthProbe&) = delete;
  ReadBandwidthProbe& operator=(const ReadBandwidthProbe&) = delete;
  double read_gbps();
  int64_t bytes() const { return slice_ * workers_; }

 private:
  void each_worker(const std::function<void(int)>& body);
  Parallel parallel_;
  int workers_;
  int64_t slice_;
  char* buf_;
  uint64_t sink_ = 0;
};

struct BandwidthResult {
  double best_gbps;
  double median_gbps;
};

BandwidthResult measure_read_bandwidth(int64_t bytes, int repetitions, const Parallel& parallel);

}  // namespace cpumoe
