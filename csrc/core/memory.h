// Large read-mostly buffers (packed weights, the bandwidth probe) on 2 MB pages where the OS allows it:
// a decode call streams hundreds of MB, and on 4 KB pages every page is a TLB miss.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

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

// map_huge's memory, zero-filled and with every page faulted in now (a buffer written as it goes, such as the KV
// cache, would otherwise pay a page fault at the first write to each page, in the middle of a step).
void* map_huge_zeroed(size_t bytes);

// map_huge's buffers are numbered in mapping order. A loader takes next_huge_mapping() before it packs, and
// huge_mappings_since(that) after: the (address, bytes) of the buffers it mapped that are still live, whose share
// on huge pages it then reads from /proc (cpumoe/memory.py), unblurred by other buffers freed meanwhile.
uint64_t next_huge_mapping();
std::vector<std::pair<uintptr_t, size_t>> huge_mappings_since(uint64_t number);

// Hands the allocator's free memory back to the OS (glibc's malloc_trim). A loader calls it after a phase that
// freed many transient buffers: later allocations otherwise land beside those holes and the resident size of a
// loaded model grows past its weights. Returns false where nothing was released or the C library has no trim.
bool release_free_memory();

}  // namespace cpumoe
