// The interface every ISA unit implements: two register-blocked GEMM tiles over one packed 64-column
// weight block. The fused MoE driver (fused_moe.cpp) owns routing order, scheduling and the combine; a
// kernel unit only knows "rows of activations x one weight block".
#pragma once
#include "types.h"

namespace cpumoe {

struct GemmTile {
  const void* const* a_rows;  // [rows] pointers to activation rows of `k` elements (dtype), k-padded
  int rows;                   // 1..KernelTable::max_rows
  int64_t k;                  // reduction length, a multiple of the layout's k alignment
  const void* b;              // one packed block: 64 columns x k (Layout), dtype
  const float* bias;          // [64] in the block's column order, or nullptr
  const float* row_scale;     // [rows] multipliers of the w2 output (router weights), or nullptr
  void* out;                  // w13: intermediate rows (dtype, 32 columns); w2: float32 rows (64 columns)
  int64_t out_stride;         // elements between output rows
  int out_cols;               // w2: columns to write (< 64 at the right edge of H); w13: unused (32)
  DType dtype;                // activation and weight dtype (quantized formats: see quant.h)
  Activation act;             // w13 only
  int64_t group;              // quantized formats: the format's group size g (quant.h); else unused
  bool symmetric;             // int4_w4a16: blocks without zero points (quant.h); else unused
  bool stream_out;            // may write its rows past the caches (non-temporal stores, the caller fences); out
                              // and its rows are then 64-byte aligned
  const void* next_b;         // the block this thread's next call reads (next_bytes long), or nullptr: a kernel
  int64_t next_bytes;         // whose later row tiles reuse a cached block may fetch it into L2 meanwhile
};

// Decode attention over a paged KV cache (attention.h drives it): one query token per sequence, the g = nh /
// nkv query heads of each KV head together, so every K/V row is read once.
struct DecodeAttentionArgs {
  const void* q = nullptr;              // [S][nh][d], dtype
  const void* k_cache = nullptr;        // [blocks][block_size][nkv][d], dtype
  const void* v_cache = nullptr;        // [blocks][block_size][nkv][dv], dtype
  // Elements from one cache slot (block * block_size + offset) to the next; 0: nkv * d and nkv * dv (whole
  // caches). More for a view of the leading channels of wider rows (MLA's values are the first c of its keys).
  int64_t k_slot_stride = 0, v_slot_stride = 0;
  const int64_t* block_table = nullptr; // [S][n] cache blocks of each sequence, in order
  const int64_t* key_begin = nullptr;   // [S] first key, as a position over the sequence's table (block j, offset o:
  const int64_t* key_end = nullptr;     // [S] j * block_size + o); keys [key_begin, key_end) are attended
  const float* sinks = nullptr;         // [nh] a logit in each head's softmax denominator, or nullptr
  void* out = nullptr;                  // [S][nh][dv], dtype
  int64_t S = 0, nh = 0, nkv = 0, d = 0, dv = 0, n = 0, block_size = 0;
  float scale = 1.0f;                   // on q . k
  DType dtype = DType::kBFloat16;
};
using AttentionFn = void (*)(const DecodeAttentionArgs&, int64_t seq, int64_t kv_head);

// One sequence's keys and values of one KV head in the paged caches, as rows of T (the caches' element type).
template <typename T>
struct PagedHeadRows {
  const T* k;
  const T* v;
  const int64_t* table;
  int64_t k_slot, v_slot, block_size;  // elements from a slot's row to the next slot's
  PagedHeadRows(const DecodeAttentionArgs& a, int64_t seq, int64_t kv_head)
      : k(static_cast<const T*>(a.k_cache) + kv_head * a.d),
        v(static_cast<const T*>(a.v_cache) + kv_head * a.dv),
        table(a.block_table + seq * a.n),
        k_slot(a.k_slot_stride ? a.k_slot_stride : a.nkv * a.d),
        v_slot(a.v_slot_stride ? a.v_slot_stride : a.nkv * a.dv),
        block_size(a.block_size) {}
  int64_t slot(int64_t j) const { return table[j / block_size] * block_size + j % block_size; }  // key position j
  const T* key(int64_t j) const { return k + slot(j) * k_slot; }
  const T* value(int64_t j) const { return v + slot(j) * v_slot; }
};

struct KernelTable {
  const char* name;       // e.g. "x86-avx512bf16"
  Layout layout;
  int max_rows;           // rows per tile call
  unsigned dtype_mask;    // bit (1 << int(DType)) set when the kernel takes that dtype
  // w13 tile: out[r][0:32] = act(gate) * up for the block's 32 intermediate columns, rounded to dtype.
  void (*w13_tile)(const GemmTile&);
  // w2 tile: out[r][0:out_cols] = (a_r . b + bias) * row_scale[r], float32.
  void (*w2_tile)(const GemmTile&);
  // out rows of sequence `seq`, heads kv_head * g .. + g - 1; nullptr when the unit has no attention kernel.
  AttentionFn attention = nullptr;
  // The calls the attention kernel hands to another unit's, in words (nullptr: none, it takes them all).
  const char* attention_scope = nullptr;
  // The fused driver copies w13's input rows into expert order before the tiles run, so that the rows of a tile
  // are evenly spaced (x86-amx then loads them in place; scattered, each call would copy its own).
  bool sorted_rows = false;
  bool supports(DType d) const { return (dtype_mask >> int(d)) & 1u; }
};

using TileFn = void (*)(const GemmTile&);

// Splits a tile of t.rows rows into register tiles of at most max_rows, calling fns[n] for n rows.
inline void run_row_tiles(const GemmTile& t, const TileFn* fns, int max_rows, int64_t out_elem_bytes) {
  GemmTile sub = t;
  for (int done = 0; done < t.rows;) {
    int n = t.rows - done < max_rows ? t.rows - done : max_rows;
    sub.rows = n;
    sub.a_rows = t.a_rows + done;
    sub.out = static_cast<char*>(t.out) + done * t.out_stride * out_elem_bytes;
    sub.row_scale = t.row_scale ? t.row_scale + done : nullptr;
    fns[n](sub);
    done += n;
  }
}

// Each unit defines its table; a unit not built for this architecture is absent at link time and
// kernel_registry.cpp leaves it out.
const KernelTable& kernels_generic();
#if defined(__x86_64__)
const KernelTable& kernels_x86_avx2();
const KernelTable& kernels_x86_avx512();
const KernelTable& kernels_x86_avx512bf16();
const KernelTable& kernels_x86_amx();
#endif
#if defined(__aarch64__)
const KernelTable& kernels_arm_neon();
const KernelTable& kernels_arm_bfmmla();
#endif

// Streaming read of `bytes` (a multiple of 256) with the widest loads the unit has; returns a checksum
// so the loads cannot be optimised away.
uint64_t stream_read_generic(const void* p, int64_t bytes);
#if defined(__x86_64__)
uint64_t stream_read_avx512(const void* p, int64_t bytes);
uint64_t stream_read_avx2(const void* p, int64_t bytes);
#endif

}  // namespace cpumoe
