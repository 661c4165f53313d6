// What each packed weight was packed as, kept by the address of its storage. Packings for two backends, two
// widths that round up to the same blocks, or two formats can have the same tensor shape and would run silently
// wrong; so every packing op records the layout (or format and group) and the true unpacked shape, and the
// compute ops check the weight they are given against the call. An entry lives exactly as long as the storage:
// the packed tensor's deleter removes it. A tensor that is not a packing's own storage (a copy, a view at an
// offset, a tensor from elsewhere) is refused by name.
#pragma once
#include <ATen/ATen.h>

#include <mutex>
#include <string>
#include <unordered_map>

#include "../core/memory.h"
#include "../core/quant.h"
#include "../core/types.h"

namespace cpumoe {

struct PackedInfo {
  bool quant = false;
  Layout layout{};            // dense: the layout the backend packs in
  const char* backend = "";   // dense: the backend it was packed for (a static name; named in errors)
  QuantFormat format{};       // quantized: the format and group size (0 = a whole row)
  int64_t group = 0;
  bool symmetric = false;     // int4: blocks without zero points (quant.h)
  bool w13 = false;           // w13 [2I, H] per expert, else w2 or a linear [N, K]
  int64_t rows = 0, cols = 0; // the unpacked matrix per expert: w13 [2I, H], w2 [H, I], linear [N, K]

  std::string describe() const {
    std::string s = quant ? std::string(quant_format_name(format)) + (symmetric ? " symmetric" : "") + " group " +
                                std::to_string(group)
                          : "backend '" + std::string(backend) + "'";
    return s + (w13 ? " w13 " : " w2/linear ") + "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
  }
};

class PackedRegistry {
 public:
  static PackedRegistry& get() {
    static PackedRegistry* r = new PackedRegistry();  // never destroyed: deleters may run at exit
    return *r;
  }
  void add(const void* p, PackedInfo info) {
    std::lock_guard<std::mutex> lock(mu_);
    entries_[p] = std::move(info);
  }
  void remove(const void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    entries_.erase(p);
  }
  bool find(const void* p, PackedInfo* out) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(p);
    if (it == entries_.end()) return false;
    *out = it->second;
    return true;
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<const void*, PackedInfo> entries_;
};

// A packed-weight tensor on memory of its own (memory.h's map_huge: 2 MB-aligned, on huge pages), recorded
// as `info` until it is freed.
inline at::Tensor empty_packed(at::IntArrayRef sizes, at::ScalarType dtype, PackedInfo info) {
  const size_t bytes = size_t(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
  TORCH_CHECK(bytes > 0, "a packed weight cannot be empty, got shape ", sizes);
  void* p = map_huge(bytes);
  PackedRegistry::get().add(p, std::move(info));
  return at::from_blob(p, sizes, [bytes](void* q) {
    PackedRegistry::get().remove(q);
    unmap_huge(q, bytes);
  }, at::TensorOptions().dtype(dtype));
}

// The record of `w`, or an error naming `what`.
inline PackedInfo packed_info_or_throw(const at::Tensor& w, const char* what) {
  PackedInfo info;
  TORCH_CHECK_VALUE(w.storage_offset() == 0 && PackedRegistry::get().find(w.data_ptr(), &info), what,
                    " is not a weight packed by cpumoe (pack_w13, pack_w2, pack_linear or pack_quant): a copy, a "
                    "view or a tensor from elsewhere cannot be checked, so it is refused; pack the weight again");
  return info;
}

}  // namespace cpumoe
