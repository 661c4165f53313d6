#include "linear.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "pack.h"

namespace cpumoe {

void linear(const LinearArgs& a, const Parallel& parallel) {
  const KernelTable& kt = *a.kernels;
  const int64_t es = dtype_size(a.dtype);
  const PackedShape s = w2_packed_shape(a.N, a.K, kt.layout);  // blocks of 64 outputs, k = K rounded to 32
  const int64_t Np = s.blocks * kBlockCols;

  // Rows the tiles may read up to s.k: pad a copy with zeros when K is not already a multiple of it.
  std::vector<char> padded;
  const char* x = static_cast<const char*>(a.x);
  int64_t x_stride = a.K * es;
  if (s.k != a.K) {
    padded.assign(a.M * s.k * es, 0);
    for (int64_t m = 0; m < a.M; ++m) std::memcpy(padded.data() + m * s.k * es, x + m * a.K * es, a.K * es);
    x = padded.data();
    x_stride = s.k * es;
  }
  std::vector<const void*> rows(a.M);
  for (int64_t m = 0; m < a.M; ++m) rows[m] = x + m * x_stride;
  std::vector<float> y(a.M * Np);  // float32 results, rounded to dtype once at the end

  // Items: (row chunk, block of 64 outputs), consecutive blocks consecutive in memory.
  constexpr int64_t kRowChunk = 256;
  const int64_t chunks = (a.M + kRowChunk - 1) / kRowChunk;
  parallel_items(parallel, chunks * s.blocks, [&](int64_t i) {
    const int64_t chunk = i / s.blocks, block = i % s.blocks, r0 = chunk * kRowChunk;
    GemmTile t{};
    t.a_rows = rows.data() + r0;
    t.rows = int(std::min(kRowChunk, a.M - r0));
    t.k = s.k;
    t.b = static_cast<const char*>(a.w) + block * s.block_elems * es;
    t.bias = nullptr;
    t.out = y.data() + r0 * Np + block * kBlockCols;
    t.out_stride = Np;
    t.out_cols = int(std::min<int64_t>(kBlockCols, a.N - block * kBlockCols));
    t.dtype = a.dtype;
    kt.w2_tile(t);
  });
  parallel_items(parallel, a.M, [&](int64_t m) {
    float* row = y.data() + m * Np;
    if (a.bias)
      for (int64_t n = 0; n < a.N; ++n) row[n] += a.bias[n];
    store_row(row, static_cast<char*>(a.out) + m * a.N * es, a.N, a.dtype);
  });
}

}  // namespace cpumoe
