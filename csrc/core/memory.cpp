#include "memory.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace cpumoe {
namespace {

struct Mappings {
  std::mutex mutex;
  uint64_t next = 0;
  std::map<uintptr_t, std::pair<size_t, uint64_t>> live;  // address -> (bytes, number)
};

Mappings& mappings() {
  static Mappings* m = new Mappings;  // never destroyed: buffers may be freed during static destruction
  return *m;
}

void record_mapping(void* p, size_t bytes) {
  Mappings& m = mappings();
  std::lock_guard<std::mutex> lock(m.mutex);
  m.live[reinterpret_cast<uintptr_t>(p)] = {bytes, m.next++};
}

void forget_mapping(void* p) {
  Mappings& m = mappings();
  std::lock_guard<std::mutex> lock(m.mutex);
  m.live.erase(reinterpret_cast<uintptr_t>(p));
}

}  // namespace

uint64_t next_huge_mapping() {
  Mappings& m = mappings();
  std::lock_guard<std::mutex> lock(m.mutex);
  return m.next;
}

std::vector<std::pair<uintptr_t, size_t>> huge_mappings_since(uint64_t number) {
  Mappings& m = mappings();
  std::lock_guard<std::mutex> lock(m.mutex);
  std::vector<std::pair<uintptr_t, size_t>> out;
  for (const auto& [address, entry] : m.live)
    if (entry.second >= number) out.emplace_back(address, entry.first);
  return out;
}

bool advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePageBytes - 1);
  if (end <= begin) return false;
  return madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

void* map_huge(size_t bytes) {
  const size_t size = (bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
#if defined(__linux__)
  // Map one huge page more than needed and trim both ends to a 2 MB boundary.
  void* raw = mmap(nullptr, size + kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (begin + kHugePageBytes - 1) & ~(kHugePageBytes - 1);
  if (aligned > begin) munmap(raw, aligned - begin);
  if (aligned + size < begin + size + kHugePageBytes)
    munmap(reinterpret_cast<void*>(aligned + size), begin + size + kHugePageBytes - aligned - size);
  void* p = reinterpret_cast<void*>(aligned);
  advise_huge_pages(p, size);
#else
  void* p = std::aligned_alloc(kHugePageBytes, size);
  if (!p) throw std::bad_alloc();
#endif
  record_mapping(p, size);
  return p;
}

void* map_huge_zeroed(size_t bytes) {
  char* p = static_cast<char*>(map_huge(bytes));
#if defined(__linux__)
  for (size_t at = 0; at < bytes; at += 4096) p[at] = 0;  // an anonymous mapping reads as zeros: fault each page in
#else
  std::memset(p, 0, bytes);
#endif
  return p;
}

void unmap_huge(void* p, size_t bytes) {
  if (!p) return;
  forget_mapping(p);
#if defined(__linux__)
  munmap(p, (bytes + kHugePageBytes - 1) & ~(kHugePageBytes - 1));
#else
  (void)bytes;
  std::free(p);
#endif
}

bool release_free_memory() {
#if defined(__GLIBC__)
  return malloc_trim(0) != 0;
#else
  return false;
#endif
}

}  // namespace cpumoe
