// The one registration file: TORCH_LIBRARY(cpumoe) schemas and CPU kernels for the tensor ops, plus a few
// plain Python functions (CPU features, kernel backends, bandwidth). Input checks live here so that the
// PyTorch-free core can assume well-formed arguments.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "../core/cpu_features.h"
#include "../core/fused_moe.h"
#include "../core/greedy.h"
#include "../core/linear.h"
#include "../core/membw.h"
#include "../core/memory.h"
#include "../core/routing.h"
#include "../core/attention.h"
#include "../core/norm.h"
#include "../core/prefill_attention.h"
#include "../core/rope.h"
#include "../core/softmax.h"
#include "../core/pack.h"
#include "../core/quant_pack.h"
#include "../core/worker_pool.h"
#include "output_guards.h"
#include "packed.h"

namespace cpumoe {
namespace {

// The kernels' workers: this process's WorkerPool, as wide as torch's intra-op threads. Their work is handed out
// by parallel_items, right whichever helpers take part.
Parallel kernel_parallel() {
  Parallel p;
  p.workers = at::get_num_threads();
  p.run = [](int n, const std::function<void(int)>& body) { WorkerPool::shared().run(n, body); };
  return p;
}

DType to_dtype(at::ScalarType type, const char* what) {
  switch (type) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, got ", type);
  }
}

DType to_dtype(const at::Tensor& t, const char* what) { return to_dtype(t.scalar_type(), what); }

Activation to_activation(const std::string& name) {
  if (name == "silu") return Activation::kSilu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  if (name == "swigluoai") return Activation::kSwigluOai;
  TORCH_CHECK(false, "unknown activation '", name, "' (expected silu, gelu, gelu_tanh or swigluoai)");
}

const KernelTable& kernel_or_throw(const std::string& name) {
  std::string why;
  const KernelTable* k = find_kernel(name, &why);
  TORCH_CHECK(k, "kernel backend '", name, "' cannot run here: ", why);
  return *k;
}

QuantFormat to_format(const std::string& name) {
  for (int f = 0; f < kNumQuantFormats; ++f)
    if (name == quant_format_name(QuantFormat(f))) return QuantFormat(f);
  TORCH_CHECK_VALUE(false, "unknown quantization format '", name,
                    "' (expected int8_w8a8, int4_w4a16, fp8_w8a16 or mxfp4_w4a16)");
}

const QuantKernel& quant_kernel_or_throw(const std::string& name, QuantFormat f) {
  std::string why;
  const QuantKernel* k = find_quant_kernel(name, f, &why);
  TORCH_CHECK(k, "kernel backend '", name, "' cannot run ", quant_format_name(f), ": ", why);
  return *k;
}

QuantPackedShape quant_shape_or_throw(QuantFormat f, int64_t N, int64_t K, int64_t group, bool w13,
                                      bool symmetric = false) {
  try {
    return quant_packed_shape(f, N, K, group, w13, symmetric);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

void check_dense(const at::Tensor& t, const char* what, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == dim, what, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

at::Tensor pack(const at::Tensor& w, const std::string& kernel, bool is_w13) {
  const char* what = is_w13 ? "w13" : "w2";
  check_dense(w, what, 3);
  const KernelTable& kt = kernel_or_throw(kernel);
  const DType dt = to_dtype(w, what);
  TORCH_CHECK(kt.supports(dt), "kernel backend '", kernel, "' does not take ", dtype_name(dt), " weights");
  const int64_t E = w.size(0);
  int64_t H, I;
  if (is_w13) {
    TORCH_CHECK(w.size(1) % 2 == 0, "w13 must be [E, 2*I, H] (gate rows then up rows), got ", w.sizes());
    I = w.size(1) / 2, H = w.size(2);
  } else {
    H = w.size(1), I = w.size(2);
  }
  TORCH_CHECK(E > 0 && H > 0 && I > 0, what, " has an empty dimension: ", w.sizes());
  PackedShape s = is_w13 ? w13_packed_shape(H, I, kt.layout) : w2_packed_shape(H, I, kt.layout);
  PackedInfo info;
  info.layout = kt.layout, info.backend = kt.name, info.w13 = is_w13, info.rows = w.size(1), info.cols = w.size(2);
  at::Tensor out = empty_packed({E, s.blocks, s.block_elems}, w.scalar_type(), info);
  const void* src = w.data_ptr();
  void* dst = out.data_ptr();
  at::parallel_for(0, E, 1, [&](int64_t b, int64_t e) {
    if (is_w13) pack_w13(src, dst, H, I, dt, kt.layout, b, e);
    else pack_w2(src, dst, H, I, dt, kt.layout, b, e);
  });
  return out;
}

at::Tensor pack_w13_op(const at::Tensor& w13, std::string_view kernel) { return pack(w13, std::string(kernel), true); }
at::Tensor pack_w2_op(const at::Tensor& w2, std::string_view kernel) { return pack(w2, std::string(kernel), false); }

// Blocks of a packing of `rows` rows like `info`'s.
int64_t packed_blocks(const PackedInfo& info, int64_t rows) {
  return info.quant ? quant_shape_or_throw(info.format, rows, info.cols, info.group, false, info.symmetric).blocks
                    : w2_packed_shape(rows, info.cols, info.layout).blocks;
}

// Packed linear weights [1, blocks, block size] laid end to end: the packing of their rows joined (a packing's
// blocks hold whole rows, so blocks of parts that fill their last one are the joined matrix's blocks).
at::Tensor join_packed_rows(const std::vector<at::Tensor>& parts) {
  TORCH_CHECK_VALUE(!parts.empty(), "join_packed_rows needs at least one packed weight");
  const PackedInfo first = packed_info_or_throw(parts[0], "parts[0]");
  const int64_t probe = int64_t(1) << 16;  // a multiple of every packing's rows per block
  const int64_t rows_per_block = probe / packed_blocks(first, probe);
  PackedInfo joined = first;
  joined.rows = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string name = "parts[" + std::to_string(i) + "]";
    const PackedInfo info = packed_info_or_throw(parts[i], name.c_str());
    const bool same = !info.w13 && info.quant == first.quant && info.cols == first.cols &&
                      (info.quant ? info.format == first.format && info.group == first.group &&
                                        info.symmetric == first.symmetric
                                  : info.layout == first.layout && std::string(info.backend) == first.backend) &&
                      parts[i].dim() == 3 && parts[i].size(0) == 1 && parts[i].size(2) == parts[0].size(2) &&
                      parts[i].scalar_type() == parts[0].scalar_type();
    TORCH_CHECK_VALUE(same, name, " was packed as ", info.describe(), ", parts[0] as ", first.describe(),
                      ": only linear weights of one packing and input width join");
    TORCH_CHECK_VALUE(info.rows % rows_per_block == 0, name, " has ", info.rows, " rows, not a multiple of the ",
                      rows_per_block, " rows of a packed block: its padding rows would sit between the parts");
    joined.rows += info.rows;
  }
  int64_t part_blocks = 0;
  for (const at::Tensor& part : parts) part_blocks += part.size(1);
  const int64_t blocks = packed_blocks(joined, joined.rows);
  TORCH_CHECK(blocks == part_blocks, "join_packed_rows: the parts hold ", part_blocks, " blocks, a packing of their ",
              joined.rows, " rows ", blocks);
  at::Tensor out = empty_packed({1, blocks, parts[0].size(2)}, parts[0].scalar_type(), joined);
  char* dst = static_cast<char*>(out.data_ptr());
  for (const at::Tensor& part : parts) {
    std::memcpy(dst, part.data_ptr(), part.nbytes());
    dst += part.nbytes();
  }
  return out;
}

// The records of a fused op's packed w13 and w2 against the call: the same packing (layout or format and
// group), w13 over the hidden size of the activations, w2 back to it, one intermediate size.
void check_packed_experts(const at::Tensor& w13, const at::Tensor& w2, int64_t H,
                             const std::function<bool(const PackedInfo&)>& same_packing, const std::string& want) {
  const PackedInfo i13 = packed_info_or_throw(w13, "packed w13"), i2 = packed_info_or_throw(w2, "packed w2");
  TORCH_CHECK_VALUE(i13.w13 && !i2.w13, "packed w13 and w2 are swapped or mixed: w13 was packed as ",
                    i13.describe(), ", w2 as ", i2.describe());
  TORCH_CHECK_VALUE(same_packing(i13) && same_packing(i2), "the weights were packed as ", i13.describe(), " and ",
                    i2.describe(), ", this call runs ", want, " (pack them for it)");
  TORCH_CHECK_VALUE(i13.cols == H && i2.rows == H, "hidden_states have width ", H,
                    " but the experts were packed for hidden size ", i13.cols, " (w13) and ", i2.rows, " (w2)");
  TORCH_CHECK_VALUE(i13.rows == 2 * i2.cols, "packed w13 ", i13.describe(), " and w2 ", i2.describe(),
                    " do not share an intermediate size");
}

// Whether a record is a packing of format f with the call's group size (pack_quant records a group equal to
// the row length as 0, a whole row; int8 and mxfp4 have no choice of group).
bool same_quant_packing(const PackedInfo& i, QuantFormat f, int64_t group_size) {
  if (!i.quant || i.format != f) return false;
  if (f == QuantFormat::kInt8W8A8 || f == QuantFormat::kMxfp4W4A16) return true;
  return i.group == (group_size == i.cols ? 0 : group_size);
}

// The record of a linear's packed weight against the call: the same packing, [out_features, in_features].
void check_packed_linear(const at::Tensor& w, int64_t out_features, int64_t in_features,
                         const std::function<bool(const PackedInfo&)>& same_packing, const std::string& want) {
  const PackedInfo info = packed_info_or_throw(w, "packed linear weight");
  TORCH_CHECK_VALUE(!info.w13 && same_packing(info), "the linear weight was packed as ", info.describe(),
                    ", this call runs ", want, " (pack it for it)");
  TORCH_CHECK_VALUE(info.rows == out_features && info.cols == in_features, "the linear weight was packed as [",
                    info.rows, ", ", info.cols, "] (out, in), the call has x of width ", in_features,
                    " and out_features ", out_features);
}

// A fused experts call's weights checked against the activations' width and dtype, with their biases and expert
// map: every field of FusedMoeArgs but the tokens' (M, hidden, topk_weights, topk_ids, out). Checked per call by
// the ops, once per layer by RoutedExperts (routed_experts.inc).
struct ExpertWeights {
  FusedMoeArgs args;
  at::Tensor w13, w2;  // what the pointers in args point into, kept alive with them
  std::optional<at::Tensor> w13_bias, w2_bias, expert_map;
};

// The expert map and packed biases both fused ops take, checked into w.args (E, I and H set).
void attach_extras(ExpertWeights& w, const std::optional<at::Tensor>& w13_bias,
                   const std::optional<at::Tensor>& w2_bias, const std::optional<at::Tensor>& expert_map,
                   bool apply_router_weight_on_input) {
  FusedMoeArgs& a = w.args;
  const int64_t E = a.local_experts, Ip = a.I, Hp = round_up(a.H, kBlockCols);
  a.global_experts = E;
  a.apply_router_weight_on_input = apply_router_weight_on_input;
  a.w13 = w.w13.data_ptr();
  a.w2 = w.w2.data_ptr();
  if (expert_map) {
    check_dense(*expert_map, "expert_map", 1);
    TORCH_CHECK(expert_map->scalar_type() == at::kInt, "expert_map must be int32, got ", expert_map->scalar_type());
    a.expert_map = expert_map->data_ptr<int32_t>();
    a.global_experts = expert_map->size(0);
  }
  if (w13_bias) {
    check_dense(*w13_bias, "packed w13_bias", 2);
    TORCH_CHECK(w13_bias->scalar_type() == at::kFloat && w13_bias->size(0) == E && w13_bias->size(1) == 2 * Ip,
                "packed w13_bias must be float32 [", E, ", ", 2 * Ip, "], got ", w13_bias->scalar_type(), " ",
                w13_bias->sizes());
    a.w13_bias = w13_bias->data_ptr<float>();
  }
  if (w2_bias) {
    check_dense(*w2_bias, "packed w2_bias", 2);
    TORCH_CHECK(w2_bias->scalar_type() == at::kFloat && w2_bias->size(0) == E && w2_bias->size(1) == Hp,
                "packed w2_bias must be float32 [", E, ", ", Hp, "], got ", w2_bias->scalar_type(), " ",
                w2_bias->sizes());
    a.w2_bias = w2_bias->data_ptr<float>();
  }
  w.w13_bias = w13_bias, w.w2_bias = w2_bias, w.expert_map = expert_map;
}

// The routing tensors an op call brings, checked against its tokens; returns k.
int64_t check_routes(const at::Tensor& topk_weights, const at::Tensor& topk_ids, int64_t M) {
  check_dense(topk_weights, "topk_weights", 2);
  check_dense(topk_ids, "topk_ids", 2);
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat, "topk_weights must be float32, got ", topk_weights.scalar_type());
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt, "topk_ids must be int32, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_ids.size(0) == M && topk_weights.sizes() == topk_ids.sizes(),
              "topk_weights ", topk_weights.sizes(), " and topk_ids ", topk_ids.sizes(), " must both be [", M, ", k]");
  return topk_ids.size(1);
}

// The driver over checked weights and M tokens' routes (k each): out [M, H] in hidden's dtype (into `out` when
// given, of that shape and dtype).
at::Tensor run_experts(const ExpertWeights& w, const at::Tensor& hidden, const float* topk_weights,
                       const int32_t* topk_ids, int64_t k, at::Tensor out = {}) {
  TORCH_CHECK(k >= 1, "top-k must be at least 1");
  TORCH_CHECK(!w.args.apply_router_weight_on_input || k == 1, "apply_router_weight_on_input needs top_k == 1, got ",
              k);
  FusedMoeArgs a = w.args;
  a.M = hidden.size(0), a.topk = k;
  if (!out.defined()) out = new_output(hidden.sizes(), hidden.options());
  a.hidden = hidden.data_ptr();
  a.topk_weights = topk_weights;
  a.topk_ids = topk_ids;
  a.out = out.data_ptr();
  try {
    fused_moe(a, kernel_parallel());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  check_output_guards(out, "fused_experts");
  return out;
}

// Dense packed weights for activations of width H and dtype dt on a kernel backend, checked.
ExpertWeights dense_expert_weights(int64_t H, at::ScalarType dtype, const at::Tensor& w13, const at::Tensor& w2,
                                   std::string_view kernel_name, std::string_view activation,
                                   const std::optional<at::Tensor>& w13_bias,
                                   const std::optional<at::Tensor>& w2_bias,
                                   const std::optional<at::Tensor>& expert_map, bool apply_router_weight_on_input) {
  const KernelTable& kt = kernel_or_throw(std::string(kernel_name));
  const DType dt = to_dtype(dtype, "hidden_states");
  TORCH_CHECK(kt.supports(dt), "kernel backend '", kt.name, "' does not take ", dtype_name(dt), " activations");
  check_dense(w13, "packed w13", 3);
  check_dense(w2, "packed w2", 3);
  TORCH_CHECK(w13.scalar_type() == dtype && w2.scalar_type() == dtype,
              "weights (", w13.scalar_type(), ", ", w2.scalar_type(), ") must have the dtype of hidden_states (",
              dtype, ")");
  const int64_t E = w13.size(0);
  check_packed_experts(w13, w2, H, [&](const PackedInfo& i) { return !i.quant && i.layout == kt.layout; },
                       "backend '" + std::string(kt.name) + "'");
  const PackedShape s13 = w13_packed_shape(H, w13.size(1) * kW13BlockInter, kt.layout);
  TORCH_CHECK(w13.size(2) == s13.block_elems,
              "packed w13 does not match hidden size ", H, " for kernel '", kt.name, "': block of ", w13.size(2),
              " elements, expected ", s13.block_elems, " (was it packed for another backend or hidden size?)");
  const int64_t Ip = w13.size(1) * kW13BlockInter;
  const PackedShape s2 = w2_packed_shape(H, Ip, kt.layout);
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == s2.blocks && w2.size(2) == s2.block_elems,
              "packed w2 has shape ", w2.sizes(), ", expected [", E, ", ", s2.blocks, ", ", s2.block_elems,
              "] for hidden size ", H, " and packed intermediate size ", Ip);
  ExpertWeights w{{}, w13, w2};
  FusedMoeArgs& a = w.args;
  a.kernels = &kt;
  a.dtype = dt;
  a.act = to_activation(std::string(activation));
  a.H = H, a.I = Ip, a.local_experts = E;
  attach_extras(w, w13_bias, w2_bias, expert_map, apply_router_weight_on_input);
  return w;
}

at::Tensor fused_experts(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids, std::string_view kernel_name,
                         std::string_view activation, const std::optional<at::Tensor>& w13_bias,
                         const std::optional<at::Tensor>& w2_bias, const std::optional<at::Tensor>& expert_map,
                         bool apply_router_weight_on_input) {
  check_dense(hidden, "hidden_states", 2);
  const ExpertWeights w = dense_expert_weights(hidden.size(1), hidden.scalar_type(), w13, w2, kernel_name,
                                               activation, w13_bias, w2_bias, expert_map,
                                               apply_router_weight_on_input);
  const int64_t k = check_routes(topk_weights, topk_ids, hidden.size(0));
  return run_experts(w, hidden, topk_weights.data_ptr<float>(), topk_ids.data_ptr<int32_t>(), k);
}

// Canonical quantized weights (cpumoe/quant/formats.py) [E, N, K] -> quant.h blocks [E, blocks, block_bytes].
at::Tensor pack_quant_op(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& zeros,
                      std::string_view format, int64_t group_size, bool w13) {
  const QuantFormat f = to_format(std::string(format));
  const char* what = w13 ? "w13 qweight" : "w2 qweight";
  check_dense(qweight, what, 3);
  const at::ScalarType want_q = f == QuantFormat::kInt8W8A8 ? at::kChar
                                : f == QuantFormat::kFp8W8A16 ? at::kFloat8_e4m3fn : at::kByte;
  TORCH_CHECK_VALUE(qweight.scalar_type() == want_q, what, " of ", quant_format_name(f), " must be ", want_q,
                    ", got ", qweight.scalar_type());
  const int64_t E = qweight.size(0), N = qweight.size(1), K = qweight.size(2);
  TORCH_CHECK_VALUE(E > 0 && N > 0 && K > 0, what, " has an empty dimension: ", qweight.sizes());
  TORCH_CHECK_VALUE(!w13 || N % 2 == 0, "w13 qweight must be [E, 2*I, H] (gate rows then up rows), got ",
                    qweight.sizes());
  const bool symmetric = f == QuantFormat::kInt4W4A16 && !zeros;  // packed without zero points (quant.h)
  const QuantPackedShape shape = quant_shape_or_throw(f, N, K, group_size, w13, symmetric);
  int64_t cols = 1;
  at::ScalarType want_s = at::kFloat;
  std::vector<int64_t> want{E, N};
  if (f == QuantFormat::kInt4W4A16) cols = group_size == 0 ? 1 : K / group_size;
  else if (f == QuantFormat::kFp8W8A16) cols = group_size == 0 ? 1 : (K + group_size - 1) / group_size;
  else if (f == QuantFormat::kMxfp4W4A16) cols = K / kMxfp4Group, want_s = at::kByte;
  if (f != QuantFormat::kInt8W8A8) want.push_back(cols);
  check_dense(scales, "scales", int64_t(want.size()));
  TORCH_CHECK_VALUE(scales.sizes() == at::IntArrayRef(want) && scales.scalar_type() == want_s, quant_format_name(f),
                    " scales must be ", want_s, " ", at::IntArrayRef(want), ", got ", scales.scalar_type(), " ",
                    scales.sizes());
  const uint8_t* zp = nullptr;
  if (zeros) {
    TORCH_CHECK_VALUE(f == QuantFormat::kInt4W4A16, quant_format_name(f), " takes no zero points");
    check_dense(*zeros, "zeros", 3);
    TORCH_CHECK_VALUE(zeros->sizes() == scales.sizes() && zeros->scalar_type() == at::kByte,
                      "int4 zeros must be uint8 ", scales.sizes(), ", got ", zeros->scalar_type(), " ", zeros->sizes());
    zp = zeros->data_ptr<uint8_t>();
  }
  QuantSource src;
  src.format = f;
  src.codes = static_cast<const uint8_t*>(qweight.data_ptr());
  src.scales = scales.data_ptr();
  src.zeros = zp;
  src.N = N, src.K = K, src.group = group_size == K ? 0 : group_size;
  PackedInfo info;
  info.quant = true, info.format = f, info.group = src.group, info.symmetric = symmetric, info.w13 = w13;
  info.rows = N, info.cols = K;
  at::Tensor out = empty_packed({E, shape.blocks, shape.block_bytes}, at::kByte, info);
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, E, 1, [&](int64_t b, int64_t e) { pack_quant(src, w13, dst, b, e); });
  return out;
}

