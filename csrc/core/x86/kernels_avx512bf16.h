// The dense VDPBF16PS tiles (kernels_avx512bf16.cpp) over a bf16 kPairs block, for units that dequantize a
// block into that layout and reuse them (quant_avx512bf16.cpp's prefill). Any number of rows.
#pragma once
#include "../kernels.h"

namespace cpumoe {

void avx512bf16_w13_tile(const GemmTile& t);  // bf16 out, 32 columns
void avx512bf16_w2_tile(const GemmTile& t);   // float32 out

}  // namespace cpumoe
