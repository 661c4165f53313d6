// The dense VDPBF16PS tiles (kernels_avx512bf16.cpp) over a bf16 kPairs block, for units that dequantize a
// block into that layout and reuse them (quant_avx512bf16.cpp's prefill). Any number of rows.
#pragma once
#include "../kernels.h"

namespace cpumoe {

void avx512bf16_w13_tile(const GemmTile& t);  // bf16 out, 32 columns
void avx512bf16_w2_tile(const GemmTile& t);   // float32 out

// Decode attention (attention_avx512bf16.cpp): VDPBF16PS over bf16 caches with head sizes a multiple of 32; other
// dtypes and sizes run the x86-avx512 FMA kernel.
void avx512bf16_decode_attention(const DecodeAttentionArgs& a, int64_t seq, int64_t kv_head);
extern const char* const kAvx512Bf16AttentionScope;  // what it hands to the FMA kernel, in words
// A head's float32 accumulator row times inv, stored as bf16 in column order: order[i] (i < 16) is the lane of a
// 32-column group's two halves (0-15 the first, 16-31 the second) that holds column i, order[16 + i] column 16 + i.
// dv a multiple of 32.
void avx512bf16_store_attention_row(const float* acc, int64_t dv, float inv, const int32_t (&order)[32],
                                    uint16_t* out);

// An fp8_w8a16 block widened (quant_avx512bf16.cpp): [Kp/2][64][2] bf16 (the codes times 2^-8, unscaled), then its
// float32 scales [ceil(Kp / g)][64] (the 2^8 folded in), in this thread's scratch: the block with its scales written
// and no k-pairs yet, then k-pairs [begin, end) into it.
uint8_t* avx512bf16_fp8_widened_block(const GemmTile& t);
void avx512bf16_widen_fp8_pairs(const GemmTile& t, int64_t begin, int64_t end, uint8_t* dst);

}  // namespace cpumoe