// The packed geometry a quantized op expects, checked against the packed tensor.
QuantPackedShape check_quant_packed(const at::Tensor& w, const char* what, QuantFormat f, int64_t N, int64_t K,
                                    int64_t group_size, bool w13) {
  check_dense(w, what, 3);
  TORCH_CHECK_VALUE(w.scalar_type() == at::kByte, what, " must be the uint8 blocks pack_quant makes, got ",
                    w.scalar_type());
  const QuantPackedShape s = quant_shape_or_throw(f, N, K, group_size, w13, packed_info_or_throw(w, what).symmetric);
  TORCH_CHECK_VALUE(w.size(1) == s.blocks && w.size(2) == s.block_bytes, what, " has shape ", w.sizes(),
                    ", expected [E, ", s.blocks, ", ", s.block_bytes, "] for ", quant_format_name(f), " with N=", N,
                    ", K=", K, ", group ", group_size, " (packed for another shape or format?)");
  return s;
}

// Quantized packed weights of `format` for activations of width H and dtype `dtype` on a kernel backend, checked.
ExpertWeights quant_expert_weights(int64_t H, at::ScalarType dtype, const at::Tensor& w13, const at::Tensor& w2,
                                   std::string_view kernel_name, std::string_view format, int64_t group_size,
                                   std::string_view activation, const std::optional<at::Tensor>& w13_bias,
                                   const std::optional<at::Tensor>& w2_bias,
                                   const std::optional<at::Tensor>& expert_map, bool apply_router_weight_on_input) {
  const QuantFormat f = to_format(std::string(format));
  const QuantKernel& qk = quant_kernel_or_throw(std::string(kernel_name), f);
  const DType dt = to_dtype(dtype, "hidden_states");
  TORCH_CHECK_VALUE(quant_int8_activations(f) || dt == DType::kBFloat16, quant_format_name(f),
                    " takes bfloat16 activations, got ", dtype);
  check_dense(w13, "packed w13", 3);
  check_dense(w2, "packed w2", 3);
  check_packed_experts(w13, w2, H, [&](const PackedInfo& i) { return same_quant_packing(i, f, group_size); },
                       std::string(quant_format_name(f)) + " group " + std::to_string(group_size));
  const int64_t E = w13.size(0), Ip = w13.size(1) * kW13BlockInter;
  // The packed w13 holds Ip/32 blocks: check it as a [2*Ip, H] weight (the padded rows are what was packed).
  const QuantPackedShape s13 = check_quant_packed(w13, "packed w13", f, 2 * Ip, H, group_size, true);
  const QuantPackedShape s2 = check_quant_packed(w2, "packed w2", f, H, Ip, group_size, false);
  TORCH_CHECK_VALUE(w2.size(0) == E, "packed w2 holds ", w2.size(0), " experts, w13 ", E);
  ExpertWeights w{{}, w13, w2};
  FusedMoeArgs& a = w.args;
  a.quant = &qk;
  a.format = f;
  a.group13 = s13.group;
  a.group2 = s2.group;
  a.symmetric13 = packed_info_or_throw(w13, "packed w13").symmetric;
  a.symmetric2 = packed_info_or_throw(w2, "packed w2").symmetric;
  a.dtype = dt;
  a.act = to_activation(std::string(activation));
  a.H = H, a.I = Ip, a.local_experts = E;
  attach_extras(w, w13_bias, w2_bias, expert_map, apply_router_weight_on_input);
  return w;
}

