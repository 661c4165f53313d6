#include "linear.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "pack.h"

namespace cpumoe {

void linear(const LinearArgs& a, const Parallel& parallel) {
  const int64_t es = dtype_size(a.dtype);
  int64_t blocks, block_bytes, Kp;
  if (a.quant) {
    Kp = round_up(a.K, kQuantKAlign);
    blocks = round_up(a.N, kBlockCols) / kBlockCols;
    block_bytes = quant_block_bytes(a.format, Kp, a.group, a.symmetric);
  } else {
    const PackedShape s = w2_packed_shape(a.N, a.K, a.kernels->layout);  // blocks of 64 outputs, k = K rounded to 32
    Kp = s.k, blocks = s.blocks, block_bytes = s.block_elems * es;
  }
  const bool int8_rows = a.quant && quant_int8_activations(a.format);
  const TileFn tile = a.quant ? a.quant->w2_tile : a.kernels->w2_tile;

  // Rows the tiles read: A8 quantized rows, or rows padded with zeros to Kp when K is not already it.
  std::vector<char> staged;
  const char* x = static_cast<const char*>(a.x);
  int64_t x_stride = a.K * es;
  if (int8_rows) {
    x_stride = quant_row_stride(*a.quant, Kp);
    staged.resize(a.M * x_stride);
    parallel_items(parallel, a.M, [&](int64_t m) {
      quantize_row(*a.quant, x + m * a.K * es, a.K, a.dtype, Kp,
                   reinterpret_cast<uint8_t*>(staged.data() + m * x_stride));
    });
    x = staged.data();
  } else if (Kp != a.K) {
    staged.assign(a.M * Kp * es, 0);
    for (int64_t m = 0; m < a.M; ++m) std::memcpy(staged.data() + m * Kp * es, x + m * a.K * es, a.K * es);
    x = staged.data();
    x_stride = Kp * es;
  }
  std::vector<const void*> rows(a.M);
  for (int64_t m = 0; m < a.M; ++m) rows[m] = x + m * x_stride;

  // Items: (row chunk, block of 64 outputs), consecutive blocks consecutive in memory. An item's float32 sums go to
  // this thread's [rows][64] slab and are rounded to dtype into its columns of `out` (each output on its own, as
  // rounding once at the end did). A whole [M][Np] float32 buffer, as before, cost page faults on every call above
  // glibc's 32 MB mmap threshold (a 2048-row projection to 5120 outputs: 16% of its time in the kernel), and its
  // rows 4 * Np bytes apart fell on few cache sets.
  constexpr int64_t kRowChunk = 256;
  const int64_t chunks = (a.M + kRowChunk - 1) / kRowChunk;
  parallel_items(parallel, chunks * blocks, [&](int64_t i) {
    const int64_t chunk = i / blocks, block = i % blocks, r0 = chunk * kRowChunk;
    thread_local std::vector<float> slab;
    slab.resize(kRowChunk * kBlockCols);
    GemmTile t{};
    t.a_rows = rows.data() + r0;
    t.rows = int(std::min(kRowChunk, a.M - r0));
    t.k = Kp;
    t.b = static_cast<const char*>(a.w) + block * block_bytes;
    t.bias = nullptr;
    t.out = slab.data();
    t.out_stride = kBlockCols;
    t.out_cols = int(std::min<int64_t>(kBlockCols, a.N - block * kBlockCols));
    t.dtype = a.dtype;
    t.group = a.group;
    t.symmetric = a.symmetric;
    tile(t);
    const int64_t n0 = block * kBlockCols;
    for (int r = 0; r < t.rows; ++r) {
      float* sums = slab.data() + r * kBlockCols;
      if (a.bias)
        for (int c = 0; c < t.out_cols; ++c) sums[c] += a.bias[n0 + c];
      store_row(sums, static_cast<char*>(a.out) + ((r0 + r) * a.N + n0) * es, t.out_cols, a.dtype);
    }
  });
}

}  // namespace cpumoe
