// Run-time CPU feature detection and the table of kernel paths built into this binary.
#pragma once
#include <string>
#include <vector>

#include "kernels.h"

namespace cpumoe {

// Feature names as Linux's /proc/cpuinfo spells them (avx2, avx512f, avx512_bf16, asimd, bf16, i8mm...),
// usable ones only (the OS saves the registers).
std::vector<std::string> cpu_features();
bool cpu_has(const std::string& feature);

struct KernelInfo {
  const KernelTable* table;    // nullptr when not built for this architecture
  std::string name;
  std::string unavailable;     // empty when the path can run here, else why not
};

// Every path cpumoe knows, fastest first, with whether it can run on this CPU.
std::vector<KernelInfo> kernel_paths();
// The named path, or nullptr with *why set.
const KernelTable* find_kernel(const std::string& name, std::string* why);

}  // namespace cpumoe
