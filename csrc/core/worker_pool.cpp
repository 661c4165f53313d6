#include "worker_pool.h"

#include <chrono>
#include <pthread.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cpumoe {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long an idle helper watches for the next run before it sleeps: longer than the Python between two kernels of
// a decode step (tens of microseconds), short enough that an idle server gives its cores back at once.
constexpr auto kSpin = std::chrono::microseconds(200);

}  // namespace

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& t : helpers_) t.join();
}

WorkerPool& WorkerPool::shared() {
  // Read once a kernel call, so no lock and no getpid() on that path: a forked child, whose helpers did not survive
  // the fork, drops its copy of the pointer (the old pool is left as it is) and makes a pool of its own on first use.
  static std::atomic<WorkerPool*> pool{nullptr};
  WorkerPool* current = pool.load(std::memory_order_acquire);
  if (current) return *current;
  static std::mutex made;
  std::lock_guard<std::mutex> lock(made);
  static bool registered = [] { return pthread_atfork(nullptr, nullptr, [] { pool.store(nullptr); }) == 0; }();
  (void)registered;
  if (!pool.load(std::memory_order_relaxed)) pool.store(new WorkerPool(), std::memory_order_release);
  return *pool.load(std::memory_order_relaxed);
}

void WorkerPool::grow(int helpers) {
  std::lock_guard<std::mutex> lock(mutex_);
  while (int(helpers_.size()) < helpers) {
    int index = int(helpers_.size()) + 1;
    helpers_.emplace_back([this, index] { helper_loop(index); });
  }
}

void WorkerPool::run(int workers, const std::function<void(int)>& body) {
  bool expected = false;
  if (workers <= 1 || !busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) {
    body(0);
    return;
  }
  if (int(helpers_.size()) < workers - 1) grow(workers - 1);
  body_.store(&body, std::memory_order_relaxed);
  workers_.store(workers, std::memory_order_relaxed);
  uint64_t generation = (state_.load(std::memory_order_relaxed) >> 32) + 1;
  state_.store((generation << 32) | kOpen, std::memory_order_seq_cst);  // publishes body_ and workers_
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(mutex_);   // a helper between its check and its wait sees the new state
    wake_.notify_all();
  }
  body(0);
  state_.fetch_and(~kOpen, std::memory_order_acq_rel);   // no helper joins from here on
  while (state_.load(std::memory_order_acquire) & kJoinedMask) cpu_relax();
  busy_.store(false, std::memory_order_release);
}

void WorkerPool::helper_loop(int index) {
  uint64_t served = 0;   // the last generation this helper saw
  for (;;) {
    auto deadline = std::chrono::steady_clock::now() + kSpin;
    uint64_t s = state_.load(std::memory_order_acquire);
    for (int i = 0; (s >> 32) == served; ++i) {
      if ((i & 255) == 255 && std::chrono::steady_clock::now() > deadline) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return stop_.load() || (state_.load(std::memory_order_seq_cst) >> 32) != served; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        if (stop_.load()) return;
        deadline = std::chrono::steady_clock::now() + kSpin;
      }
      cpu_relax();
      s = state_.load(std::memory_order_acquire);
    }
    served = s >> 32;
    // Join only the run just seen, while it is open: the caller cannot return while this helper is counted in.
    while ((s & kOpen) && (s >> 32) == served &&
           !state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
    }
    if (!(s & kOpen) || (s >> 32) != served) continue;
    if (index < workers_.load(std::memory_order_relaxed)) (*body_.load(std::memory_order_relaxed))(index);
    state_.fetch_sub(1, std::memory_order_release);
  }
}

}  // namespace cpumoe
