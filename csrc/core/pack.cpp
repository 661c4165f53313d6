#include "pack.h"

#include <cstring>

namespace cpumoe {
namespace {

// Element offset of (column n, k) inside one block.
inline int64_t block_offset(Layout layout, int64_t n, int64_t k) {
  switch (layout) {
    case Layout::kKN: return k * kBlockCols + n;
    case Layout::kPairs: return (k / 2) * (kBlockCols * 2) + n * 2 + (k % 2);
    default: return (k / 4) * (kBlockCols * 4) + n * 4 + (k % 4);
  }
}

// Writes one block whose column n comes from source row rows[n] (or zeros when rows[n] < 0).
void pack_block(const char* src, int64_t src_k, const int64_t* rows, char* dst, int64_t k_padded,
                Layout layout, int64_t es) {
  std::memset(dst, 0, kBlockCols * k_padded * es);
  for (int64_t n = 0; n < kBlockCols; ++n) {
    if (rows[n] < 0) continue;
    const char* row = src + rows[n] * src_k * es;
    for (int64_t k = 0; k < src_k; ++k) std::memcpy(dst + block_offset(layout, n, k) * es, row + k * es, es);
  }
}

}  // namespace

PackedShape w13_packed_shape(int64_t H, int64_t I, Layout layout) {
  int64_t k = round_up(H, layout_k_align(layout));
  return {round_up(I, kW13BlockInter) / kW13BlockInter, kBlockCols * k, k};
}

PackedShape w2_packed_shape(int64_t H, int64_t I, Layout layout) {
  int64_t k = round_up(I, kW13BlockInter);  // already a multiple of every layout's k alignment
  return {round_up(H, kBlockCols) / kBlockCols, kBlockCols * k, k};
}

void pack_w13(const void* w13, void* dst, int64_t H, int64_t I, DType dtype, Layout layout,
              int64_t e_begin, int64_t e_end) {
  const int64_t es = dtype_size(dtype);
  const PackedShape s = w13_packed_shape(H, I, layout);
  for (int64_t e = e_begin; e < e_end; ++e) {
    const char* src = static_cast<const char*>(w13) + e * 2 * I * H * es;
    for (int64_t b = 0; b < s.blocks; ++b) {
      int64_t rows[kBlockCols];
      for (int64_t j = 0; j < kW13BlockInter; ++j) {
        int64_t i = b * kW13BlockInter + j;
        rows[j] = i < I ? i : -1;                             // gate row
        rows[kW13BlockInter + j] = i < I ? I + i : -1;        // matching up row
      }
      char* out = static_cast<char*>(dst) + (e * s.blocks + b) * s.block_elems * es;
      pack_block(src, H, rows, out, s.k, layout, es);
    }
  }
}

void pack_w2(const void* w2, void* dst, int64_t H, int64_t I, DType dtype, Layout layout,
             int64_t e_begin, int64_t e_end) {
  const int64_t es = dtype_size(dtype);
  const PackedShape s = w2_packed_shape(H, I, layout);
  for (int64_t e = e_begin; e < e_end; ++e) {
    const char* src = static_cast<const char*>(w2) + e * H * I * es;
    for (int64_t b = 0; b < s.blocks; ++b) {
      int64_t rows[kBlockCols];
      for (int64_t j = 0; j < kBlockCols; ++j) rows[j] = b * kBlockCols + j < H ? b * kBlockCols + j : -1;
      char* out = static_cast<char*>(dst) + (e * s.blocks + b) * s.block_elems * es;
      pack_block(src, I, rows, out, s.k, layout, es);
    }
  }
}

}  // namespace cpumoe