at::Tensor fused_experts_quant(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                               const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                               std::string_view kernel_name, std::string_view format, int64_t group_size,
                               std::string_view activation, const std::optional<at::Tensor>& w13_bias,
                               const std::optional<at::Tensor>& w2_bias, const std::optional<at::Tensor>& expert_map,
                               bool apply_router_weight_on_input) {
  check_dense(hidden, "hidden_states", 2);
  const ExpertWeights w = quant_expert_weights(hidden.size(1), hidden.scalar_type(), w13, w2, kernel_name, format,
                                               group_size, activation, w13_bias, w2_bias, expert_map,
                                               apply_router_weight_on_input);
  const int64_t k = check_routes(topk_weights, topk_ids, hidden.size(0));
  return run_experts(w, hidden, topk_weights.data_ptr<float>(), topk_ids.data_ptr<int32_t>(), k);
}

// The bias check, output and run both linear ops share; `a` holds the weights' tiles and dtype.
at::Tensor run_linear(LinearArgs& a, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      int64_t out_features) {
  const int64_t K = x.size(-1);
  at::Tensor x2 = x.reshape({-1, K}).contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features;
  at::Tensor out = new_output({x2.size(0), out_features}, x.options());
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "bias must be [", out_features, "], got ",
                bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  a.M = x2.size(0), a.K = K, a.N = out_features;
  a.x = x2.data_ptr();
  a.w = w.data_ptr();
  a.bias = bias ? b.data_ptr<float>() : nullptr;
  a.out = out.data_ptr();
  linear(a, kernel_parallel());
  check_output_guards(out, "linear");
  return out.view(out_shape);
}

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        std::string_view backend, std::string_view format, int64_t group_size, int64_t out_features) {
  const QuantFormat f = to_format(std::string(format));
  const QuantKernel& qk = quant_kernel_or_throw(std::string(backend), f);
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "x must be a CPU tensor of shape [..., K], got ", x.sizes());
  const DType dt = to_dtype(x, "x");
  TORCH_CHECK_VALUE(quant_int8_activations(f) || dt == DType::kBFloat16, quant_format_name(f),
                    " takes bfloat16 activations, got ", x.scalar_type());
  const int64_t K = x.size(-1);
  check_dense(w, "packed linear weight", 3);
  check_packed_linear(w, out_features, K, [&](const PackedInfo& i) { return same_quant_packing(i, f, group_size); },
                      std::string(quant_format_name(f)) + " group " + std::to_string(group_size));
  const QuantPackedShape s = check_quant_packed(w, "packed linear weight", f, out_features, K, group_size, false);
  TORCH_CHECK_VALUE(w.size(0) == 1, "packed linear weight must hold one matrix, got ", w.sizes());
  LinearArgs a;
  a.quant = &qk;
  a.format = f;
  a.group = s.group;
  a.symmetric = packed_info_or_throw(w, "packed linear weight").symmetric;
  a.dtype = dt;
  return run_linear(a, x, w, bias, out_features);
}

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                     std::string_view backend, int64_t out_features) {
  const KernelTable& kt = kernel_or_throw(std::string(backend));
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1, "x must be a CPU tensor of shape [..., K], got ", x.sizes());
  const DType dt = to_dtype(x, "x");
  TORCH_CHECK(kt.supports(dt), "kernel backend '", kt.name, "' does not take ", dtype_name(dt), " activations");
  check_dense(w, "packed linear weight", 3);
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "packed weight dtype ", w.scalar_type(), " differs from x's ",
              x.scalar_type());
  const int64_t K = x.size(-1);
  check_packed_linear(w, out_features, K, [&](const PackedInfo& i) { return !i.quant && i.layout == kt.layout; },
                      "backend '" + std::string(kt.name) + "'");
  const PackedShape s = w2_packed_shape(out_features, K, kt.layout);
  TORCH_CHECK(w.size(0) == 1 && w.size(1) == s.blocks && w.size(2) == s.block_elems, "packed linear weight ",
              w.sizes(), " does not match in_features ", K, " and out_features ", out_features, " for backend '",
              kt.name, "' (expected [1, ", s.blocks, ", ", s.block_elems, "])");
  LinearArgs a;
  a.kernels = &kt;
  a.dtype = dt;
  return run_linear(a, x, w, bias, out_features);
}

