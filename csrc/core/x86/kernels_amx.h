// x86-amx's tiles that other units call (kernels_amx.cpp): quant_amx.cpp runs fp8 prefill on them, over a block that
// the AVX-512 BF16 unit widens as the tiles go, and mxfp4 prefill, over a block it widens itself the same way.
#pragma once
#include "../kernels.h"
#include "../prefill_attention.h"

namespace cpumoe {

// A block that a call's first row tile widens as it goes, ahead of its tile products: widen(context, begin, end)
// writes k-pairs [begin, end) of t.b (this thread's scratch), begin and end multiples of 16 k-pairs (an AMX k-step)
// or the block's end. Widened in a pass of its own before the tiles, the block's read from memory left the AMX unit
// idle.
struct BlockWidening {
  void (*widen)(const void* context, int64_t begin, int64_t end);
  const void* context;
};

// Over an fp8_w8a16 block (t.group = g, a multiple of 32), widened by the AVX-512 BF16 unit into this thread's
// scratch as the tiles go (avx512bf16_fp8_widened_block, avx512bf16_widen_fp8_pairs): the chunked sums of that unit's
// fp8 tiles on AMX tiles. Any number of rows; bf16 out for w13.
void amx_fp8_w13_tile(const GemmTile& t);
void amx_fp8_w2_tile(const GemmTile& t);

// Over a bf16 block in the kPairs order ([Kp/2][64][2] bf16, no metadata; widened as the tiles go when `widening` is
// given) and bf16 activation rows: plain tile sums, row r's times row_scales[r] before the epilogue (A8 codes summed
// as bf16 times their row's scale). Any number of rows; w13 writes t.dtype (float32 for A8 formats, bf16).
void amx_scaled_w13_tile(const GemmTile& t, const float* row_scales, const BlockWidening* widening = nullptr);
void amx_scaled_w2_tile(const GemmTile& t, const float* row_scales, const BlockWidening* widening = nullptr);

// Decode attention (attention_amx.cpp): both products on AMX tiles over bf16 caches with head sizes a multiple of 32
// and block sizes a multiple of 16; the other calls run x86-avx512bf16's kernel.
void amx_decode_attention(const DecodeAttentionArgs& a, int64_t seq, int64_t kv_head);
extern const char* const kAmxAttentionScope;  // what it hands to x86-avx512bf16's kernel, in words

// Prefill attention (prefill_attention_amx.cpp): bf16, head sizes a multiple of 32 (prefill_attention.cpp checks).
void amx_prefill_attention(const PrefillAttentionArgs& a, const Parallel& parallel);

}  // namespace cpumoe
