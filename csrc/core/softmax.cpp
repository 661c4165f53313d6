#include "softmax.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace cpumoe {
namespace {

using simd::f32x16;

constexpr int64_t kRowsPerItem = 8;

// Row r (head r / queries, query r % queries): its visible keys [lo, hi) exponentiated into buf, then scaled by
// the sum's inverse and stored; the hidden keys get 0.
template <DType D>
void softmax_row(const CausalSoftmaxArgs& a, int64_t r, float* __restrict buf) {
  const int64_t L = a.keys, position = a.first_query + r % a.queries;
  const int64_t hi = std::clamp<int64_t>(position - a.first_key + 1, 0, L);
  const int64_t lo = a.window > 0 ? std::clamp<int64_t>(position - a.window + 1 - a.first_key, 0, hi) : 0;
  const char* in = static_cast<const char*>(a.scores) + r * L * dtype_size(D);
  float m = a.sinks ? a.sinks[r / a.queries] : -std::numeric_limits<float>::infinity();
  f32x16 maxes = simd::splat(m);  // in vectors: a float max reduction does not vectorize by itself
  simd::i32x16 unbounded = {};     // a NaN or +inf score (vexp would clamp it to a number)
  const f32x16 inf = simd::splat(std::numeric_limits<float>::infinity());
  int64_t j = lo;
  for (; j + 16 <= hi; j += 16) {
    const f32x16 x = simd::load<D>(in + j * dtype_size(D)) * a.scale;
    std::memcpy(buf + j, &x, 64);
    maxes = simd::vmax(maxes, x);
    unbounded |= ~(x < inf);
  }
  bool nan_row = false;
  for (int k = 0; k < 16; ++k) m = std::max(m, maxes[k]), nan_row |= unbounded[k] != 0;
  for (; j < hi; ++j) {
    buf[j] = load_f32<D>(in, j) * a.scale;
    m = std::max(m, buf[j]);
    nan_row |= !(buf[j] < inf[0]);
  }
  if (nan_row) {  // as torch's softmax: the whole row NaN
    std::fill(buf, buf + L, std::numeric_limits<float>::quiet_NaN());
    return store_row(buf, static_cast<char*>(a.probs) + r * L * dtype_size(D), L, D);
  }
  // every row sees its own key, so m is finite here
  f32x16 sums = {};
  for (j = lo; j + 16 <= hi; j += 16) {
    const f32x16 e = simd::vexp(simd::load_f32(buf + j) - m);
    std::memcpy(buf + j, &e, 64);
    sums += e;
  }
  float sum = 0.0f;
  for (int k = 0; k < 16; ++k) sum += sums[k];
  for (; j < hi; ++j) {
    const f32x16 e = simd::vexp(simd::splat(buf[j] - m));
    buf[j] = e[0];
    sum += e[0];
  }
  if (a.sinks) sum += simd::vexp(simd::splat(a.sinks[r / a.queries] - m))[0];
  const float inv = 1.0f / sum;
  std::fill(buf, buf + lo, 0.0f);
  for (int64_t k = lo; k < hi; ++k) buf[k] *= inv;
  std::fill(buf + hi, buf + L, 0.0f);
  store_row(buf, static_cast<char*>(a.probs) + r * L * dtype_size(D), L, D);
}

CPUMOE_VECTOR_CLONES
void softmax_rows(const CausalSoftmaxArgs& a, int64_t r0, int64_t r1, float* buf) {
  with_dtype(a.dtype, [&](auto tag) {
    for (int64_t r = r0; r < r1; ++r) softmax_row<decltype(tag)::value>(a, r, buf);
  });
}

}  // namespace

void causal_softmax(const CausalSoftmaxArgs& a, const Parallel& parallel) {
  const int64_t rows = a.heads * a.queries;
  parallel_items(parallel, (rows + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t i) {
    thread_local std::vector<float> buf;
    buf.resize(a.keys);
    softmax_rows(a, i * kRowsPerItem, std::min(rows, (i + 1) * kRowsPerItem), buf.data());
  });
}

}  // namespace cpumoe