// The routing of logits over E experts, checked: every field of RoutingArgs but the logits' (logits, dtype, M) and
// the outputs. The bias is read where it lies; the caller keeps it alive.
RoutingArgs routing_args(int64_t E, int64_t top_k, std::string_view scoring, bool renormalize,
                         const std::optional<at::Tensor>& bias, double routed_scaling_factor) {
  RoutingArgs a;
  a.E = E, a.top_k = top_k;
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= E, "top_k must be in [1, E=", E, "], got ", top_k);
  TORCH_CHECK_VALUE(scoring == "softmax" || scoring == "sigmoid", "unknown scoring '", std::string(scoring),
                    "', expected softmax or sigmoid");
  a.sigmoid = scoring == "sigmoid";
  a.renormalize = renormalize;
  if (bias) {
    check_dense(*bias, "e_score_correction_bias", 1);
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->size(0) == E,
                      "e_score_correction_bias must be float32 [E=", E, "], got ", bias->scalar_type(), " ",
                      bias->sizes());
    a.bias = bias->data_ptr<float>();
  }
  a.scale = float(routed_scaling_factor);
  return a;
}

// Router logits [M, E] -> (weights float32 [M, k], ids int32 [M, k]); see routing.h.
std::tuple<at::Tensor, at::Tensor> route_op(const at::Tensor& logits, int64_t top_k, std::string_view scoring,
                                            bool renormalize, const std::optional<at::Tensor>& bias,
                                            double routed_scaling_factor) {
  check_dense(logits, "router_logits", 2);
  const DType dtype = to_dtype(logits, "router_logits");
  RoutingArgs a = routing_args(logits.size(1), top_k, scoring, renormalize, bias, routed_scaling_factor);
  a.dtype = dtype;
  a.M = logits.size(0);
  at::Tensor weights = new_output({a.M, top_k}, logits.options().dtype(at::kFloat));
  at::Tensor ids = new_output({a.M, top_k}, logits.options().dtype(at::kInt));
  a.logits = logits.data_ptr();
  a.weights = weights.data_ptr<float>();
  a.ids = ids.data_ptr<int32_t>();
  route(a, kernel_parallel());
  check_output_guards(weights, "route (weights)");
  check_output_guards(ids, "route (ids)");
  return {weights, ids};
}

