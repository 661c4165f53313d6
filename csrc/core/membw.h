// Memory read bandwidth of this machine, measured the way the decode kernels read weights: the kernels' workers
// (their Parallel) stream contiguous chunks of one large buffer with the widest loads available, claiming chunks
// as they claim a kernel's items (fused_moe.h's parallel_items), so a worker that starts late cannot leave a chunk
// unread. Not torch's OpenMP team: after a parallel region its threads spin on their cores for milliseconds, and
// the kernel calls a benchmark times right after the read ran with one core shared (the int4 qwen3-30b-a3b layer
// at M = 1: 1.06-1.09 ms right after the read, 0.87-0.98 ms after a 30 ms pause; on the pool, no difference).
#pragma once
#include <cstdint>

#include "fused_moe.h"

namespace cpumoe {

// Owns a buffer (on huge pages, as the packed weights are) and times one full read of it per
// call; a benchmark interleaves read_gbps() with the calls it measures, so both see the same machine state
// (and the read leaves no weights in the caches).
class ReadBandwidthProbe {
 public:
  ReadBandwidthProbe(int64_t bytes, const Parallel& parallel);
  ~ReadBandwidthProbe();
  ReadBandwidthProbe(const ReadBandwidthProbe&) = delete;
  ReadBandwidthProbe& operator=(const ReadBandwidthProbe&) = delete;
  double read_gbps();
  int64_t bytes() const { return chunk_ * chunks_; }

 private:
  static constexpr int kChunksPerWorker = 16;
  Parallel parallel_;
  int64_t chunks_;
  int64_t chunk_;
  char* buf_;
  uint64_t sink_ = 0;
};

struct BandwidthResult {
  double best_gbps;
  double median_gbps;
};

BandwidthResult measure_read_bandwidth(int64_t bytes, int repetitions, const Parallel& parallel);

}  // namespace cpumoe
