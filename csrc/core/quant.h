// Quantized weight formats of the fused experts and the dense linears: what a packed block holds, how the
// activations reach a tile, and what a tile computes. One block layout per format serves every ISA (the
// x86 and Arm tiles read the same bytes), so packing (quant_pack.cpp) knows no ISA.
//
//   format        weights (per output row n, along k)                 activations  compute
//   int8_w8a8     int8 w, symmetric, f32 scale per row                int8/token   int32 dot, f32 rescale
//   int4_w4a16    4-bit code q in [0,15], (q - z) * s per group of g  int8/token   int8 dot per group (W4A8)
//   fp8_w8a16     float8 e4m3 w, f32 scale per (row, k-chunk of g)    bf16         bf16 dot per chunk
//   mxfp4_w4a16   e2m1 code, scale 2^(e-127) per 32 along k           int8/token   int8 dot per 32 (W4A8)
//
// int4_w4a16 and mxfp4_w4a16 compute as W4A8: activations are quantized per token to int8 like int8_w8a8's,
// because the int8 dot products (VNNI, SDOT, SMMLA) do 4-8 multiply-adds per lane where bf16 ones do 2; the
// reference (cpumoe/reference.py) quantizes activations the same way, so the maths checked is the maths run.
// An e2m1 value times 2 is an integer in [-12, 12] (kMxfp4Twice), so an mxfp4 group's dot is exact in int32.
//
// Common to every format:
//   * Blocks of kBlockCols = 64 output columns, as the dense layouts: w13 block b holds gate rows
//     32b..32b+31 in columns 0..31 and the matching up rows in columns 32..63; w2 and linear blocks hold
//     64 consecutive rows. Missing rows (past I or H) are zero weights with scale 0.
//   * The reduction length K is padded to Kp = round_up(K, 32); padded weights may hold anything finite
//     (the padded activations are 0): packing writes zero codes (int4: the zero point).
//   * A block is its weights followed by its metadata, all in one run of bytes (one stream per block).
//
// Block layouts (bytes; n = column 0..63 of the block, k = 0..Kp-1):
//
//   int8_w8a8   [Kp/4][64][4] int8: byte (k/4*64 + n)*4 + k%4 = w[n][k]                    64*Kp bytes
//               f32 scale[64]; i32 colsum[64] = sum over k of w[n][k]                        +512 bytes
//               (colsum lets tiles that take activations as unsigned u = q + 128 (VNNI's u8 x s8)
//                subtract 128 * colsum[n]; signed x signed tiles ignore it.)
//
//   int4_w4a16  per k-octet s (Kp/8 of them), 256 bytes = 4 runs of 64 bytes; in run j (columns 16j..16j+15)
//               byte i holds column n = 16j + i/4, kk = i%4:
//                   low nibble = q[n][8s + kk], high nibble = q[n][8s + 4 + kk]            32*Kp bytes
//               (so a 64-byte load & 0xF is a VNNI k-quad for 16 columns and >> 4 the next quad; any
//                16-byte quarter is 4 columns x 4 k for SDOT, and zipping the two gives SMMLA's 2 x 8.)
//               then per group G (Kp/g of them): f32 scale[64], f32 zero[64]                 +512*Kp/g bytes
//               value = (q - zero) * scale. Symmetric weights (no zero points: zero = 8, as GPTQ's and
//               compressed-tensors' symmetric int4) keep f32 scale[64] alone per group     +256*Kp/g bytes
//               (6% fewer bytes at g = 128); the tiles then take their zeros from kInt4SymmetricZeros.
//               g (group size) is 32, 64, 128, ... dividing Kp (whole channel: g = Kp).
//
//   fp8_w8a16   [Kp/2][64][2] e4m3 bytes: byte (k/2*64 + n)*2 + k%2 = w[n][k]                 64*Kp bytes
//               then f32 scale[ceil(Kp/g)][64]: scale of (column n, k-chunk k/g)             +256*ceil(Kp/g)
//               then u64 words, bit p of word p/64 set where k-pair p's 128 codes hold a zero    +Kp/16 bytes,
//               exponent field (a zero or a subnormal: tiles that widen e4m3 with shifts    padded to 64
//               skip their fix-up elsewhere)
//               value = e4m3_to_float(w) * scale; g is the checkpoint's k block (128), even.
//
//   mxfp4_w4a16 the e2m1 codes q in int4_w4a16's nibble order (above)                       32*Kp bytes
//               then u8 scale[Kp/32][64] (e8m0): byte 64 G + n is column n's exponent for k-group G
//                                                                                           +2*Kp bytes
//               value = kE2m1[q] * 2^(scale - 127) = kMxfp4Twice[q] * 2^(scale - 128); scale 0 reads
//               as a zero group. kE2m1 = 0, .5, 1, 1.5, 2, 3, 4, 6, then negated.
//
// Activations, as the driver hands them to a tile (GemmTile::a_rows[r] points at a row):
//   A8 formats (int8_w8a8, int4_w4a16, mxfp4_w4a16): a quantized row of kQuantRowStride(Kp) bytes:
//       int8 a[Kp] (stored as u8 = a + 128 when the tile set has unsigned_activations), then at byte Kp a
//       f32 scale, then at byte Kp + 4 int32 sums[Kp/32]: sums[c] = sum of a[32c .. 32c+31] (signed a).
//       Quantization per row: scale = max|x| / 127, a = round_half_even(x / scale) (all 0 when max is 0).
//       Where the tile set has bf16_codes, the row goes on with bf16 a[Kp] (the same values, exact).
//   A16 format (fp8): bf16 rows of Kp elements (zero-padded).
//
// Tile outputs (GemmTile::out):
//   w13: out[r][0:32] = act(gate + bias) * (up + bias) for the block's 32 intermediate columns:
//        float32 for A8 formats (the driver then quantizes the whole intermediate row per token),
//        bf16 for A16 formats (GemmTile::dtype says which).
//   w2 / linear: float32 out[r][0:out_cols] = (dot + bias) * row_scale[r], exactly as the dense w2 tile.
// Dot products are exact integer sums for A8 formats, rescaled in float32 once per group (int4, mxfp4) or
// once per row (int8): y = scale_a * sum_G scale_w[G] * (acc_G - zero[G] * sums_G) for int4, y = scale_a *
// scale_w * (acc) for int8, and for mxfp4 (acc_G = sum of kMxfp4Twice[q] * a, so the 2 is taken off with
// the row's scale) y = (sum_G 2^(e_G - 127) * acc_G) * (scale_a * 0.5). Each backend sums the groups in
// order, one rounding per group, so every backend gives the same bits; but x86-amx's mxfp4 prefill, which
// sums the same exact products (the A8 codes times the weights' values, both exact in bf16) on bf16 tiles,
// in float32 in the tiles' order (QuantKernel::bf16_codes).
#pragma once
#include <cstdint>