// One query token per sequence over the paged cache; see attention.h. The block table and key ranges are
// checked against the cache here: the kernel reads wherever they point.
// A paged cache [blocks][block_size][nkv][width]: contiguous, or a view of the leading `width` channels of wider
// rows (a slot's heads adjacent, its slots evenly spaced, blocks one after another).
void check_cache(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 4, what, " must be 4-D, got shape ", t.sizes());
  TORCH_CHECK(t.stride(3) == 1 && (t.size(2) == 1 || t.stride(2) == t.size(3)) &&
                  t.stride(1) >= t.size(2) * t.size(3) && (t.size(0) == 1 || t.stride(0) == t.size(1) * t.stride(1)),
              what, " must be contiguous, or a view of each slot's leading channels; got shape ", t.sizes(),
              " strides ", t.strides());
}

at::Tensor decode_attention_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_table, const at::Tensor& key_begin,
                               const at::Tensor& key_end, double scale, const std::optional<at::Tensor>& sinks,
                               const std::string& backend) {
  check_dense(q, "q", 3);
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  check_dense(block_table, "block_table", 2);
  check_dense(key_begin, "key_begin", 1);
  check_dense(key_end, "key_end", 1);
  DecodeAttentionArgs a;
  a.dtype = to_dtype(q, "q");
  TORCH_CHECK_VALUE(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
                    "k_cache and v_cache must be ", q.scalar_type(), " like q, got ", k_cache.scalar_type(), " and ",
                    v_cache.scalar_type());
  a.S = q.size(0), a.nh = q.size(1), a.d = q.size(2);
  const int64_t blocks = k_cache.size(0);
  a.block_size = k_cache.size(1), a.nkv = k_cache.size(2), a.dv = v_cache.size(3);
  TORCH_CHECK_VALUE(k_cache.size(3) == a.d, "k_cache head size ", k_cache.size(3), " differs from q's ", a.d);
  TORCH_CHECK_VALUE(v_cache.size(0) == blocks && v_cache.size(1) == a.block_size && v_cache.size(2) == a.nkv,
                    "v_cache ", v_cache.sizes(), " does not match k_cache ", k_cache.sizes());
  TORCH_CHECK_VALUE(a.nkv > 0 && a.nh % a.nkv == 0, "q's ", a.nh, " heads are not a multiple of the cache's ",
                    a.nkv, " KV heads");
  TORCH_CHECK_VALUE(block_table.scalar_type() == at::kLong && key_begin.scalar_type() == at::kLong &&
                        key_end.scalar_type() == at::kLong,
                    "block_table, key_begin and key_end must be int64");
  TORCH_CHECK_VALUE(block_table.size(0) == a.S && key_begin.size(0) == a.S && key_end.size(0) == a.S,
                    "block_table ", block_table.sizes(), ", key_begin ", key_begin.sizes(), " and key_end ",
                    key_end.sizes(), " must have q's ", a.S, " sequences");
  a.n = block_table.size(1);
  a.block_table = block_table.data_ptr<int64_t>();
  a.key_begin = key_begin.data_ptr<int64_t>();
  a.key_end = key_end.data_ptr<int64_t>();
  for (int64_t s = 0; s < a.S; ++s) {
    const int64_t b = a.key_begin[s], e = a.key_end[s];
    TORCH_CHECK_VALUE(0 <= b && b <= e && e <= a.n * a.block_size, "sequence ", s, ": keys [", b, ", ", e,
                      ") are outside its block table of ", a.n, " x ", a.block_size);
    for (int64_t j = b / a.block_size; j < (e + a.block_size - 1) / a.block_size; ++j) {
      const int64_t block = a.block_table[s * a.n + j];
      TORCH_CHECK_VALUE(0 <= block && block < blocks, "sequence ", s, ": block ", block, " is outside the cache's ",
                        blocks);
    }
  }
  if (sinks) {
    check_dense(*sinks, "sinks", 1);
    TORCH_CHECK_VALUE(sinks->scalar_type() == at::kFloat && sinks->size(0) == a.nh, "sinks must be float32 [", a.nh,
                      "], got ", sinks->scalar_type(), " ", sinks->sizes());
    a.sinks = sinks->data_ptr<float>();
  }
  a.scale = float(scale);
  at::Tensor out = new_output({a.S, a.nh, a.dv}, q.options());
  a.q = q.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.k_slot_stride = k_cache.stride(1);
  a.v_slot_stride = v_cache.stride(1);
  a.out = out.data_ptr();
  const KernelTable* kernel = &attention_kernel();
  if (!backend.empty()) {
    kernel = &kernel_or_throw(backend);
    TORCH_CHECK_VALUE(kernel->attention, "kernel backend '", backend, "' has no decode attention");
  }
  decode_attention(a, *kernel, kernel_parallel());
  check_output_guards(out, "decode_attention");
  return out;
}

