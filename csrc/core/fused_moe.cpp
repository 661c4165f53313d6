#include "fused_moe.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "pack.h"

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace cpumoe {
namespace {

// Most rows of one expert handled by one item. An item streams its weight block (at most 64 x 2048 bf16 =
// 256 KB, L2-resident) once from memory and reuses it for every register tile of rows, so larger chunks
// mean less weight traffic; an expert with more rows is split into equal chunks so threads stay balanced.
constexpr int64_t kMaxRowChunk = 256;

// From this size a pass's outputs that the next pass reads once go to memory with non-temporal stores
// (GemmTile::stream_out): caching them on the way out costs a read for ownership of every line and evicts the
// weight block and the activation rows. qwen3-30b-a3b's layer on AMX, the two ways alternated in one process:
// - w2's outputs (ys, a float32 row per token and slot, read by the combine): M = 2048 (134 MB) int8 0.89x the
//   time, bf16 0.94x; M = 512 0.97x; M = 128 (8 MB) 0.99x; M = 32 (2 MB, within the L2 caches) 1.0x.
// - w13's float32 rows of the A8 formats (read by their quantization): M = 2048 (50 MB) int8 0.96-0.99x, int4
//   0.96x; M = 512 1.0x. bf16's rows, which w2's tiles read again and again, gained nothing (1.0x) and stay cached.
constexpr int64_t kStreamBytes = int64_t(8) << 20;

// Orders this thread's non-temporal stores before what follows (the combine may run on another thread).
inline void store_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// Grow-only scratch memory, one per calling thread: a fresh allocation per call would page-fault its
// way through tens of MB on every prefill.
class Scratch {
 public:
  char* get(size_t bytes) {
    if (bytes > size_) {
      std::free(data_);
      size_ = std::max(bytes, size_ + size_ / 2);
      data_ = static_cast<char*>(std::aligned_alloc(64, round_up(size_, 64)));
      if (!data_) throw std::bad_alloc();
    }
    return data_;
  }
  ~Scratch() { std::free(data_); }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
};

struct Item {
  int32_t expert;
  int32_t row_begin;  // in the expert-sorted row order
  int32_t rows;
  int32_t block;
};

std::vector<Item> make_items(const std::vector<int64_t>& offsets, int64_t blocks, int tile_rows) {
  std::vector<Item> items;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    if (rows == 0) continue;
    const int64_t chunks = (rows + kMaxRowChunk - 1) / kMaxRowChunk;
    const int64_t chunk = round_up((rows + chunks - 1) / chunks, tile_rows);
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += chunk)
      for (int64_t b = 0; b < blocks; ++b)
        items.push_back({int32_t(e), int32_t(r), int32_t(std::min(chunk, offsets[e + 1] - r)), int32_t(b)});
  }
  return items;
}

// The weight block an item reads: weights of `blocks` blocks an expert, `bytes` each.
const char* block_of(const void* weights, const Item& it, int64_t blocks, int64_t bytes) {
  return static_cast<const char*>(weights) + (it.expert * blocks + it.block) * bytes;
}

// The combine's sum, written so the compiler vectorizes it.
void add_row(float* __restrict acc, const float* __restrict y, int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] += y[h];
}

}  // namespace

void parallel_items(const Parallel& parallel, int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  int workers = int(std::min<int64_t>(std::max(parallel.workers, 1), n));
  if (workers == 1 || !parallel.run) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Workers claim runs of consecutive items: consecutive items read consecutive weight blocks, so a run is
  // one long stream the hardware prefetcher keeps up with (a new stream every block costs ~10% in decode).
  // Runs are guided: each takes a 1/(2 x workers) share of what is left, so the last ones are single items
  // and the workers finish together even with skewed items.
  std::atomic<int64_t> next{0};
  parallel.run(workers, [&](int) {
    for (;;) {
      int64_t begin = next.load(std::memory_order_relaxed), run;
      do {
        if (begin >= n) return;
        run = std::max<int64_t>(1, (n - begin) / (2 * int64_t(workers)));
      } while (!next.compare_exchange_weak(begin, begin + run, std::memory_order_relaxed));
      for (int64_t i = begin; i < begin + run; ++i) fn(i);
    }
  });
}

