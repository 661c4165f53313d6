// Run-time CPU feature detection and the table of kernel backends built into this binary.
#pragma once
#include <string>
#include <vector>

#include "kernels.h"
#include "quant.h"

namespace cpumoe {

// Feature names as Linux's /proc/cpuinfo spells them (avx2, avx512f, avx512_bf16, asimd, bf16, i8mm...),
// usable ones only (the OS saves the registers).
const std::vector<std::string>& cpu_features();
bool cpu_has(const std::string& feature);

struct KernelInfo {
  const KernelTable* table;    // dense (fp32/bf16/fp16) tiles; nullptr when unavailable or the backend has none
  std::string name;
  std::string unavailable;     // empty when the backend can run here, else why not
  const QuantKernel* quant[kNumQuantFormats];  // per QuantFormat; nullptr when unavailable or not written
};

// Every backend cpumoe knows, fastest first, with whether it can run on this CPU.
const std::vector<KernelInfo>& kernel_backends();
// The named backend's dense tiles, or nullptr with *why set.
const KernelTable* find_kernel(const std::string& name, std::string* why);
// The named backend's tiles for a quantized format, or nullptr with *why set.
const QuantKernel* find_quant_kernel(const std::string& name, QuantFormat format, std::string* why);

}  // namespace cpumoe
