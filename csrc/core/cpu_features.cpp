#include "cpu_features.h"

#include <algorithm>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace cpumoe {
namespace {

#if defined(__x86_64__)
// AMX's tile data is saved by the OS (XCR0 bits 17-18) only for a process that asks for it first (Linux 5.16+).
bool amx_permitted(unsigned long long xcr0) {
  constexpr unsigned long long kTileState = 3ull << 17;
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return (xcr0 & kTileState) == kTileState && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

std::vector<std::string> detect() {
  std::vector<std::string> f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & bit_FMA, f16c = c & bit_F16C, osxsave = c & bit_OSXSAVE;
  unsigned long long xcr0 = 0;
  if (osxsave) {
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (unsigned long long)hi << 32 | lo;
  }
  const bool os_avx = (xcr0 & 0x6) == 0x6, os_avx512 = (xcr0 & 0xe6) == 0xe6;
  if (os_avx && fma) f.push_back("fma");
  if (os_avx && f16c) f.push_back("f16c");
  __cpuid_count(7, 0, a, b, c, d);
  if (os_avx && (b & bit_AVX2)) f.push_back("avx2");
  if (os_avx512) {
    if (b & bit_AVX512F) f.push_back("avx512f");
    if (b & bit_AVX512BW) f.push_back("avx512bw");
    if (b & bit_AVX512VL) f.push_back("avx512vl");
    if (c & bit_AVX512VNNI) f.push_back("avx512_vnni");
    unsigned a1, b1, c1, d1;
    __cpuid_count(7, 1, a1, b1, c1, d1);
    if (a1 & (1u << 5)) f.push_back("avx512_bf16");
  }
  if (d & (1u << 24)) f.push_back("amx_tile");
  if ((d & ((1u << 22) | (1u << 25))) && amx_permitted(xcr0)) {
    if (d & (1u << 22)) f.push_back("amx_bf16");
    if (d & (1u << 25)) f.push_back("amx_int8");
  }
  return f;
}
#elif defined(__aarch64__)
std::vector<std::string> detect() {
  std::vector<std::string> f;
  unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  if (hw & HWCAP_ASIMD) f.push_back("asimd");
  if (hw & HWCAP_ASIMDDP) f.push_back("asimddp");
  if (hw & HWCAP_SVE) f.push_back("sve");
  if (hw2 & HWCAP2_BF16) f.push_back("bf16");
  if (hw2 & HWCAP2_I8MM) f.push_back("i8mm");
  return f;
}
#else
std::vector<std::string> detect() { return {}; }
#endif

using QuantFn = const QuantKernel* (*)(QuantFormat);

struct BackendSpec {
  const char* name;
  bool built;                         // compiled for this architecture
  const KernelTable* (*table)();      // dense tiles, or nullptr: the backend has none
  QuantFn quant;                      // quantized tiles per format (nullptr entries: not written), or nullptr
  std::vector<std::string> requires;  // CPU features
};

const QuantKernel* generic_quant(QuantFormat f) { return &quant_generic(f); }

// Fastest first: for each dtype and format the first available backend that has tiles for it wins.
std::vector<BackendSpec> specs() {
  return {
#if defined(__x86_64__)
      {"x86-amx", true, [] { return &kernels_x86_amx(); }, quant_x86_amx,
       {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"}},
      {"x86-avx512bf16", true, [] { return &kernels_x86_avx512bf16(); }, quant_x86_avx512bf16,
       {"avx512f", "avx512bw", "avx512_bf16"}},
      {"x86-avx512vnni", true, nullptr, quant_x86_avx512vnni, {"avx512f", "avx512bw", "avx512_vnni"}},
      {"x86-avx512", true, [] { return &kernels_x86_avx512(); }, nullptr, {"avx512f", "avx512bw", "f16c", "fma"}},
      {"x86-avx2", true, [] { return &kernels_x86_avx2(); }, quant_x86_avx2, {"avx2", "fma", "f16c"}},
      {"arm-bfmmla", false, nullptr, nullptr, {"bf16"}},
      {"arm-i8mm", false, nullptr, nullptr, {"i8mm"}},
      {"arm-dotprod", false, nullptr, nullptr, {"asimddp"}},
      {"arm-neon", false, nullptr, nullptr, {"asimd"}},
#elif defined(__aarch64__)
      {"x86-amx", false, nullptr, nullptr, {}},
      {"x86-avx512bf16", false, nullptr, nullptr, {}},
      {"x86-avx512vnni", false, nullptr, nullptr, {}},
      {"x86-avx512", false, nullptr, nullptr, {}},
      {"x86-avx2", false, nullptr, nullptr, {}},
      {"arm-bfmmla", true, [] { return &kernels_arm_bfmmla(); }, nullptr, {"bf16"}},
      {"arm-i8mm", true, nullptr, quant_arm_i8mm, {"i8mm"}},
      {"arm-dotprod", true, nullptr, quant_arm_dotprod, {"asimddp"}},
      {"arm-neon", true, [] { return &kernels_arm_neon(); }, nullptr, {"asimd"}},
#endif
      {"generic", true, [] { return &kernels_generic(); }, generic_quant, {}},
  };
}

}  // namespace

const std::vector<std::string>& cpu_features() {
  static const std::vector<std::string> features = detect();
  return features;
}

bool cpu_has(const std::string& feature) {
  const auto& f = cpu_features();
  return std::find(f.begin(), f.end(), feature) != f.end();
}

namespace {

std::vector<KernelInfo> probe_backends() {
  std::vector<KernelInfo> out;
  for (const BackendSpec& s : specs()) {
    KernelInfo info{nullptr, s.name, "", {}};
    if (!s.built) {
      info.unavailable = "not built for this architecture";
    } else {
      for (const std::string& req : s.requires)
        if (!cpu_has(req)) {
          info.unavailable = "CPU lacks " + req;
          break;
        }
    }
    if (info.unavailable.empty()) {
      info.table = s.table ? s.table() : nullptr;
      for (int f = 0; f < kNumQuantFormats && s.quant; ++f) info.quant[f] = s.quant(QuantFormat(f));
    }
    out.push_back(info);
  }
  return out;
}

}  // namespace

// Built once: every op call looks its backend up here, and the CPU does not change under a process.
const std::vector<KernelInfo>& kernel_backends() {
  static const std::vector<KernelInfo> backends = probe_backends();
  return backends;
}

const KernelTable* find_kernel(const std::string& name, std::string* why) {
  for (const KernelInfo& k : kernel_backends())
    if (k.name == name) {
      if (!k.table && why) *why = k.unavailable.empty() ? "it has no fp32/bf16/fp16 tiles" : k.unavailable;
      return k.table;
    }
  if (why) *why = "unknown kernel backend '" + name + "'";
  return nullptr;
}

const QuantKernel* find_quant_kernel(const std::string& name, QuantFormat format, std::string* why) {
  for (const KernelInfo& k : kernel_backends())
    if (k.name == name) {
      const QuantKernel* q = k.quant[int(format)];
      if (!q && why)
        *why = k.unavailable.empty() ? std::string("it has no ") + quant_format_name(format) + " tiles" : k.unavailable;
      return q;
    }
  if (why) *why = "unknown kernel backend '" + name + "'";
  return nullptr;
}

}  // namespace cpumoe