namespace {

// Where the blocks are and what the tiles take, for dense or quantized weights.
struct Geometry {
  int64_t blocks13, bytes13, k13;  // w13: blocks per expert, bytes per block, padded K (H)
  int64_t blocks2, bytes2, k2;     // w2: the same (k2 = Ip)
  int64_t Hp;
  int max_rows;
  bool int8_rows;                  // activations reach the tiles as quant.h's A8 rows
};

Geometry geometry(const FusedMoeArgs& a) {
  Geometry g{};
  if (a.quant) {
    g.k13 = round_up(a.H, kQuantKAlign);
    g.blocks13 = a.I / kW13BlockInter;
    g.bytes13 = quant_block_bytes(a.format, g.k13, a.group13, a.symmetric13);
    g.k2 = a.I;
    g.blocks2 = round_up(a.H, kBlockCols) / kBlockCols;
    g.bytes2 = quant_block_bytes(a.format, a.I, a.group2, a.symmetric2);
    g.max_rows = a.quant->max_rows;
    g.int8_rows = quant_int8_activations(a.format);
  } else {
    const int64_t es = dtype_size(a.dtype);
    const PackedShape s13 = w13_packed_shape(a.H, a.I, a.kernels->layout);
    const PackedShape s2 = w2_packed_shape(a.H, a.I, a.kernels->layout);
    g = {s13.blocks, s13.block_elems * es, s13.k, s2.blocks, s2.block_elems * es, s2.k, 0, a.kernels->max_rows,
         false};
  }
  g.Hp = g.blocks2 * kBlockCols;
  return g;
}

thread_local KernelClock kernel_clock;

}  // namespace

KernelClock fused_moe_clock() { return kernel_clock; }