#include "kernels.h"

namespace cpumoe {

enum class QuantFormat : int { kInt8W8A8 = 0, kInt4W4A16 = 1, kFp8W8A16 = 2, kMxfp4W4A16 = 3 };
constexpr int kNumQuantFormats = 4;
constexpr int kQuantKAlign = 32;   // Kp = round_up(K, 32)
constexpr int kMxfp4Group = 32;

inline const char* quant_format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kInt8W8A8: return "int8_w8a8";
    case QuantFormat::kInt4W4A16: return "int4_w4a16";
    case QuantFormat::kFp8W8A16: return "fp8_w8a16";
    default: return "mxfp4_w4a16";
  }
}
// True for the formats whose activations are quantized to int8 per token.
inline bool quant_int8_activations(QuantFormat f) { return f != QuantFormat::kFp8W8A16; }

// int4_w4a16 metadata: floats per group (scale[64], and zero[64] unless symmetric), and a group's zeros.
inline int64_t int4_group_floats(bool symmetric) { return symmetric ? 64 : 128; }
struct Int4SymmetricZeros {
  alignas(64) float z[64];
  constexpr Int4SymmetricZeros() : z() {
    for (float& v : z) v = 8.0f;
  }
};
inline constexpr Int4SymmetricZeros kInt4SymmetricZeros{};
inline const float* int4_zeros(const float* group_scales, bool symmetric) {
  return symmetric ? kInt4SymmetricZeros.z : group_scales + 64;
}

// An int8_w8a8 block's bytes after its 64 * Kp codes: f32 scale[64], i32 colsum[64].
inline constexpr int64_t kInt8MetaBytes = 512;

// An fp8_w8a16 block's bytes after its 64 * Kp codes: its scales (k-chunks of g), then its zero-exponent bits.
inline int64_t fp8_scale_bytes(int64_t Kp, int64_t g) { return 256 * ((Kp + g - 1) / g); }
inline int64_t fp8_meta_bytes(int64_t Kp, int64_t g) {
  return fp8_scale_bytes(Kp, g) + round_up((Kp / 2 + 7) / 8, 64);
}