// RMSNorm over x's last dimension (with a residual: of x + residual, also returned); see norm.h.
std::tuple<at::Tensor, at::Tensor> rms_norm_impl(const at::Tensor& x, const at::Tensor* residual,
                                                 const at::Tensor& weight, double eps, bool weight_in_float) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous CPU tensor");
  check_dense(weight, "weight", 1);
  RmsNormArgs a;
  a.dtype = to_dtype(x, "x");
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type() && weight.size(0) == x.size(-1), "weight must be ",
                    x.scalar_type(), " [", x.size(-1), "] like x's last dimension, got ", weight.scalar_type(), " ",
                    weight.sizes());
  at::Tensor out = new_output(x.sizes(), x.options()), sum;
  if (residual) {
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                          residual->is_contiguous() && residual->device().is_cpu(),
                      "residual must be a contiguous CPU tensor of x's shape and dtype ", x.scalar_type(), " ",
                      x.sizes(), ", got ", residual->scalar_type(), " ", residual->sizes());
    sum = new_output(x.sizes(), x.options());
    a.residual = residual->data_ptr();
    a.sum = sum.data_ptr();
  }
  a.dim = x.size(-1);
  a.rows = a.dim ? x.numel() / a.dim : 0;
  a.eps = float(eps);
  a.weight_in_float = weight_in_float;
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.out = out.data_ptr();
  rms_norm(a, kernel_parallel());
  check_output_guards(out, "rms_norm");
  if (residual) check_output_guards(sum, "add_rms_norm");
  return {out, sum};
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps, bool weight_in_float) {
  return std::get<0>(rms_norm_impl(x, nullptr, weight, eps, weight_in_float));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& x, const at::Tensor& residual,
                                                   const at::Tensor& weight, double eps, bool weight_in_float) {
  return rms_norm_impl(x, &residual, weight, eps, weight_in_float);
}

// RoPE on q and k in place, then k and v into their cache slots; see rope.h.
void rope_and_cache_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& slot_mapping, const std::optional<at::Tensor>& q_norm,
                       const std::optional<at::Tensor>& k_norm, double norm_eps) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&k_cache, "k_cache"},
                                {&v_cache, "v_cache"}})
    check_dense(*t, name, t == &k_cache || t == &v_cache ? 4 : 3);
  check_dense(cos, "cos", 2);
  check_dense(sin, "sin", 2);
  const int64_t T = q.size(0), nkv = k.size(1), d = q.size(2), dv = v.size(2);
  RopeCacheArgs a;
  a.dtype = to_dtype(q, "q");
  for (const auto& [t, name] : {std::pair{&k, "k"}, {&v, "v"}, {&cos, "cos"}, {&sin, "sin"}, {&k_cache, "k_cache"},
                                {&v_cache, "v_cache"}})
    TORCH_CHECK_VALUE(t->scalar_type() == q.scalar_type(), name, " must be ", q.scalar_type(), " like q, got ",
                      t->scalar_type());
  TORCH_CHECK_VALUE(d % 2 == 0, "the head size must be even for RoPE, got ", d);
  TORCH_CHECK_VALUE(k.size(0) == T && k.size(2) == d && v.size(0) == T && v.size(1) == nkv, "k must be [", T, ", nkv, ",
                    d, "] and v [", T, ", nkv, dv] with q [", T, ", nh, ", d, "]; got k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) == d, "cos and sin must be [", T,
                    ", ", d, "], got ", cos.sizes(), " and ", sin.sizes());
  TORCH_CHECK_VALUE(k_cache.size(2) == nkv && k_cache.size(3) == d && v_cache.size(2) == nkv && v_cache.size(3) == dv &&
                        v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1),
                    "k_cache must be [blocks, block_size, ", nkv, ", ", d, "] and v_cache [.., ", nkv, ", ", dv,
                    "]; got ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == T &&
                        slot_mapping.is_contiguous(), "slot_mapping must be int64 [", T, "], got ",
                    slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(slot[t] >= 0 && slot[t] < slots, "slot_mapping[", t, "] = ", slot[t], " is outside the cache's ",
                      slots, " slots");
  a.tokens = T;
  a.nh = q.size(1);
  a.nkv = nkv;
  a.d = d;
  a.dv = dv;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.slots = slot;
  TORCH_CHECK_VALUE(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm are given together or not at all");
  if (q_norm) {
    for (const auto& [t, name] : {std::pair{&*q_norm, "q_norm"}, {&*k_norm, "k_norm"}}) {
      check_dense(*t, name, 1);
      TORCH_CHECK_VALUE(t->scalar_type() == q.scalar_type() && t->size(0) == d, name, " must be ", q.scalar_type(),
                        " [", d, "] (a head's RMSNorm weight), got ", t->scalar_type(), " ", t->sizes());
    }
    a.q_norm = q_norm->data_ptr();
    a.k_norm = k_norm->data_ptr();
    a.norm_eps = float(norm_eps);
  }
  rope_and_cache(a, kernel_parallel());
}

// The softmax of a prefill chunk's attention scores with its causal (and window) mask and sinks; see softmax.h.
at::Tensor causal_softmax_op(const at::Tensor& scores, double scale, int64_t first_query, int64_t first_key,
                             int64_t window, const std::optional<at::Tensor>& sinks) {
  check_dense(scores, "scores", 3);
  CausalSoftmaxArgs a;
  a.dtype = to_dtype(scores, "scores");
  a.heads = scores.size(0);
  a.queries = scores.size(1);
  a.keys = scores.size(2);
  TORCH_CHECK_VALUE(first_query >= 0 && first_key >= 0 && window >= 0, "causal_softmax: first_query (", first_query,
                    "), first_key (", first_key, ") and window (", window, ") must be >= 0");
  TORCH_CHECK_VALUE(first_key <= first_query, "causal_softmax: the first query (position ", first_query,
                    ") sees no key: the keys start at position ", first_key);
  TORCH_CHECK_VALUE(first_query + a.queries <= first_key + a.keys, "causal_softmax: the last query (position ",
                    first_query + a.queries - 1, ") is past the last key (position ", first_key + a.keys - 1,
                    "): its own key is missing");
  if (sinks) {
    check_dense(*sinks, "sinks", 1);
    TORCH_CHECK_VALUE(sinks->scalar_type() == at::kFloat && sinks->size(0) == a.heads, "sinks must be float32 [",
                      a.heads, "] (one logit a head), got ", sinks->scalar_type(), " ", sinks->sizes());
    a.sinks = sinks->data_ptr<float>();
  }
  at::Tensor probs = new_output(scores.sizes(), scores.options());
  a.scores = scores.data_ptr();
  a.probs = probs.data_ptr();
  a.first_query = first_query;
  a.first_key = first_key;
  a.window = window;
  a.scale = float(scale);
  causal_softmax(a, kernel_parallel());
  check_output_guards(probs, "causal_softmax");
  return probs;
}

// One prefill chunk's causal attention, flash-style; see prefill_attention.h. q [nh, T, d], k [nkv, L, d],
// v [nkv, L, dv] with rows of d contiguous (any strides between them) -> [nh, T, dv], stored token-major.
at::Tensor prefill_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                int64_t window, const std::optional<at::Tensor>& sinks) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->dim() == 3, name, " must be a 3-d CPU tensor, got ", t->sizes());
    TORCH_CHECK_VALUE(t->stride(2) == 1 || t->size(2) == 1, name, "'s rows must be contiguous, got strides ",
                      t->strides());
    TORCH_CHECK_VALUE(t->scalar_type() == q.scalar_type(), name, " must be ", q.scalar_type(), " like q, got ",
                      t->scalar_type());
  }
  PrefillAttentionArgs a;
  a.dtype = to_dtype(q, "q");
  a.nh = q.size(0), a.T = q.size(1), a.d = q.size(2);
  a.nkv = k.size(0), a.L = k.size(1), a.dv = v.size(2);
  TORCH_CHECK_VALUE(a.nkv > 0 && a.nh % a.nkv == 0 && k.size(2) == a.d && v.size(0) == a.nkv && v.size(1) == a.L,
                    "prefill_attention: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(),
                    " do not fit (q [nh, T, d], k [nkv, L, d], v [nkv, L, dv], nh a multiple of nkv)");
  TORCH_CHECK_VALUE(a.T <= a.L, "prefill_attention: ", a.T, " queries over ", a.L,
                    " keys (the queries are the last T of the keys' positions)");
  TORCH_CHECK_VALUE(window >= 0, "prefill_attention: window must be >= 0 (0: none), got ", window);
  if (sinks) {
    check_dense(*sinks, "sinks", 1);
    TORCH_CHECK_VALUE(sinks->scalar_type() == at::kFloat && sinks->size(0) == a.nh, "sinks must be float32 [", a.nh,
                      "] (one logit a head), got ", sinks->scalar_type(), " ", sinks->sizes());
    a.sinks = sinks->data_ptr<float>();
  }
  if (const char* why = prefill_attention_unsupported(a)) TORCH_CHECK_VALUE(false, "prefill_attention: ", why);
  at::Tensor out = new_output({a.T, a.nh, a.dv}, q.options());
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr(), a.out = out.data_ptr();
  a.q_head_stride = q.stride(0), a.q_token_stride = q.stride(1);
  a.k_head_stride = k.stride(0), a.k_token_stride = k.stride(1);
  a.v_head_stride = v.stride(0), a.v_token_stride = v.stride(1);
  a.window = window;
  a.scale = float(scale);
  prefill_attention(a, kernel_parallel());
  check_output_guards(out, "prefill_attention");
  return out.transpose(0, 1);
}

