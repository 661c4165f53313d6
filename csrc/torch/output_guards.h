// A test aid: with guards on (ops._C.set_output_guards), each op's output is a view into a larger buffer whose
// kGuardBytes on either side hold a known byte, and the op checks them before it returns, so a kernel that writes
// past its output (a tile's last columns, a row stride too long) fails by name instead of corrupting the heap
// silently. Off (the default) an output is a plain at::empty and the check returns at once.
#pragma once
#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include <c10/util/strides.h>

namespace cpumoe {

constexpr int64_t kGuardBytes = 256;
constexpr uint8_t kGuardByte = 0xA5;

inline std::atomic<bool>& output_guards() {
  static std::atomic<bool> on{false};
  return on;
}

// at::empty(sizes, options), or with guards on, the same shape inside a buffer with guard bytes around it.
inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!output_guards().load(std::memory_order_relaxed)) return at::empty(sizes, options);
  const int64_t item = int64_t(options.dtype().itemsize());
  const int64_t numel = c10::multiply_integers(sizes);
  const int64_t pad = (kGuardBytes + item - 1) / item;
  at::Tensor buffer = at::empty({numel + 2 * pad}, options);
  std::memset(buffer.data_ptr(), kGuardByte, buffer.nbytes());
  // on the buffer's storage but not a view of it (no base kept alive), as a plain output owns its storage alone
  return at::empty({0}, options).set_(buffer.storage(), pad, sizes, c10::contiguous_strides(sizes));
}

// Throws, naming `op`, when a guard byte around `out` (from new_output) changed. No-op with guards off.
inline void check_output_guards(const at::Tensor& out, const char* op) {
  if (!output_guards().load(std::memory_order_relaxed)) return;
  const auto* base = static_cast<const uint8_t*>(out.storage().data());
  const int64_t begin = out.storage_offset() * int64_t(out.itemsize());
  const int64_t end = begin + int64_t(out.nbytes()), total = int64_t(out.storage().nbytes());
  for (int64_t i = 0; i < total; ++i) {
    if (i == begin) i = end;
    if (i < total && base[i] != kGuardByte)
      TORCH_CHECK(false, op, " wrote ", i < begin ? begin - i : i - end + 1, " byte(s) ",
                  i < begin ? "before" : "past", " its output ", out.sizes(), " (guard byte at offset ", i - begin,
                  " changed)");
  }
}

}  // namespace cpumoe