void fused_moe(const FusedMoeArgs& a, const Parallel& parallel) {
  const auto start = std::chrono::steady_clock::now();
  const Geometry geo = geometry(a);
  const int64_t M = a.M, H = a.H, K = a.topk, es = dtype_size(a.dtype);
  const int64_t Ip = geo.k2, Hp = geo.Hp;
  const TileFn w13_tile = a.quant ? a.quant->w13_tile : a.kernels->w13_tile;
  const TileFn w2_tile = a.quant ? a.quant->w2_tile : a.kernels->w2_tile;

  // 1. Map ids to local experts and count rows per expert.
  std::vector<int32_t> local(M * K);
  std::vector<int64_t> offsets(a.local_experts + 1, 0);
  for (int64_t i = 0; i < M * K; ++i) {
    int32_t id = a.topk_ids[i];
    if (id < 0 || id >= a.global_experts)
      throw std::invalid_argument("topk_ids holds expert id " + std::to_string(id) + " at token " +
                                  std::to_string(i / K) + ", outside [0, " + std::to_string(a.global_experts) + ")");
    int32_t e = a.expert_map ? a.expert_map[id] : id;
    if (e >= a.local_experts)
      throw std::invalid_argument("expert_map maps expert " + std::to_string(id) + " to local id " +
                                  std::to_string(e) + ", outside [0, " + std::to_string(a.local_experts) + ")");
    local[i] = e;
    if (e >= 0) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < a.local_experts; ++e) offsets[e + 1] += offsets[e];
  const int64_t rows = offsets[a.local_experts];

  // 2. Scratch: the tiles' input rows (a padded/scaled copy, or A8 quantized rows), sorted row tables, the
  //    intermediate (dtype; float32 then A8 rows when quantized to int8), w2 outputs.
  const bool copy_input = a.apply_router_weight_on_input || geo.k13 != H;
  const int64_t stride13 = geo.int8_rows ? quant_row_stride(*a.quant, geo.k13) : geo.k13 * es;
  const int64_t stride2 = geo.int8_rows ? quant_row_stride(*a.quant, Ip) : Ip * es;
  const int64_t inter_es = geo.int8_rows ? 4 : es;
  auto align = [](int64_t b) { return round_up(b, 64); };
  const int64_t bytes_x = copy_input ? align(M * geo.k13 * es) : 0;
  const int64_t bytes_qx = geo.int8_rows ? align(M * stride13) : 0;
  const int64_t bytes_ptr = align(rows * int64_t(sizeof(void*)));
  const int64_t bytes_scale = align(rows * 4), bytes_slot = align(M * K * 8);
  const int64_t bytes_inter = align(rows * Ip * inter_es), bytes_qinter = geo.int8_rows ? align(rows * stride2) : 0;
  const int64_t bytes_y = align(rows * Hp * 4);
  // Only where rows are shared by experts' tiles at all: a decode's handful of rows each take one tile call.
  const bool sort_rows = (a.quant ? a.quant->sorted_rows : a.kernels->sorted_rows) && rows >= 2 * a.local_experts;
  const int64_t bytes_sorted = sort_rows ? align(rows * (geo.int8_rows ? stride13 : geo.k13 * es)) : 0;
  static thread_local Scratch scratch;
  char* base = scratch.get(bytes_x + bytes_qx + 2 * bytes_ptr + bytes_scale + bytes_slot + bytes_inter + bytes_qinter +
                           bytes_y + bytes_sorted + 64);
  char* x_copy = base;
  char* qx = x_copy + bytes_x;
  const void** a13 = reinterpret_cast<const void**>(qx + bytes_qx);
  const void** a2 = reinterpret_cast<const void**>(reinterpret_cast<char*>(a13) + bytes_ptr);
  float* row_scale = reinterpret_cast<float*>(reinterpret_cast<char*>(a2) + bytes_ptr);
  int64_t* slot_row = reinterpret_cast<int64_t*>(reinterpret_cast<char*>(row_scale) + bytes_scale);
  char* inter = reinterpret_cast<char*>(slot_row) + bytes_slot;
  char* qinter = inter + bytes_inter;
  float* ys = reinterpret_cast<float*>(qinter + bytes_qinter);
  char* x_sorted = reinterpret_cast<char*>(ys) + bytes_y;

  const char* x = static_cast<const char*>(a.hidden);
  int64_t x_stride = H * es;
  if (copy_input) {
    for (int64_t t = 0; t < M; ++t) {
      char* dst = x_copy + t * geo.k13 * es;
      std::memset(dst + H * es, 0, (geo.k13 - H) * es);
      if (!a.apply_router_weight_on_input) {
        std::memcpy(dst, x + t * H * es, H * es);
        continue;
      }
      const float w = a.topk_weights[t * K];  // k == 1 here, checked by the caller
      for (int64_t h = 0; h < H; ++h) store_from_f32(dst, h, load_as_f32(x, t * H + h, a.dtype) * w, a.dtype);
    }
    x = x_copy;
    x_stride = geo.k13 * es;
  }
  if (geo.int8_rows) {  // one quantized row per token, shared by its k slots
    const char* src = x;
    const int64_t src_stride = x_stride;
    parallel_items(parallel, M, [&](int64_t t) {
      quantize_row(*a.quant, src + t * src_stride, H, a.dtype, geo.k13,
                   reinterpret_cast<uint8_t*>(qx + t * stride13));
    });
    x = qx;
    x_stride = stride13;
  }

  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  for (int64_t i = 0; i < M * K; ++i) {
    if (local[i] < 0) {
      slot_row[i] = -1;
      continue;
    }
    int64_t r = fill[local[i]]++;
    slot_row[i] = r;
    a13[r] = x + (i / K) * x_stride;
    a2[r] = geo.int8_rows ? qinter + r * stride2 : inter + r * Ip * es;
    row_scale[r] = a.topk_weights[i];
  }
  if (sort_rows)  // w13's rows in expert order, one after another (KernelTable::sorted_rows)
    parallel_items(parallel, rows, [&](int64_t r) {
      char* dst = x_sorted + r * x_stride;
      std::memcpy(dst, a13[r], x_stride);
      a13[r] = dst;
    });
  const float* w2_scale = a.apply_router_weight_on_input ? nullptr : row_scale;

  // 3. w13 with the activation fused: inter[r][Ip].
  const bool stream_inter = geo.int8_rows && bytes_inter >= kStreamBytes && Ip * inter_es % 64 == 0;
  std::vector<Item> items13 = make_items(offsets, geo.blocks13, geo.max_rows);
  parallel_items(parallel, int64_t(items13.size()), [&](int64_t i) {
    const Item& it = items13[i];
    GemmTile t{};
    t.a_rows = a13 + it.row_begin;
    t.rows = it.rows;
    t.k = geo.k13;
    t.b = block_of(a.w13, it, geo.blocks13, geo.bytes13);
    t.bias = a.w13_bias ? a.w13_bias + (it.expert * geo.blocks13 + it.block) * kBlockCols : nullptr;
    t.out = inter + (it.row_begin * Ip + it.block * kW13BlockInter) * inter_es;
    t.out_stride = Ip;
    t.out_cols = kW13BlockInter;
    t.dtype = geo.int8_rows ? DType::kFloat32 : a.dtype;
    t.act = a.act;
    t.group = a.group13;
    t.symmetric = a.symmetric13;
    t.stream_out = stream_inter;
    if (i + 1 < int64_t(items13.size())) {
      t.next_b = block_of(a.w13, items13[i + 1], geo.blocks13, geo.bytes13);
      t.next_bytes = geo.bytes13;
    }
    w13_tile(t);
    if (stream_inter) store_fence();
  });

  // 3b. A8: quantize each intermediate row per (token, slot), as the reference does.
  if (geo.int8_rows)
    parallel_items(parallel, rows, [&](int64_t r) {
      quantize_row_f32(*a.quant, reinterpret_cast<const float*>(inter) + r * Ip, Ip, Ip,
                       reinterpret_cast<uint8_t*>(qinter + r * stride2));
    });

  // 4. w2, scaled by the router weight: ys[r][Hp] float32.
  const bool stream_ys = bytes_y >= kStreamBytes;
  std::vector<Item> items2 = make_items(offsets, geo.blocks2, geo.max_rows);
  parallel_items(parallel, int64_t(items2.size()), [&](int64_t i) {
    const Item& it = items2[i];
    GemmTile t{};
    t.a_rows = a2 + it.row_begin;
    t.rows = it.rows;
    t.k = Ip;
    t.b = block_of(a.w2, it, geo.blocks2, geo.bytes2);
    t.bias = a.w2_bias ? a.w2_bias + it.expert * Hp + it.block * kBlockCols : nullptr;
    t.row_scale = w2_scale ? w2_scale + it.row_begin : nullptr;
    t.out = ys + it.row_begin * Hp + it.block * kBlockCols;
    t.out_stride = Hp;
    t.out_cols = int(std::min<int64_t>(kBlockCols, H - it.block * kBlockCols));
    t.dtype = a.dtype;
    t.group = a.group2;
    t.symmetric = a.symmetric2;
    t.stream_out = stream_ys;
    if (i + 1 < int64_t(items2.size())) {
      t.next_b = block_of(a.w2, items2[i + 1], geo.blocks2, geo.bytes2);
      t.next_bytes = geo.bytes2;
    }
    w2_tile(t);
    if (stream_ys) store_fence();
  });

  // 5. Combine: out[t] = sum over the token's slots, in slot order.
  constexpr int64_t kTokensPerItem = 16;
  parallel_items(parallel, (M + kTokensPerItem - 1) / kTokensPerItem, [&](int64_t i) {
    std::vector<float> acc(H);
    for (int64_t t = i * kTokensPerItem; t < std::min(M, (i + 1) * kTokensPerItem); ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < K; ++j)
        if (slot_row[t * K + j] >= 0) add_row(acc.data(), ys + slot_row[t * K + j] * Hp, H);
      store_row(acc.data(), static_cast<char*>(a.out) + t * H * es, H, a.dtype);
    }
  });
  ++kernel_clock.calls;
  kernel_clock.last_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace cpumoe
