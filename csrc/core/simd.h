// 16-lane float vectors written with GCC/Clang vector extensions. Each kernel unit includes this and is
// compiled with its own ISA flags, so the same source becomes SSE2, AVX2, AVX-512 or NEON code (a generic unit's
// CPUMOE_VECTOR_CLONES functions get each x86 width the same way).
// Holds the conversions, the activations (exp/erf/tanh approximations, fp32-accurate to a few ulp) and
// the tile epilogues shared by every kernel.
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "types.h"

namespace cpumoe {
namespace simd {

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef half_t f16x16 __attribute__((vector_size(32)));

static inline f32x16 splat(float x) { return f32x16{} + x; }
static inline f32x16 as_f32(i32x16 v) { return reinterpret_cast<f32x16>(v); }
static inline f32x16 as_f32(u32x16 v) { return reinterpret_cast<f32x16>(v); }
static inline i32x16 as_i32(f32x16 v) { return reinterpret_cast<i32x16>(v); }
static inline f32x16 vmin(f32x16 a, f32x16 b) { return a < b ? a : b; }
static inline f32x16 vmax(f32x16 a, f32x16 b) { return a > b ? a : b; }

// ---- load 16 values of a dtype as float32 ----
static inline f32x16 load_f32(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, 64);
  return v;
}
static inline f32x16 load_bf16(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, 32);
  return as_f32(__builtin_convertvector(h, u32x16) << 16);
}
static inline f32x16 load_f16(const uint16_t* p) {
  f16x16 h;
  std::memcpy(&h, p, 32);
  return __builtin_convertvector(h, f32x16);
}
template <DType D>
static inline f32x16 load(const void* p) {
  if constexpr (D == DType::kFloat32) return load_f32(static_cast<const float*>(p));
  else if constexpr (D == DType::kBFloat16) return load_bf16(static_cast<const uint16_t*>(p));
  else return load_f16(static_cast<const uint16_t*>(p));
}
template <DType D>
static inline float load_scalar(const void* p, int64_t i) {
  if constexpr (D == DType::kFloat32) return static_cast<const float*>(p)[i];
  else if constexpr (D == DType::kBFloat16) return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  else return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

// ---- store 16 float32 values as a dtype (round to nearest even, NaN kept) ----
static inline u16x16 to_bf16(f32x16 v) {
  u32x16 u = reinterpret_cast<u32x16>(v);
  u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  u32x16 nan = (u >> 16) | 0x40u;
  u32x16 r = ((u & 0x7fffffffu) > 0x7f800000u) ? nan : rounded;
  return __builtin_convertvector(r, u16x16);
}
template <DType D>
static inline void store(void* p, f32x16 v) {
  if constexpr (D == DType::kFloat32) {
    std::memcpy(p, &v, 64);
  } else if constexpr (D == DType::kBFloat16) {
    u16x16 h = to_bf16(v);
    std::memcpy(p, &h, 32);
  } else {
    f16x16 h = __builtin_convertvector(v, f16x16);
    std::memcpy(p, &h, 32);
  }
}
static inline void store_f32_partial(float* p, f32x16 v, int n) {
  if (n >= 16) std::memcpy(p, &v, 64);
  else if (n > 0) std::memcpy(p, &v, 4 * n);
}

// ---- math ----
// exp(x): Cody-Waite range reduction and a degree-6 polynomial; inputs clamped to [-87.3, 88.7].
static inline f32x16 vexp(f32x16 x) {
  x = vmin(vmax(x, splat(-87.3f)), splat(88.7f));
  const f32x16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  f32x16 t = x * 1.44269504088896341f + magic;
  f32x16 n = t - magic;
  f32x16 r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  f32x16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  i32x16 e = (as_i32(t) - 0x4B400000) << 23;  // 2^n
  return as_f32(as_i32(p) + e);
}
static inline f32x16 vsigmoid(f32x16 x) { return 1.0f / (1.0f + vexp(-x)); }
// erf(x): Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7).
static inline f32x16 verf(f32x16 x) {
  f32x16 ax = vmax(x, -x);
  f32x16 t = 1.0f / (1.0f + 0.3275911f * ax);
  f32x16 y = splat(1.061405429f);
  y = y * t - 1.453152027f;
  y = y * t + 1.421413741f;
  y = y * t - 0.284496736f;
  y = y * t + 0.254829592f;
  y = 1.0f - y * t * vexp(-ax * ax);
  return x < 0.0f ? -y : y;
}
static inline f32x16 vtanh(f32x16 x) {
  f32x16 ax = vmin(vmax(x, -x), splat(20.0f));
  f32x16 y = 1.0f - 2.0f / (vexp(2.0f * ax) + 1.0f);
  return x < 0.0f ? -y : y;
}
static inline f32x16 activate(Activation act, f32x16 gate, f32x16 up) {
  switch (act) {
    case Activation::kSilu: return gate * vsigmoid(gate) * up;
    case Activation::kGelu: return 0.5f * gate * (1.0f + verf(gate * 0.70710678118654752f)) * up;
    case Activation::kGeluTanh: {
      f32x16 inner = 0.79788456080286536f * (gate + 0.044715f * gate * gate * gate);
      return 0.5f * gate * (1.0f + vtanh(inner)) * up;
    }
    default: {  // swigluoai, as gpt-oss: clamp, gate * sigmoid(alpha * gate) * (up + 1)
      gate = vmin(gate, splat(kSwigluOaiLimit));
      up = vmax(vmin(up, splat(kSwigluOaiLimit)), splat(-kSwigluOaiLimit));
      return gate * vsigmoid(kSwigluOaiAlpha * gate) * (up + 1.0f);
    }
  }
}

// ---- tile epilogues: accumulators are acc[r][c], c = 16-column group of the 64-column block ----
// w13: groups 0,1 are gate columns 0..31, groups 2,3 the matching up columns.
template <DType D>
static inline void w13_epilogue(const GemmTile& t, int r, f32x16 g0, f32x16 g1, f32x16 u0, f32x16 u1) {
  if (t.bias) {
    g0 += load_f32(t.bias);
    g1 += load_f32(t.bias + 16);
    u0 += load_f32(t.bias + 32);
    u1 += load_f32(t.bias + 48);
  }
  char* out = static_cast<char*>(t.out) + r * t.out_stride * int64_t(dtype_size(D));
#if defined(__AVX512F__)
  if (t.stream_out) {  // whole lines: past the caches
    alignas(64) char line[128];
    store<D>(line, activate(t.act, g0, u0));
    store<D>(line + 16 * dtype_size(D), activate(t.act, g1, u1));
    for (int i = 0; i < 32 * dtype_size(D); i += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), _mm512_load_si512(line + i));
    return;
  }
#endif
  store<D>(out, activate(t.act, g0, u0));
  store<D>(out + 16 * dtype_size(D), activate(t.act, g1, u1));
}
static inline void w2_epilogue(const GemmTile& t, int r, const f32x16 (&acc)[4]) {
  float* out = static_cast<float*>(t.out) + r * t.out_stride;
  float scale = t.row_scale ? t.row_scale[r] : 1.0f;
#if defined(__AVX512F__)
  if (t.stream_out && t.out_cols == 64) {  // whole lines (out is 64-byte aligned then): past the caches
    for (int c = 0; c < 4; ++c) {
      f32x16 v = acc[c];
      if (t.bias) v += load_f32(t.bias + 16 * c);
      _mm512_stream_ps(out + 16 * c, (__m512)(v * scale));
    }
    return;
  }
#endif
  for (int c = 0; c < 4; ++c) {
    f32x16 v = acc[c];
    if (t.bias) v += load_f32(t.bias + 16 * c);
    store_f32_partial(out + 16 * c, v * scale, t.out_cols - 16 * c);
  }
}

}  // namespace simd
}  // namespace cpumoe