// Logits [B, V] float32 -> int64 [B]: each row's argmax, kNoToken for a row with a NaN; see greedy.h.
at::Tensor greedy_tokens_op(const at::Tensor& logits) {
  check_dense(logits, "logits", 2);
  TORCH_CHECK_VALUE(logits.scalar_type() == at::kFloat, "logits must be float32, got ", logits.scalar_type());
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  greedy_tokens(logits.data_ptr<float>(), logits.size(0), logits.size(1), out.data_ptr<int64_t>(), kernel_parallel());
  return out;
}

#include "decode_layer.inc"
#include "routed_experts.inc"
#include "decode_model.inc"

}  // namespace

TORCH_LIBRARY(cpumoe, m) {
  m.def("route(Tensor router_logits, int top_k, str scoring, bool renormalize, Tensor? bias, "
        "float routed_scaling_factor) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool weight_in_float=False) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool weight_in_float=False) "
        "-> (Tensor, Tensor)");
  m.def("rope_and_cache(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, Tensor(c!) k_cache, "
        "Tensor(d!) v_cache, Tensor slot_mapping, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float norm_eps=1e-6) -> ()");
  m.def("causal_softmax(Tensor scores, float scale, int first_query, int first_key, int window, Tensor? sinks) "
        "-> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor key_begin, "
        "Tensor key_end, float scale, Tensor? sinks, str backend=\"\") -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int window, Tensor? sinks) -> Tensor");
  m.def("greedy_tokens(Tensor logits) -> Tensor");
  m.def("pack_w13(Tensor w13, str backend) -> Tensor");
  m.def("pack_w2(Tensor w2, str backend) -> Tensor");
  m.def("linear(Tensor x, Tensor w, Tensor? bias, *, str backend, int out_features) -> Tensor");
  m.def("pack_quant(Tensor qweight, Tensor scales, Tensor? zeros, *, str format, int group_size, bool w13) -> Tensor");
  m.def(
      "fused_experts_quant(Tensor hidden_states, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, *, "
      "str backend, str format, int group_size, str activation, Tensor? w13_bias=None, Tensor? w2_bias=None, "
      "Tensor? expert_map=None, bool apply_router_weight_on_input=False) -> Tensor");
  m.def("linear_quant(Tensor x, Tensor w, Tensor? bias, *, str backend, str format, int group_size, int out_features) "
        "-> Tensor");
  m.def(
      "fused_experts(Tensor hidden_states, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, *, "
      "str backend, str activation, Tensor? w13_bias=None, Tensor? w2_bias=None, Tensor? expert_map=None, "
      "bool apply_router_weight_on_input=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(cpumoe, CPU, m) {
  m.impl("pack_w13", &pack_w13_op);
  m.impl("pack_w2", &pack_w2_op);
  m.impl("fused_experts", &fused_experts);
  m.impl("linear", &linear_op);
  m.impl("pack_quant", &pack_quant_op);
  m.impl("fused_experts_quant", &fused_experts_quant);
  m.impl("linear_quant", &linear_quant);
  m.impl("route", &route_op);
  m.impl("decode_attention", &decode_attention_op);
  m.impl("rms_norm", &rms_norm_op);
  m.impl("add_rms_norm", &add_rms_norm_op);
  m.impl("rope_and_cache", &rope_and_cache_op);
  m.impl("causal_softmax", &causal_softmax_op);
  m.impl("prefill_attention", &prefill_attention_op);
  m.impl("greedy_tokens", &greedy_tokens_op);
}

}  // namespace cpumoe

