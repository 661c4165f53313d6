#include "membw.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_features.h"

namespace cpumoe {

BandwidthResult measure_read_bandwidth(int64_t bytes, int repetitions, const Parallel& parallel) {
  const int workers = std::max(parallel.workers, 1);
  const int64_t slice = round_up(bytes / workers, 4096);
  bytes = slice * workers;
  char* buf = static_cast<char*>(std::aligned_alloc(4096, bytes));
  if (!buf) throw std::bad_alloc();
  auto each_worker = [&](const std::function<void(int)>& body) {
    if (workers == 1 || !parallel.run) body(0);
    else parallel.run(workers, body);
  };
  // First touch by the worker that will read the slice (NUMA placement), with non-zero data.
  each_worker([&](int w) { std::memset(buf + w * slice, 1 + w, slice); });

  uint64_t (*read)(const void*, int64_t) = stream_read_generic;
#if defined(__x86_64__)
  if (cpu_has("avx512f")) read = stream_read_avx512;
#endif
  std::vector<double> gbps;
  std::vector<uint64_t> sink(workers * 8);
  for (int rep = 0; rep < repetitions + 1; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    each_worker([&](int w) { sink[w * 8] += read(buf + w * slice, slice); });
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) gbps.push_back(double(bytes) / s / 1e9);  // the first pass warms TLBs and threads
  }
  std::free(buf);
  volatile uint64_t keep = 0;
  for (uint64_t v : sink) keep = keep + v;
  std::sort(gbps.begin(), gbps.end());
  return {gbps.back(), gbps[gbps.size() / 2]};
}

}  // namespace cpumoe
