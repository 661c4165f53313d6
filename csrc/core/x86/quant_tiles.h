// Shared by the quantized x86 units: reading the A8 activation row (quant.h) and turning a register-tile
// dot product into w13/w2 tiles. A unit defines `template <int R> struct Dot { static void run(const
// GemmTile&, simd::f32x16 (&y)[R][4]); }` (y = the 64 column dots of R rows, fully rescaled) in its own
// anonymous namespace, so every instantiation below stays internal to the unit and its ISA flags.
#pragma once
// GCC 12's AVX-512 headers pass their own _mm512_undefined_*() to the masked builtins and then warn about it
// at every inlined use (GCC bug 105593, fixed in 13): silence that false positive for the quantized units.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "../quant.h"
#include "../simd.h"

namespace cpumoe {
namespace qx86 {
// Unnamed, so that each unit gets its own copy: every unit's Dot types mangle alike (GCC names each unit's
// unnamed namespace _GLOBAL__N_1), and a shared Tiles<Int4Dot, ...> would let the linker keep one unit's
// dispatch table for all of them, running one ISA's tiles under another's name.
namespace {

// A8 row: int8 (or u8) a[Kp], f32 scale at byte Kp, int32 sums[Kp/32] at byte Kp + 4.
static inline float a8_scale(const void* row, int64_t Kp) {
  float s;
  std::memcpy(&s, static_cast<const uint8_t*>(row) + Kp, 4);
  return s;
}
static inline const int32_t* a8_sums(const void* row, int64_t Kp) {
  return reinterpret_cast<const int32_t*>(static_cast<const uint8_t*>(row) + Kp + 4);
}
// Sum of the row's activations over k in [k0, k1) (multiples of 32), from the per-32 sums.
static inline int32_t a8_sum(const int32_t* sums, int64_t k0, int64_t k1) {
  int32_t s = 0;
  for (int64_t c = k0 / 32; c < k1 / 32; ++c) s += sums[c];
  return s;
}

// The AVX-512 decode tiles (1-2 rows: fp8's, the VNNI unit's) prefetch the codes they stream kStreamAheadBytes
// ahead into L1. They prefetched 4 KB ahead into L2 before: in `bench layer`'s runs on an AMX Xeon (variants in
// turn, bf16 timed beside), the qwen3-30b-a3b layer at M = 1 took fp8 1.54-1.62 ms against 1.63-1.72 and int4
// 0.78-0.87 against 0.85-0.98, int8 at M = 8 8.3-9.1 against 8.9-9.2. 2-3 KB into L1 were alike; 4 KB or more,
// into L1 or L2, were slower, and so was 0.5 KB into L2 for fp8.
constexpr int64_t kStreamAheadBytes = 2048;
static inline void prefetch_stream(const void* line) { _mm_prefetch(static_cast<const char*>(line), _MM_HINT_T0); }

// How far ahead a prefill's widening of a block prefetches its codes into L1. At M = 2048 in qwen3-30b-a3b's layer
// on AMX (the calls alternated in one process), 8 KB took fp8 0.92x the time of no prefetch; 4 KB the same as 8,
// 16 KB 1.08x the time of 8 KB.
constexpr int64_t kWidenAheadBytes = 8192;

// This thread's grow-only scratch of at least `bytes`, 64-byte aligned (a block widened once per call).
static inline uint8_t* scratch(int64_t bytes) {
  struct alignas(64) Line { uint8_t bytes[64]; };
  thread_local std::vector<Line> lines;
  if (lines.size() < size_t((bytes + 63) / 64)) lines.resize((bytes + 63) / 64);
  return lines.data()->bytes;
}

// A tile's R activation rows, read as k-quads (int32 words of four int8 codes), with their per-32 sums.
template <int R>
struct A8Rows {
  const int32_t* a[R];
  const int32_t* sums[R];
  explicit A8Rows(const GemmTile& t) {
    for (int r = 0; r < R; ++r) {
      a[r] = static_cast<const int32_t*>(t.a_rows[r]);
      sums[r] = a8_sums(t.a_rows[r], t.k);
    }
  }
};

template <template <int> class Dot, DType Out, int R>
static void w13_rows(const GemmTile& t) {
  simd::f32x16 y[R][4];
  Dot<R>::run(t, y);
  for (int r = 0; r < R; ++r) simd::w13_epilogue<Out>(t, r, y[r][0], y[r][1], y[r][2], y[r][3]);
}
template <template <int> class Dot, int R>
static void w2_rows(const GemmTile& t) {
  simd::f32x16 y[R][4];
  Dot<R>::run(t, y);
  for (int r = 0; r < R; ++r) simd::w2_epilogue(t, r, y[r]);
}

// fns[n] = the n-row tile, n = 1..MaxRows, for run_row_tiles.
template <template <int> class Dot, DType Out, int MaxRows>
struct Tiles {
  template <size_t... I>
  static constexpr std::array<TileFn, MaxRows + 1> w13_fns(std::index_sequence<I...>) {
    return {nullptr, &w13_rows<Dot, Out, int(I) + 1>...};
  }
  template <size_t... I>
  static constexpr std::array<TileFn, MaxRows + 1> w2_fns(std::index_sequence<I...>) {
    return {nullptr, &w2_rows<Dot, int(I) + 1>...};
  }
  static void w13(const GemmTile& t) { w13_by(t, MaxRows); }
  static void w2(const GemmTile& t) { w2_by(t, MaxRows); }
  // Tiles of at most `rows` rows (<= MaxRows).
  static void w13_by(const GemmTile& t, int rows) {
    static constexpr auto fns = w13_fns(std::make_index_sequence<MaxRows>());
    run_row_tiles(t, fns.data(), rows, dtype_size(Out));
  }
  static void w2_by(const GemmTile& t, int rows) {
    static constexpr auto fns = w2_fns(std::make_index_sequence<MaxRows>());
    run_row_tiles(t, fns.data(), rows, 4);
  }
  // The fewest tiles that cover t's rows, their sizes as even as can be (8 rows: 4 + 4, not MaxRows = 6 + 2).
  static int even_rows(const GemmTile& t) {
    const int tiles = (t.rows + MaxRows - 1) / MaxRows;
    return (t.rows + tiles - 1) / tiles;
  }
};

}  // namespace
}  // namespace qx86
}  // namespace cpumoe
