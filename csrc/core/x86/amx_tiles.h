// The tile configuration the AMX units share (kernels_amx.cpp, quant_amx.cpp): eight tiles of 16 rows x 64 bytes.
// Tiles 0-3 accumulate (16 x 16 float32 or int32), 4 holds A (16 rows x 64 bytes of k), 6-7 hold B (16 k-steps x
// 16 columns x 64 bytes). Built with -mamx-tile.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace cpumoe {
namespace amx {

constexpr int kTileRows = 16;  // rows of an A tile and of an accumulator tile

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loaded at the start of every call that uses tiles: the configuration belongs to the thread, and other code on
// the same thread (oneDNN's GEMMs under torch) sets its own. _tile_release() at the call's end.
inline void configure_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = kTileRows;
  }
  // Not _tile_loadconfig: GCC 12's declares only the first 8 bytes of the configuration as read, and the stores to
  // the rest may be dropped as dead (a tile instruction then faults as not configured).
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

}  // namespace amx
}  // namespace cpumoe
