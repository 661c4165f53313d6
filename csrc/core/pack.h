// Packing of expert weights into 64-column blocks (one layout per kernel family, see types.h).
//   w13 [E][2I][H]  ->  [E][Ip/32] blocks, block b = gate rows 32b..32b+31 then up rows 32b..32b+31,
//                       each block 64 columns x Kp (Kp = H rounded up to the layout's k alignment)
//   w2  [E][H][I]   ->  [E][Hp/64] blocks of 64 hidden rows x Ip
// Ip = I rounded up to 32, Hp = H rounded up to 64; padding is zero, so padded intermediate columns
// come out as act(0) * 0 = 0 and padded hidden columns are never stored.
#pragma once
#include <cstdint>

#include "types.h"

namespace cpumoe {

struct PackedShape {
  int64_t blocks;        // blocks per expert
  int64_t block_elems;   // elements per block (64 x k)
  int64_t k;             // padded reduction length inside a block
  int64_t expert_elems() const { return blocks * block_elems; }
};

PackedShape w13_packed_shape(int64_t H, int64_t I, Layout layout);
PackedShape w2_packed_shape(int64_t H, int64_t I, Layout layout);

// Packs experts [e_begin, e_end) of w13/w2 (row-major, dtype elements) into dst (the whole packed array).
void pack_w13(const void* w13, void* dst, int64_t H, int64_t I, DType dtype, Layout layout,
              int64_t e_begin, int64_t e_end);
void pack_w2(const void* w2, void* dst, int64_t H, int64_t I, DType dtype, Layout layout,
             int64_t e_begin, int64_t e_end);

}  // namespace cpumoe
