#include "memory.h"

#include <cstdint>
#include <cstdlib>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace cpumoe {

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
  return p;
#else
  void* p = std::aligned_alloc(kHugePageBytes, size);
  if (!p) throw std::bad_alloc();
  return p;
#endif
}

void unmap_huge(void* p, size_t bytes) {
  if (!p) return;
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
