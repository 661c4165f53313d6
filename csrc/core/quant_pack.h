// Packing canonical quantized weights (cpumoe/quant/formats.py: one code per element, row-wise scales)
// into quant.h's blocks. One layout per format, whatever the ISA.
#pragma once
#include <cstdint>

#include "quant.h"

namespace cpumoe {

// One stack [E][N][K] of canonical tensors.
struct QuantSource {
  QuantFormat format = QuantFormat::kInt8W8A8;
  const uint8_t* codes = nullptr;   // [E][N][K], one byte per element (int8, 0..15 codes, or e4m3)
  const void* scales = nullptr;     // f32 [E][N] | f32 [E][N][K/g] | f32 [E][N][ceil(K/g)] | u8 [E][N][K/32]
  const uint8_t* zeros = nullptr;   // int4: [E][N][K/g], or nullptr (symmetric: zero point 8, packed without)
  int64_t N = 0, K = 0;
  int64_t group = 0;                // int4 group / fp8 k-chunk as stored; 0 = a whole row
};

struct QuantPackedShape {
  int64_t blocks;       // blocks per expert
  int64_t block_bytes;
  int64_t kp;           // padded reduction length
  int64_t group;        // the group the tiles use (GemmTile::group): a whole row resolved to kp
};

// w13 (N = 2I rows: gate then up; blocks of 32 + 32 rows) or w2 / linear (blocks of 64 rows).
// group: as QuantSource::group; symmetric: int4 blocks without zero points. Throws std::invalid_argument for a
// group the format cannot take.
QuantPackedShape quant_packed_shape(QuantFormat f, int64_t N, int64_t K, int64_t group, bool w13,
                                    bool symmetric = false);

// Whether src packs as symmetric int4 blocks (int4 without zero points).
inline bool packs_symmetric(const QuantSource& src) { return src.format == QuantFormat::kInt4W4A16 && !src.zeros; }

// Packs experts [e_begin, e_end) of src into dst (the whole packed array [E][blocks][block_bytes]).
void pack_quant(const QuantSource& src, bool w13, uint8_t* dst, int64_t e_begin, int64_t e_end);

}  // namespace cpumoe
