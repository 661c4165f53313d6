// Core types shared by every kernel unit. This directory (csrc/core) is free of PyTorch so it can be
// cross-compiled for Arm and tested under qemu with a plain C++ driver.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace cpumoe {

// IEEE half. GCC before 13 has no C++ _Float16 on AArch64; its __fp16 is the same format.
#if defined(__aarch64__) && !defined(__clang__) && __GNUC__ < 13
using half_t = __fp16;
#else
using half_t = _Float16;
#endif

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum class Activation : int { kSilu = 0, kGelu = 1, kGeluTanh = 2, kSwigluOai = 3 };

// gpt-oss's clamped SwiGLU constants.
constexpr float kSwigluOaiAlpha = 1.702f;
constexpr float kSwigluOaiLimit = 7.0f;

// How a kernel wants one 64-column block of a weight matrix laid out (see pack.h).
enum class Layout : int {
  kKN = 0,     // [K][64]        one row of 64 output columns per k: fp32-FMA kernels
  kPairs = 1,  // [K/2][64][2]   k-pairs interleaved per column: x86 VDPBF16PS
  kQuads = 2,  // [K/4][64][4]   k-quads per column: Arm BFMMLA (two columns = one 2x4 operand)
};

constexpr int kBlockCols = 64;     // output columns per packed block, for w13 and w2
constexpr int kW13BlockInter = 32;  // a w13 block holds 32 gate rows then the 32 matching up rows

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int layout_k_align(Layout l) { return l == Layout::kKN ? 1 : (l == Layout::kPairs ? 2 : 4); }
inline int64_t dtype_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }
inline const char* dtype_name(DType d) {
  return d == DType::kFloat32 ? "float32" : (d == DType::kBFloat16 ? "bfloat16" : "float16");
}

// ---- scalar conversions (round-to-nearest-even, like torch's .to()) ----
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);  // a NaN stays a quiet NaN
}
inline float f16_to_f32(uint16_t h) {
  half_t v;
  std::memcpy(&v, &h, 2);
  return float(v);
}
inline uint16_t f32_to_f16(float f) {
  half_t v = half_t(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}
inline float load_as_f32(const void* p, int64_t i, DType d) {
  switch (d) {
    case DType::kFloat32: return static_cast<const float*>(p)[i];
    case DType::kBFloat16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}
inline void store_from_f32(void* p, int64_t i, float v, DType d) {
  switch (d) {
    case DType::kFloat32: static_cast<float*>(p)[i] = v; break;
    case DType::kBFloat16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    default: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
  }
}

// The same with the dtype known at compile time: loops over a row then vectorize, where the per-element switch
// above kept RMSNorm and RoPE scalar (2 ms and 8 ms of a 512-token prefill's layer).
template <DType D>
inline float load_f32(const void* p, int64_t i) {
  if constexpr (D == DType::kFloat32) return static_cast<const float*>(p)[i];
  else if constexpr (D == DType::kBFloat16) return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  else return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
}
template <DType D>
inline void store_f32(void* p, int64_t i, float v) {
  if constexpr (D == DType::kFloat32) static_cast<float*>(p)[i] = v;
  else if constexpr (D == DType::kBFloat16) static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  else static_cast<uint16_t*>(p)[i] = f32_to_f16(v);
}
// v rounded to D and back (float32: v itself).
template <DType D>
inline float round_to(float v) {
  if constexpr (D == DType::kFloat32) return v;
  else if constexpr (D == DType::kBFloat16) return bf16_to_f32(f32_to_bf16(v));
  else return f16_to_f32(f32_to_f16(v));
}
// A row loop built once per x86 vector width (AVX-512, AVX2, the base SSE2), the widest the CPU has picked when the
// library loads: the plain loops of the elementwise ops (RMSNorm, RoPE, the prefill softmax) vectorize, and SSE2 ran
// them at 4 lanes (RoPE: 5 ms of each layer of a 512-token prompt). Apply it to a non-template function: `flatten`
// inlines what it calls into each clone. Their units build with -ffp-contract=off, so every clone rounds as the base
// one does.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CPUMOE_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), flatten))
#else
#define CPUMOE_VECTOR_CLONES
#endif

// fn(tag) for the runtime dtype d, tag an std::integral_constant<DType, d>: `constexpr DType D = decltype(tag)::value`.
template <typename Fn>
inline void with_dtype(DType d, Fn&& fn) {
  switch (d) {
    case DType::kFloat32: fn(std::integral_constant<DType, DType::kFloat32>{}); break;
    case DType::kBFloat16: fn(std::integral_constant<DType, DType::kBFloat16>{}); break;
    default: fn(std::integral_constant<DType, DType::kFloat16>{}); break;
  }
}

// out[0:n] = acc[0:n] in dtype; branch-free so the compiler vectorizes the bf16 rounding.
inline void store_row(const float* __restrict acc, void* __restrict out, int64_t n, DType dtype) {
  if (dtype == DType::kFloat32) {
    std::memcpy(out, acc, n * 4);
  } else if (dtype == DType::kBFloat16) {
    uint16_t* o = static_cast<uint16_t*>(out);
    for (int64_t h = 0; h < n; ++h) {
      uint32_t u;
      std::memcpy(&u, acc + h, 4);
      const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      o[h] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);  // NaN stays NaN
    }
  } else {
    for (int64_t h = 0; h < n; ++h) store_from_f32(out, h, acc[h], dtype);
  }
}

}  // namespace cpumoe