// Bytes of one packed block of 64 columns over Kp (already padded) with group size g (int4: group, fp8:
// k-chunk; ignored by int8 and mxfp4); symmetric: an int4 block without zero points.
inline int64_t quant_block_bytes(QuantFormat f, int64_t Kp, int64_t g, bool symmetric = false) {
  switch (f) {
    case QuantFormat::kInt8W8A8: return 64 * Kp + kInt8MetaBytes;
    case QuantFormat::kInt4W4A16: return 32 * Kp + 4 * int4_group_floats(symmetric) * (Kp / g);
    case QuantFormat::kFp8W8A16: return 64 * Kp + fp8_meta_bytes(Kp, g);
    default: return 34 * Kp;
  }
}

// Bytes of one quantized activation row (A8 formats): Kp int8, f32 scale, int32 sums[Kp/32], 64-aligned.
inline int64_t quant_row_stride(int64_t Kp) { return round_up(Kp + 4 + 4 * (Kp / 32), 64); }

// e2m1 code -> value.
constexpr float kE2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
// e2m1 code -> 2 x value, an int8. Tiles whose products take an unsigned weight (x86 u8 x s8) look up
// kMxfp4Twice + kMxfp4Offset (0..24) and take kMxfp4Offset x the group's activation sum off.
constexpr int8_t kMxfp4Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int kMxfp4Offset = 12;

// float8 e4m3fn byte -> float (exact; 0x7f / 0xff are NaN).
inline float e4m3_to_float(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 7;
  float v;
  if (exp == 0xF && man == 7) v = __builtin_nanf("");
  else if (exp == 0) v = float(man) * (1.0f / 512.0f);  // subnormal: man * 2^-9
  else v = (1.0f + float(man) / 8.0f) * float(1 << exp) * (1.0f / 128.0f);
  return sign ? -v : v;
}

// One ISA's tiles for one format. Tiles take any number of rows (they split them into register tiles, as
// run_row_tiles does) and read GemmTile as documented above; GemmTile::group is the format's g.
// Writes one A8 row from float32 x[0:K] (K <= Kp) at dst (quant_row.h).
using WriteRowFn = void (*)(const float* x, int64_t K, int64_t Kp, bool unsigned_activations, uint8_t* dst);

struct QuantKernel {
  int max_rows;               // rows per register tile (a hint for the driver's chunking)
  bool unsigned_activations;  // A8: rows hold u8 = a + 128 (x86 VNNI / AVX2 u8 x s8 products)
  TileFn w13_tile;
  TileFn w2_tile;
  WriteRowFn write_row = nullptr;  // A8: this ISA's build of the row writer (nullptr: the baseline one)
  bool sorted_rows = false;        // as KernelTable::sorted_rows (the A8 rows of w13 in expert order)
  bool bf16_codes = false;         // A8 rows carry their codes again, as bf16 [Kp] at quant_row_stride(Kp),
                                   // written by write_row, for tiles that sum them on bf16 units
};

// Bytes of one of q's A8 rows: the A8 layout, then its bf16 codes where q reads them.
inline int64_t quant_row_stride(const QuantKernel& q, int64_t Kp) {
  return quant_row_stride(Kp) + (q.bf16_codes ? round_up(2 * Kp, 64) : 0);
}

// Quantizes one row x[0:K] (bf16/f16/f32 as `dtype`; K <= Kp) into the A8 row layout at dst, with q's row
// writer. Every writer gives the same bits; a prefill quantizes each token's row and each (token, slot)'s
// intermediate, 10% of an int8 layer at M = 2048 with the baseline writer.
void quantize_row(const QuantKernel& q, const void* x, int64_t K, DType dtype, int64_t Kp, uint8_t* dst);
// The same from float32 (the intermediate of A8 formats).
void quantize_row_f32(const QuantKernel& q, const float* x, int64_t K, int64_t Kp, uint8_t* dst);

// The portable tiles of each format (quant_generic.cpp): every other backend is checked against them.
const QuantKernel& quant_generic(QuantFormat f);
#if defined(__x86_64__)
const QuantKernel* quant_x86_avx512vnni(QuantFormat f);  // int8, int4, mxfp4; nullptr for fp8
const QuantKernel* quant_x86_avx512bf16(QuantFormat f);
const QuantKernel* quant_x86_amx(QuantFormat f);        // all four
const QuantKernel* quant_x86_avx2(QuantFormat f);        // all four
#endif
#if defined(__aarch64__)
const QuantKernel* quant_arm_i8mm(QuantFormat f);        // int8, int4 (SMMLA)
const QuantKernel* quant_arm_dotprod(QuantFormat f);     // int8, int4 (SDOT)
#endif

}  // namespace cpumoe
