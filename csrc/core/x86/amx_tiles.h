// The tile configuration the AMX units share (kernels_amx.cpp, quant_amx.cpp): eight tiles of 16 rows x 64 bytes.
// Tiles 0-3 accumulate (16 x 16 float32 or int32), 4 holds A (16 rows x 64 bytes of k), 6-7 hold B (16 k-steps x
// 16 columns x 64 bytes). Built with -mamx-tile. The inline functions here are shared by units of different ISA
// flags; the linker keeps one copy, which is safe because x86-amx runs only where every one of those flags holds.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cpumoe {
namespace amx {

constexpr int kTileRows = 16;  // rows of an A tile and of an accumulator tile

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loaded at the start of every call that uses tiles: the configuration belongs to the thread, and other code on
// the same thread (oneDNN's GEMMs under torch) sets its own. _tile_release() at the call's end. k_bytes: the bytes
// of k an A row holds (64; 32 for mxfp4's 32-k groups, B tiles then of 8 rows).
inline void configure_tiles(int k_bytes = 64) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = kTileRows;
  }
  cfg.colsb[4] = uint16_t(k_bytes);
  cfg.rows[6] = cfg.rows[7] = uint8_t(k_bytes / 4);
  // Not _tile_loadconfig: GCC 12's declares only the first 8 bytes of the configuration as read, and the stores to
  // the rest may be dropped as dead (a tile instruction then faults as not configured).
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// n 32-bit words of `words` (resized to hold them) from its first 64-byte boundary: a tile's rows load aligned.
inline uint32_t* aligned_words(std::vector<uint32_t>& words, int64_t n) {
  words.resize(n + 16);
  return words.data() + (-(reinterpret_cast<uintptr_t>(words.data()) / 4) & 15);
}

// n (<= 16) activation rows of row_bytes each as one strided array of 16 rows for an A tile: in place when n == 16
// and the rows are evenly spaced at least a row apart, else copied into this thread's buffer with the rows past n
// zero (a tile of fewer rows than it holds; their sums go unused). *stride: the bytes from row to row.
inline const char* tile_rows(const void* const* rows, int n, int64_t row_bytes, int64_t* stride) {
  const char* base = static_cast<const char*>(rows[0]);
  const int64_t step = n > 1 ? static_cast<const char*>(rows[1]) - base : 0;
  bool even = n == kTileRows && step >= row_bytes;
  for (int i = 2; i < n && even; ++i) even = static_cast<const char*>(rows[i]) == base + i * step;
  if (even) {
    *stride = step;
    return base;
  }
  thread_local std::vector<char> copy;
  copy.resize(size_t(kTileRows) * row_bytes);
  for (int i = 0; i < n; ++i) std::memcpy(copy.data() + i * row_bytes, rows[i], row_bytes);
  std::memset(copy.data() + size_t(n) * row_bytes, 0, size_t(kTileRows - n) * row_bytes);
  *stride = row_bytes;
  return copy.data();
}

// A call's first row tile reads its block from memory (the later ones find it in L2); tile loads alone streamed at
// 23 GB/s of the probe's ~30 here. Prefetching the block kStreamAhead bytes ahead into L1, `bytes` (a k-step's
// worth) a step, took that to ~25 and the qwen3-30b-a3b bf16 layer at M = 128 / 512 / 2048 from 50.7 / 69.5 /
// 158.1 ms to 49.0 / 67.3 / 146.9 (4 or 16 KB ahead: the same; into L2 instead of L1: no gain).
constexpr int64_t kStreamAhead = 8192;
inline void prefetch_ahead(const void* at, int64_t bytes) {
  const char* p = static_cast<const char*>(at) + kStreamAhead;
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
}

// The next call's block (GemmTile::next_b), fetched into L2 from its start while this call's row tiles after the
// first reuse their cached block. A call's first row tile streams its block at memory speed with the AMX unit
// mostly idle and the later ones compute with the memory idle; this overlaps the two. At most kFetchLines a k-step:
// the fetches hold the core's line fill buffers, and more of them starved the tiles' own loads. qwen3-30b-a3b's bf16
// layer, alternated in one process: M = 2048 129.5-136.2 -> 121.8-125.0 ms; M = 512 and 128 the same. 6 lines a step: a
// smaller gain; the whole block, as fast as it would go: M = 512 1.2x slower. Slices of the block per row tile, or
// a few lines a 4 KB page to wake the L2 streamer: no better.
struct NextBlockFetch {
  static constexpr int64_t kFetchLines = 4;
  const char* at = nullptr;
  int64_t step_bytes = 0, bytes = 0;  // bytes a k-step (whole lines) and from `at` to the block's end

