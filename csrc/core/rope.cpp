#include "rope.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace cpumoe {
namespace {

constexpr int64_t kMaxHalf = 512;  // head dims up to 1024 (Gemma 4's global layers: 512)

// One head row of d values at p, rotated in place (the halves read before any is written).
template <DType D>
void rotate_row(void* p, const void* cos, const void* sin, int64_t t, int64_t d) {
  const int64_t half = d / 2;
  float x1[kMaxHalf], x2[kMaxHalf];
  for (int64_t i = 0; i < half; ++i) x1[i] = load_f32<D>(p, i), x2[i] = load_f32<D>(p, i + half);
  for (int64_t i = 0; i < half; ++i) {
    const float c1 = load_f32<D>(cos, t * d + i), c2 = load_f32<D>(cos, t * d + i + half);
    const float s1 = load_f32<D>(sin, t * d + i), s2 = load_f32<D>(sin, t * d + i + half);
    store_f32<D>(p, i, round_to<D>(round_to<D>(x1[i] * c1) - round_to<D>(x2[i] * s1)));
    store_f32<D>(p, i + half, round_to<D>(round_to<D>(x2[i] * c2) + round_to<D>(x1[i] * s2)));
  }
}

}  // namespace

void rope_and_cache(const RopeCacheArgs& a, const Parallel& parallel) {
  if (a.d / 2 > kMaxHalf)
    throw std::invalid_argument("rope_and_cache: head dim " + std::to_string(a.d) + " above " +
                                std::to_string(2 * kMaxHalf));
  const int64_t es = dtype_size(a.dtype);
  parallel_items(parallel, a.tokens, [&](int64_t t) {
    char* q = static_cast<char*>(a.q) + t * a.nh * a.d * es;
    char* k = static_cast<char*>(a.k) + t * a.nkv * a.d * es;
    with_dtype(a.dtype, [&](auto tag) {
      constexpr DType D = decltype(tag)::value;
      for (int64_t h = 0; h < a.nh; ++h) rotate_row<D>(q + h * a.d * es, a.cos, a.sin, t, a.d);
      for (int64_t h = 0; h < a.nkv; ++h) rotate_row<D>(k + h * a.d * es, a.cos, a.sin, t, a.d);
    });
    const int64_t slot = a.slots[t];
    std::memcpy(static_cast<char*>(a.k_cache) + slot * a.nkv * a.d * es, k, a.nkv * a.d * es);
    std::memcpy(static_cast<char*>(a.v_cache) + slot * a.nkv * a.dv * es,
                static_cast<const char*>(a.v) + t * a.nkv * a.dv * es, a.nkv * a.dv * es);
  });
}

}  // namespace cpumoe
