#include "rope.h"

#include <cstring>

namespace cpumoe {
namespace {

inline float round_to(float v, DType d) {
  switch (d) {
    case DType::kFloat32: return v;
    case DType::kBFloat16: return bf16_to_f32(f32_to_bf16(v));
    default: return f16_to_f32(f32_to_f16(v));
  }
}

// One head row of d values at p, rotated in place.
void rotate_row(void* p, const void* cos, const void* sin, int64_t t, int64_t d, DType dt) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load_as_f32(p, i, dt), x2 = load_as_f32(p, i + half, dt);
    const float c1 = load_as_f32(cos, t * d + i, dt), c2 = load_as_f32(cos, t * d + i + half, dt);
    const float s1 = load_as_f32(sin, t * d + i, dt), s2 = load_as_f32(sin, t * d + i + half, dt);
    store_from_f32(p, i, round_to(round_to(x1 * c1, dt) - round_to(x2 * s1, dt), dt), dt);
    store_from_f32(p, i + half, round_to(round_to(x2 * c2, dt) + round_to(x1 * s2, dt), dt), dt);
  }
}

}  // namespace

void rope_and_cache(const RopeCacheArgs& a, const Parallel& parallel) {
  const int64_t es = dtype_size(a.dtype);
  parallel_items(parallel, a.tokens, [&](int64_t t) {
    char* q = static_cast<char*>(a.q) + t * a.nh * a.d * es;
    char* k = static_cast<char*>(a.k) + t * a.nkv * a.d * es;
    for (int64_t h = 0; h < a.nh; ++h) rotate_row(q + h * a.d * es, a.cos, a.sin, t, a.d, a.dtype);
    for (int64_t h = 0; h < a.nkv; ++h) rotate_row(k + h * a.d * es, a.cos, a.sin, t, a.d, a.dtype);
    const int64_t slot = a.slots[t];
    std::memcpy(static_cast<char*>(a.k_cache) + slot * a.nkv * a.d * es, k, a.nkv * a.d * es);
    std::memcpy(static_cast<char*>(a.v_cache) + slot * a.nkv * a.dv * es,
                static_cast<const char*>(a.v) + t * a.nkv * a.dv * es, a.nkv * a.dv * es);
  });
}

}  // namespace cpumoe
