// Large read-mostly buffers (packed weights, the bandwidth probe) on 2 MB pages where the OS allows it:
// a decode call streams hundreds of MB, and on 4 KB pages every page is a TLB miss.
#pragma once
#include <cstddef>

namespace cpumoe {

constexpr size_t kHugePageBytes = size_t(2) << 20;

// Asks Linux for transparent huge pages over the 2 MB-aligned part of [p, p + bytes). Call it before the
// first write (pages are chosen at first touch). Returns false where the OS does not take the advice.
bool advise_huge_pages(void* p, size_t bytes);

}  // namespace cpumoe
