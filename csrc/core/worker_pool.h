// A pool whose helpers join a parallel run only if they are free in time, and whose caller never waits for one
// that has not started.
//
// An OpenMP region ends at a barrier that every thread of the team must reach, so one thread the OS has moved off
// its core (another process, the server's own threads) stalls the whole region for a time slice; a decode step
// is ~40 such regions. Here the caller runs body(0) at once, helpers that wake in time run body(1..), and the
// caller waits only for those that did start. Work handed out from a shared counter (parallel_items) is then
// done by whoever is on a core, and a busy core costs its share of the work, not a stall per kernel.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace cpumoe {

class WorkerPool {
 public:
  WorkerPool() = default;
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // body(0) on the calling thread and body(w), 0 < w < workers, on each helper that is free in time; returns when
  // all that started are done. A call made while another is running (another thread) runs body(0) alone.
  void run(int workers, const std::function<void(int)>& body);

  // The process's pool (made anew in a forked child, whose helpers did not survive the fork).
  static WorkerPool& shared();

 private:
  void grow(int helpers);
  void helper_loop(int index);

  // state: bits 63..32 the run's generation, bit 31 set while helpers may join, bits 30..0 helpers inside body.
  static constexpr uint64_t kOpen = uint64_t(1) << 31;
  static constexpr uint64_t kJoinedMask = kOpen - 1;
  std::atomic<uint64_t> state_{0};
  std::atomic<const std::function<void(int)>*> body_{nullptr};
  std::atomic<int> workers_{0};
  std::atomic<bool> busy_{false};

  std::mutex mutex_;               // guards sleeping and growing
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> helpers_;
};

}  // namespace cpumoe
