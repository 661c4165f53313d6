#include "membw.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "cpu_features.h"
#include "memory.h"

namespace cpumoe {

ReadBandwidthProbe::ReadBandwidthProbe(int64_t bytes, const Parallel& parallel)
    : parallel_(parallel), workers_(std::max(parallel.workers, 1)) {
  slice_ = round_up(std::max<int64_t>(bytes / workers_, 4096), 4096);
  buf_ = static_cast<char*>(std::aligned_alloc(kHugePageBytes, round_up(slice_ * workers_, kHugePageBytes)));
  if (!buf_) throw std::bad_alloc();
  advise_huge_pages(buf_, slice_ * workers_);  // as the packed weights are
  each_worker([&](int w) { std::memset(buf_ + w * slice_, 1 + w, slice_); });
  read_gbps();  // warms the threads and the TLBs
}

ReadBandwidthProbe::~ReadBandwidthProbe() { std::free(buf_); }

void ReadBandwidthProbe::each_worker(const std::function<void(int)>& body) {
  if (workers_ == 1 || !parallel_.run) body(0);
  else parallel_.run(workers_, body);
}

double ReadBandwidthProbe::read_gbps() {
  uint64_t (*read)(const void*, int64_t) = stream_read_generic;
#if defined(__x86_64__)
  if (cpu_has("avx512f")) read = stream_read_avx512;
  else if (cpu_has("avx2")) read = stream_read_avx2;
#endif
  std::vector<uint64_t> sums(workers_ * 8);  // one cache line per worker
  auto t0 = std::chrono::steady_clock::now();
  each_worker([&](int w) { sums[w * 8] = read(buf_ + w * slice_, slice_); });
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (uint64_t v : sums) sink_ ^= v;
  return double(bytes()) / s / 1e9;
}

BandwidthResult measure_read_bandwidth(int64_t bytes, int repetitions, const Parallel& parallel) {
  ReadBandwidthProbe probe(bytes, parallel);
  std::vector<double> gbps;
  for (int rep = 0; rep < std::max(repetitions, 1); ++rep) gbps.push_back(probe.read_gbps());
  std::sort(gbps.begin(), gbps.end());
  return {gbps.back(), gbps[gbps.size() / 2]};
}

}  // namespace cpumoe
