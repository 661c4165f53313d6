#include "norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace cpumoe {
namespace {

constexpr int64_t kRowsPerItem = 16;  // a decode step's few rows stay on the calling thread

template <DType D>
void norm_row(const RmsNormArgs& a, const float* w, int64_t r, float* __restrict buf) {
  const int64_t dim = a.dim;
  if (a.residual) {
    for (int64_t k = 0; k < dim; ++k)
      buf[k] = round_to<D>(load_f32<D>(a.x, r * dim + k) + load_f32<D>(a.residual, r * dim + k));
    store_row(buf, static_cast<char*>(a.sum) + r * dim * dtype_size(D), dim, D);
  } else {
    for (int64_t k = 0; k < dim; ++k) buf[k] = load_f32<D>(a.x, r * dim + k);
  }
  const float inv = inv_rms(buf, dim, a.eps);
  if (a.weight_in_float)
    for (int64_t i = 0; i < dim; ++i) buf[i] = w[i] * (buf[i] * inv);
  else
    for (int64_t i = 0; i < dim; ++i) buf[i] = w[i] * round_to<D>(buf[i] * inv);
  store_row(buf, static_cast<char*>(a.out) + r * dim * dtype_size(D), dim, D);
}

// Rows [r0, r1) of the call.
CPUMOE_VECTOR_CLONES
void norm_rows(const RmsNormArgs& a, const float* w, int64_t r0, int64_t r1, float* buf) {
  with_dtype(a.dtype, [&](auto tag) {
    for (int64_t r = r0; r < r1; ++r) norm_row<decltype(tag)::value>(a, w, r, buf);
  });
}

}  // namespace

void rms_norm(const RmsNormArgs& a, const Parallel& parallel) {
  std::vector<float> w(a.dim);
  for (int64_t k = 0; k < a.dim; ++k) w[k] = load_as_f32(a.weight, k, a.dtype);
  const int64_t items = (a.rows + kRowsPerItem - 1) / kRowsPerItem;
  parallel_items(parallel, items, [&](int64_t i) {
    thread_local std::vector<float> buf;
    buf.resize(a.dim);
    norm_rows(a, w.data(), i * kRowsPerItem, std::min(a.rows, (i + 1) * kRowsPerItem), buf.data());
  });
}

}  // namespace cpumoe
