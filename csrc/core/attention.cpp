#include "attention.h"

#include <stdexcept>

#include "cpu_features.h"

namespace cpumoe {

const KernelTable& attention_kernel(std::string* name) {
  static const KernelInfo* chosen = [] {
    for (const KernelInfo& info : kernel_backends())
      if (info.table && info.table->attention) return &info;
    throw std::logic_error("no kernel backend has decode attention (the generic one always should)");
  }();
  if (name) *name = chosen->name;
  return *chosen->table;
}

void decode_attention(const DecodeAttentionArgs& args, const KernelTable& kernel, const Parallel& parallel) {
  const AttentionFn fn = kernel.attention;
  parallel_items(parallel, args.S * args.nkv, [&](int64_t i) { fn(args, i / args.nkv, i % args.nkv); });
}

}  // namespace cpumoe