PYBIND11_MODULE(_C, m) {
  m.doc() = "cpumoe native helpers (tensor ops are under torch.ops.cpumoe)";
  m.def("cpu_features", &cpumoe::cpu_features, "Usable CPU features, as /proc/cpuinfo names them");
  m.def("kernel_backends", [] {
    std::vector<std::tuple<std::string, std::string, std::string, int, std::vector<std::string>,
                           std::vector<std::string>>> out;
    const char* layouts[] = {"kn", "pairs", "quads"};
    for (const auto& k : cpumoe::kernel_backends()) {
      std::vector<std::string> dtypes;
      if (k.table)
        for (auto d : {cpumoe::DType::kFloat32, cpumoe::DType::kBFloat16, cpumoe::DType::kFloat16})
          if (k.table->supports(d)) dtypes.push_back(cpumoe::dtype_name(d));
      std::vector<std::string> formats;
      for (int f = 0; f < cpumoe::kNumQuantFormats; ++f)
        if (k.quant[f]) formats.push_back(cpumoe::quant_format_name(cpumoe::QuantFormat(f)));
      out.emplace_back(k.name, k.unavailable, k.table ? layouts[int(k.table->layout)] : "",
                       k.table ? k.table->max_rows : 0, dtypes, formats);
    }
    return out;
  }, "(name, why unavailable or '', layout, rows per tile, dtypes, quantized formats) for every kernel backend, "
     "fastest first");
  m.def("quant_packed_shape", [](const std::string& format, int64_t N, int64_t K, int64_t group, bool w13,
                                 bool symmetric) {
    auto s = cpumoe::quant_shape_or_throw(cpumoe::to_format(format), N, K, group, w13, symmetric);
    return std::make_tuple(s.blocks, s.block_bytes);
  }, "(blocks, bytes per block) of one packed quantized matrix [N, K]; symmetric: int4 without zero points",
  pybind11::arg("format"), pybind11::arg("N"), pybind11::arg("K"), pybind11::arg("group"), pybind11::arg("w13"),
  pybind11::arg("symmetric") = false);
  m.def("packed_shapes", [](int64_t H, int64_t I, const std::string& kernel) {
    const cpumoe::KernelTable& kt = cpumoe::kernel_or_throw(kernel);
    auto a = cpumoe::w13_packed_shape(H, I, kt.layout), b = cpumoe::w2_packed_shape(H, I, kt.layout);
    return std::make_tuple(std::make_tuple(a.blocks, a.block_elems), std::make_tuple(b.blocks, b.block_elems));
  }, "((w13 blocks, block elems), (w2 blocks, block elems)) per expert for hidden H, intermediate I");
  pybind11::class_<cpumoe::ReadBandwidthProbe>(m, "ReadBandwidthProbe",
      "A buffer of `bytes`; read_gbps() times one multi-threaded streaming read of all of it")
      .def(pybind11::init([](int64_t bytes) {
             return new cpumoe::ReadBandwidthProbe(bytes, cpumoe::kernel_parallel());
           }), pybind11::arg("bytes"))
      .def("read_gbps", &cpumoe::ReadBandwidthProbe::read_gbps, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("bytes", &cpumoe::ReadBandwidthProbe::bytes);
  m.def("empty_packed_stack", [](const at::Tensor& like, int64_t experts) {
    const cpumoe::PackedInfo info = cpumoe::packed_info_or_throw(like, "like");
    std::vector<int64_t> sizes(like.sizes().begin(), like.sizes().end());
    TORCH_CHECK_VALUE(experts > 0 && !sizes.empty(), "experts must be positive, got ", experts);
    sizes[0] = experts;
    return cpumoe::empty_packed(sizes, like.scalar_type(), info);
  }, "An uninitialized stack of `experts` packings recorded as `like` was (its shape but the first dimension), "
     "on memory of its own: for packing expert by expert", pybind11::arg("like"), pybind11::arg("experts"));
  m.def("join_packed_rows", &cpumoe::join_packed_rows,
        "One packed linear weight whose rows are those of `parts` in order (packed linear weights of one packing "
        "and input width, each filling its last block of rows), on memory of its own", pybind11::arg("parts"));
  m.def("attention_backends", [] {
    std::vector<std::string> names;
    for (const cpumoe::KernelInfo& info : cpumoe::kernel_backends())
      if (info.table && info.table->attention) names.push_back(info.name);
    return names;
  }, "The available kernel backends with decode attention, fastest first");
  m.def("attention_scope", [](const std::string& backend) {
    const cpumoe::KernelTable& kt = cpumoe::kernel_or_throw(backend);
    return std::string(kt.attention_scope ? kt.attention_scope : "");
  }, "The calls a backend's decode attention hands to another backend's kernel, in words ('' when none)",
        pybind11::arg("backend"));
  m.def("prefill_attention_backend", [] { return std::string(cpumoe::prefill_attention_backend()); },
        "The kernel backend that runs prefill_attention here ('' when none: the torch maths runs)");
  m.def("prefill_attention_refusal", [](const std::string& dtype, int64_t d, int64_t dv) {
    cpumoe::PrefillAttentionArgs a;
    if (dtype == "float32") a.dtype = cpumoe::DType::kFloat32;
    else if (dtype == "float16") a.dtype = cpumoe::DType::kFloat16;
    else if (dtype != "bfloat16") return "cpumoe's kernels take float32, bfloat16 or float16, not " + dtype;
    a.d = d, a.dv = dv;
    const char* why = cpumoe::prefill_attention_unsupported(a);
    return std::string(why ? why : "");
  }, "Why prefill_attention cannot run chunks of this dtype (torch's name) and head sizes here ('' when it can)",
        pybind11::arg("dtype"), pybind11::arg("d"), pybind11::arg("dv"));
  m.def("set_output_guards", [](bool on) { cpumoe::output_guards() = on; },
        "Test aid: outputs get guard bytes around them, checked by every op before it returns");
  m.def("check_output_guards", [](const at::Tensor& out) { cpumoe::check_output_guards(out, "a write"); },
        "Raises when a guard byte around an output (made with guards on) changed");
  m.def("fused_moe_clock", [] {
    const cpumoe::KernelClock c = cpumoe::fused_moe_clock();
    return std::make_tuple(c.calls, c.last_ns);
  }, "(calls, ns): the calling thread's fused experts calls so far and the last one's time in its native kernel");
  m.def("next_huge_mapping", &cpumoe::next_huge_mapping,
        "The number the next buffer on memory of its own (map_huge: packed weights, the KV cache) will take");
  m.def("huge_mappings_since", &cpumoe::huge_mappings_since, pybind11::arg("number"),
        "[(address, bytes)] of the live map_huge buffers numbered `number` or later");
  m.def("zeros_on_huge_pages", [](int64_t bytes) {
    TORCH_CHECK_VALUE(bytes > 0, "zeros_on_huge_pages needs a positive size, got ", bytes);
    void* p = cpumoe::map_huge_zeroed(size_t(bytes));
    return at::from_blob(p, {bytes}, [bytes](void* q) { cpumoe::unmap_huge(q, size_t(bytes)); },
                         at::TensorOptions().dtype(at::kByte));
  }, pybind11::arg("bytes"), "A zero-filled uint8 [bytes] tensor on memory of its own, advised for 2 MB pages and "
     "faulted in (map_huge_zeroed)");
  m.def("release_free_memory", &cpumoe::release_free_memory,
        "Return the allocator's free memory to the OS (malloc_trim); false if nothing was released");
  cpumoe::bind_decode_layer(m);
  cpumoe::bind_routed_experts(m);
  cpumoe::bind_decode_model(m);
  m.def("measure_read_bandwidth", [](int64_t bytes, int repetitions) {
    auto r = cpumoe::measure_read_bandwidth(bytes, repetitions, cpumoe::kernel_parallel());
    return std::make_tuple(r.best_gbps, r.median_gbps);
  }, pybind11::arg("bytes"), pybind11::arg("repetitions") = 5,
     "(best, median) GB/s of a multi-threaded streaming read of a buffer of `bytes`",
     pybind11::call_guard<pybind11::gil_scoped_release>());
}
