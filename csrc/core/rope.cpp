#include "rope.h"

#include "norm.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace cpumoe {
namespace {

constexpr int64_t kMaxHalf = 512;  // head dims up to 1024 (Gemma 4's global layers: 512)

// One head row of d values at p, rotated in place. Element i and i + half are read and written by step i alone,
// so the row needs no copy (a copy through stack arrays stalled on store forwarding: 6 ms of a 512-token layer).
template <DType D>
void rotate_row(void* __restrict p, const void* __restrict cos, const void* __restrict sin, int64_t t, int64_t d) {
  const int64_t half = d / 2;
  const int64_t row = t * d;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load_f32<D>(p, i), x2 = load_f32<D>(p, i + half);
    const float c1 = load_f32<D>(cos, row + i), c2 = load_f32<D>(cos, row + i + half);
    const float s1 = load_f32<D>(sin, row + i), s2 = load_f32<D>(sin, row + i + half);
    store_f32<D>(p, i, round_to<D>(round_to<D>(x1 * c1) - round_to<D>(x2 * s1)));
    store_f32<D>(p, i + half, round_to<D>(round_to<D>(x2 * c2) + round_to<D>(x1 * s2)));
  }
}

// One head row of d values at p RMS-normalized in place with weight w [d] (float), as rms_norm rounds it.
template <DType D>
void norm_row(void* p, const float* w, int64_t d, float eps) {
  float x[2 * kMaxHalf];
  for (int64_t i = 0; i < d; ++i) x[i] = load_f32<D>(p, i);
  const float inv = inv_rms(x, d, eps);
  for (int64_t i = 0; i < d; ++i) store_f32<D>(p, i, w[i] * round_to<D>(x[i] * inv));
}

// Token t of the step: its q and k heads normalized (when qw is given) and rotated, then k and v into the cache.
CPUMOE_VECTOR_CLONES
void rope_token(const RopeCacheArgs& a, int64_t t, const float* qw, const float* kw) {
  const int64_t es = dtype_size(a.dtype);
  char* q = static_cast<char*>(a.q) + t * a.nh * a.d * es;
  char* k = static_cast<char*>(a.k) + t * a.nkv * a.d * es;
  with_dtype(a.dtype, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    if (qw) {
      for (int64_t h = 0; h < a.nh; ++h) norm_row<D>(q + h * a.d * es, qw, a.d, a.norm_eps);
      for (int64_t h = 0; h < a.nkv; ++h) norm_row<D>(k + h * a.d * es, kw, a.d, a.norm_eps);
    }
    for (int64_t h = 0; h < a.nh; ++h) rotate_row<D>(q + h * a.d * es, a.cos, a.sin, t, a.d);
    for (int64_t h = 0; h < a.nkv; ++h) rotate_row<D>(k + h * a.d * es, a.cos, a.sin, t, a.d);
  });
  const int64_t slot = a.slots[t];
  std::memcpy(static_cast<char*>(a.k_cache) + slot * a.nkv * a.d * es, k, a.nkv * a.d * es);
  std::memcpy(static_cast<char*>(a.v_cache) + slot * a.nkv * a.dv * es,
              static_cast<const char*>(a.v) + t * a.nkv * a.dv * es, a.nkv * a.dv * es);
}

}  // namespace

void rope_and_cache(const RopeCacheArgs& a, const Parallel& parallel) {
  if (a.d / 2 > kMaxHalf)
    throw std::invalid_argument("rope_and_cache: head dim " + std::to_string(a.d) + " above " +
                                std::to_string(2 * kMaxHalf));
  const bool norm = a.q_norm != nullptr;
  float qw[2 * kMaxHalf], kw[2 * kMaxHalf];
  for (int64_t i = 0; norm && i < a.d; ++i)
    qw[i] = load_as_f32(a.q_norm, i, a.dtype), kw[i] = load_as_f32(a.k_norm, i, a.dtype);
  parallel_items(parallel, a.tokens, [&](int64_t t) { rope_token(a, t, norm ? qw : nullptr, kw); });
}

}  // namespace cpumoe
