#include "prefill_attention.h"

#include <stdexcept>

#include "cpu_features.h"
#if defined(__x86_64__)
#include "x86/kernels_amx.h"
#endif

namespace cpumoe {
namespace {

// Only x86-amx has one: where the tile unit is missing, the blocked torch maths of prefill.py is as fast as a
// vector kernel would be (its GEMMs are oneDNN's).
bool amx_here() {
#if defined(__x86_64__)
  static const bool here = find_kernel("x86-amx", nullptr) != nullptr;
  return here;
#else
  return false;
#endif
}

}  // namespace

const char* prefill_attention_backend() { return amx_here() ? "x86-amx" : ""; }

const char* prefill_attention_unsupported(const PrefillAttentionArgs& a) {
  if (!amx_here()) return "no backend here has a prefill attention kernel (x86-amx needs AMX-BF16)";
  if (a.dtype != DType::kBFloat16) return "x86-amx's prefill attention takes bf16 only";
  if (a.d % 32 || a.dv % 32) return "x86-amx's prefill attention takes head sizes that are multiples of 32";
  return nullptr;
}

void prefill_attention(const PrefillAttentionArgs& a, const Parallel& parallel) {
  if (const char* why = prefill_attention_unsupported(a)) throw std::invalid_argument(why);
#if defined(__x86_64__)
  amx_prefill_attention(a, parallel);
#endif
}

}  // namespace cpumoe
