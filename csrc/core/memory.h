// Large read-mostly buffers (packed weights, the bandwidth probe) on 2 MB pages where the OS allows it:
// a decode call streams hundreds of MB, and on 4 KB pages every page is a TLB miss.
#pragma once
#include <cstddef>

namespace cpumoe {

constexpr size_t kHugePageBytes = size_t(2) << 20;

// Asks Linux for transparent huge pages over the 2 MB-aligned part of [p, p + bytes). Call it before the
// first write (pages are chosen at first touch). Returns false where the OS does not take the advice.
bool advise_huge_pages(void* p, size_t bytes);

// Memory of its own for a large buffer, 2 MB-aligned and advised for huge pages before anything touches it.
// malloc may hand out a chunk of its heap that earlier buffers already touched: those pages stay 4 KB whatever
// the advice (packed w2 stacks landed there and streamed 10-20% slower). Linux: a private anonymous mapping;
// elsewhere aligned_alloc. Free it with unmap_huge(p, bytes), the same bytes. Throws std::bad_alloc.
void* map_huge(size_t bytes);
void unmap_huge(void* p, size_t bytes);

// Hands the allocator's free memory back to the OS (glibc's malloc_trim). A loader calls it after a phase that
// freed many transient buffers: later allocations otherwise land beside those holes and the resident size of a
// loaded model grows past its weights. Returns false where nothing was released or the C library has no trim.
bool release_free_memory();

}  // namespace cpumoe
