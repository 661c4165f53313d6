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
    : parallel_(parallel), chunks_(kChunksPerWorker * std::max(parallel.workers, 1)) {
  chunk_ = round_up(std::max<int64_t>((bytes + chunks_ - 1) / chunks_, 4096), 4096);
  buf_ = static_cast<char*>(std::aligned_alloc(kHugePageBytes, round_up(chunk_ * chunks_, kHugePageBytes)));
  if (!buf_) throw std::bad_alloc();
  advise_huge_pages(buf_, chunk_ * chunks_);  // as the packed weights are
  parallel_items(parallel_, chunks_, [&](int64_t c) { std::memset(buf_ + c * chunk_, 1 + int(c % 255), chunk_); });
  read_gbps();  // warms the threads and the TLBs
}

ReadBandwidthProbe::~ReadBandwidthProbe() { std::free(buf_); }

double ReadBandwidthProbe::read_gbps() {
  uint64_t (*read)(const void*, int64_t) = stream_read_generic;
#if defined(__x86_64__)
  if (cpu_has("avx512f")) read = stream_read_avx512;
  else if (cpu_has("avx2")) read = stream_read_avx2;
#endif
  std::vector<uint64_t> sums(chunks_ * 8);  // one cache line per chunk
  auto t0 = std::chrono::steady_clock::now();
  parallel_items(parallel_, chunks_, [&](int64_t c) { sums[c * 8] = read(buf_ + c * chunk_, chunk_); });
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