  // For the row tile at `first` of a call of t.rows rows and `steps` k-steps a tile.
  template <class Tile>
  static NextBlockFetch for_tile(const Tile& t, int first, int64_t steps) {
    const int64_t later = (t.rows + kTileRows - 1) / kTileRows - 1;
    if (!t.next_b || first == 0 || steps == 0) return {};
    const int64_t lines = std::min(kFetchLines, (t.next_bytes / 64 + later * steps - 1) / (later * steps));
    const int64_t begin = (first / kTileRows - 1) * steps * lines * 64;
    if (begin >= t.next_bytes) return {};
    return {static_cast<const char*>(t.next_b) + begin, lines * 64, t.next_bytes - begin};
  }
  // The same fetch for a loop that starts at k-step k.
  NextBlockFetch from_step(int64_t k) const {
    if (k * step_bytes >= bytes) return {};
    return {at + k * step_bytes, step_bytes, bytes - k * step_bytes};
  }
  void step(int64_t k_step) const {
    if (k_step * step_bytes >= bytes) return;  // also when there is no block
    const char* p = at + k_step * step_bytes;
    for (int64_t l = 0; l < step_bytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T1);
  }
};

inline void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Accumulators 0-3 into c[16][64] (float32 or int32), their 16 columns side by side.
inline void store_accumulators(void* c) {
  char* p = static_cast<char*>(c);
  _tile_stored(0, p, 256);
  _tile_stored(1, p + 64, 256);
  _tile_stored(2, p + 128, 256);
  _tile_stored(3, p + 192, 256);
}

// A call's rows in tiles of 16, the AMX unit one tile ahead of the vector units: products(first, n, after_step)
// issues the tile products of rows [first, first + n) into accumulators 0-3, calling after_step(step, steps) after
// each of its k-steps; finish(first, r0, r1, sums) completes rows first + [r0, r1) of the tile at `first` from its
// stored sums (Sum: int32_t or float, [16][64]). Tile i's rows are finished a few at a time between tile i + 1's
// k-steps, so the two units work at once: issued after all of a tile's products, the vector work waited behind
// them in the reorder buffer (a tile product holds its entry for ~20 cycles) and ran after them. A tile's sums are
// read well after their tile stores (read at once, they waited for them).
template <typename Sum, class Products, class Finish>
inline void pipelined_row_tiles(int rows, Products products, Finish finish) {
  alignas(64) Sum sums[2][kTileRows * 64];
  const int tiles = (rows + kTileRows - 1) / kTileRows;
  const auto rows_of = [&](int i) { return rows - kTileRows * i < kTileRows ? rows - kTileRows * i : kTileRows; };
  products(0, rows_of(0), [](int64_t, int64_t) {});
  store_accumulators(sums[0]);
  for (int i = 0; i < tiles; ++i) {
    const int n = rows_of(i);
    Sum* done_sums = sums[i & 1];
    int done = 0;
    if (i + 1 < tiles)
      products(kTileRows * (i + 1), rows_of(i + 1), [&](int64_t step, int64_t steps) {
        const int upto = int(n * (step + 1) / steps);
        if (upto > done) {
          finish(kTileRows * i, done, upto, done_sums);
          done = upto;
        }
      });
    if (done < n) finish(kTileRows * i, done, n, done_sums);
    if (i + 1 < tiles) store_accumulators(sums[(i + 1) & 1]);
  }
}

}  // namespace amx
}  // namespace cpumoe

// One k-step of a 16-row x 64-column tile product: A (16 rows of 64 bytes at a, a_stride apart) into tile 4 against
// a block's four B tiles (16 rows of 256 bytes at b, 64 bytes a tile) into accumulators 0-3. OP is the tile product
// (_tile_dpbf16ps, _tile_dpbusd, _tile_dpbsud); a macro because those intrinsics are macros of literal tile numbers.
#define CPUMOE_AMX_K_STEP(OP, a, a_stride, b) \
  do {                                        \
    _tile_loadd(4, (a), (a_stride));          \
    _tile_loadd(6, (b), 256);                 \
    _tile_loadd(7, (b) + 64, 256);            \
    OP(0, 4, 6);                              \
    OP(1, 4, 7);                              \
    _tile_loadd(6, (b) + 128, 256);           \
    _tile_loadd(7, (b) + 192, 256);           \
    OP(2, 4, 6);                              \
    OP(3, 4, 7);                              \
  } while (0)
