// x86-amx's tiles that other units call (kernels_amx.cpp): quant_amx.cpp runs fp8 prefill on them, over a block that
// the AVX-512 BF16 unit has widened (avx512bf16_widen_fp8).
#pragma once
#include "../kernels.h"

namespace cpumoe {

// Over a widened fp8 block ([Kp/2][64][2] bf16, then float32 scales [ceil(Kp / g)][64]; t.group = g, a multiple of
// 32): the chunked sums of the AVX-512 BF16 unit's fp8 tiles on AMX tiles. Any number of rows; bf16 out for w13.
void amx_fp8_widened_w13_tile(const GemmTile& t);
void amx_fp8_widened_w2_tile(const GemmTile& t);

}  // namespace cpumoe
