#include "quant_pack.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace cpumoe {
namespace {

// Row-wise metadata of one source row, read through the canonical scale/zero arrays.
struct RowView {
  const uint8_t* codes;   // [K] or nullptr for a missing row (past I or H)
  const void* scales;     // this row's scales
  const uint8_t* zeros;   // this row's zeros or nullptr
};

int64_t scale_cols(const QuantSource& s) {
  switch (s.format) {
    case QuantFormat::kInt8W8A8: return 1;
    case QuantFormat::kInt4W4A16: return s.group ? s.K / s.group : 1;
    case QuantFormat::kFp8W8A16: return s.group ? (s.K + s.group - 1) / s.group : 1;
    default: return s.K / kMxfp4Group;
  }
}

// 4-bit codes in the int4_w4a16 / mxfp4_w4a16 order (quant.h): k-octet s, run j, byte i holds column
// 16j + i/4, k = 8s + i%4 in the low nibble and k + 4 in the high one.
template <class Code>
void pack_nibbles(const Code& code, int64_t Kp, uint8_t* out) {
  for (int64_t oct = 0; oct < Kp / 8; ++oct)
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 64; ++i) {
        const int n = 16 * j + i / 4, kk = i % 4;
        out[oct * 256 + j * 64 + i] = uint8_t((code(n, 8 * oct + kk) & 0xF) | (code(n, 8 * oct + 4 + kk) << 4));
      }
}

void pack_block(const QuantSource& s, const QuantPackedShape& shape, const RowView (&rows)[kBlockCols],
                uint8_t* out) {
  const int64_t Kp = shape.kp, K = s.K;
  std::memset(out, 0, shape.block_bytes);
  auto code = [&](int n, int64_t k) -> uint8_t { return rows[n].codes && k < K ? rows[n].codes[k] : 0; };
  const float* fs[kBlockCols];
  for (int n = 0; n < kBlockCols; ++n) fs[n] = static_cast<const float*>(rows[n].scales);
  switch (s.format) {
    case QuantFormat::kInt8W8A8: {
      float* scale = reinterpret_cast<float*>(out + 64 * Kp);
      int32_t* colsum = reinterpret_cast<int32_t*>(scale + kBlockCols);
      for (int n = 0; n < kBlockCols; ++n) {
        int32_t sum = 0;
        for (int64_t k = 0; k < Kp; ++k) {
          const int8_t w = int8_t(code(n, k));
          out[(k / 4 * kBlockCols + n) * 4 + k % 4] = uint8_t(w);
          sum += w;
        }
        scale[n] = rows[n].codes ? fs[n][0] : 0.0f;
        colsum[n] = sum;
      }
      break;
    }
    case QuantFormat::kInt4W4A16: {
      pack_nibbles(code, Kp, out);
      const int64_t groups = Kp / shape.group, src_groups = scale_cols(s);
      const bool symmetric = packs_symmetric(s);
      const int64_t stride = int4_group_floats(symmetric);
      float* meta = reinterpret_cast<float*>(out + 32 * Kp);
      for (int64_t g = 0; g < groups; ++g)
        for (int n = 0; n < kBlockCols; ++n) {
          const bool have = rows[n].codes && g < src_groups;
          meta[g * stride + n] = have ? fs[n][g] : 0.0f;
          if (!symmetric) meta[g * stride + 64 + n] = have ? float(rows[n].zeros[g]) : 8.0f;
        }
      break;
    }
    case QuantFormat::kFp8W8A16: {
      for (int64_t k = 0; k < Kp; ++k)
        for (int n = 0; n < kBlockCols; ++n) out[(k / 2 * kBlockCols + n) * 2 + k % 2] = code(n, k);
      const int64_t chunks = (Kp + shape.group - 1) / shape.group, src_chunks = scale_cols(s);
      float* scale = reinterpret_cast<float*>(out + 64 * Kp);
      for (int64_t c = 0; c < chunks; ++c)
        for (int n = 0; n < kBlockCols; ++n) scale[c * 64 + n] = rows[n].codes && c < src_chunks ? fs[n][c] : 0.0f;
      uint64_t* zero_exponents = reinterpret_cast<uint64_t*>(out + 64 * Kp + fp8_scale_bytes(Kp, shape.group));
      for (int64_t p = 0; p < Kp / 2; ++p)
        if (std::any_of(out + 128 * p, out + 128 * (p + 1), [](uint8_t c) { return (c & 0x78) == 0; }))
          zero_exponents[p / 64] |= uint64_t(1) << (p % 64);
      break;
    }
    default: {
      pack_nibbles(code, Kp, out);
      uint8_t* scale = out + 32 * Kp;
      for (int64_t c = 0; c < Kp / kMxfp4Group; ++c)
        for (int n = 0; n < kBlockCols; ++n)
          scale[c * 64 + n] = rows[n].codes && c < s.K / kMxfp4Group
                                  ? static_cast<const uint8_t*>(rows[n].scales)[c] : 0;
      break;
    }
  }
}

}  // namespace

QuantPackedShape quant_packed_shape(QuantFormat f, int64_t N, int64_t K, int64_t group, bool w13, bool symmetric) {
  const int64_t Kp = round_up(K, kQuantKAlign);
  int64_t g = 0;
  if (f == QuantFormat::kInt4W4A16) {
    g = group == 0 || group == K ? Kp : group;
    if (g != Kp && (g % kQuantKAlign || K % g))
      throw std::invalid_argument("int4 group size " + std::to_string(group) + " must be a multiple of 32 dividing K=" +
                                  std::to_string(K) + " (or 0 for a whole row)");
  } else if (f == QuantFormat::kFp8W8A16) {
    g = group == 0 ? Kp : group;
    if (g <= 0 || g % 2)
      throw std::invalid_argument("fp8 k-chunk " + std::to_string(group) + " must be a positive even number");
  } else if (f == QuantFormat::kMxfp4W4A16) {
    g = kMxfp4Group;
    if (K % kMxfp4Group)
      throw std::invalid_argument("mxfp4 needs K=" + std::to_string(K) + " to be a multiple of 32");
  } else {
    g = Kp;
  }
  const int64_t blocks = w13 ? round_up(N / 2, kW13BlockInter) / kW13BlockInter : round_up(N, kBlockCols) / kBlockCols;
  return {blocks, quant_block_bytes(f, Kp, g, symmetric), Kp, g};
}

void pack_quant(const QuantSource& s, bool w13, uint8_t* dst, int64_t e_begin, int64_t e_end) {
  const QuantPackedShape shape = quant_packed_shape(s.format, s.N, s.K, s.group, w13, packs_symmetric(s));
  const int64_t cols = scale_cols(s);
  const int64_t scale_bytes = s.format == QuantFormat::kMxfp4W4A16 ? 1 : 4;
  const int64_t I = s.N / 2;
  for (int64_t e = e_begin; e < e_end; ++e)
    for (int64_t b = 0; b < shape.blocks; ++b) {
      RowView rows[kBlockCols];
      for (int n = 0; n < kBlockCols; ++n) {
        int64_t row;
        if (w13) {
          const int64_t i = b * kW13BlockInter + n % kW13BlockInter;
          row = i < I ? (n < kW13BlockInter ? i : I + i) : -1;
        } else {
          row = b * kBlockCols + n < s.N ? b * kBlockCols + n : -1;
        }
        if (row < 0) {
          rows[n] = {nullptr, nullptr, nullptr};
          continue;
        }
        const int64_t r = e * s.N + row;
        rows[n] = {s.codes + r * s.K, static_cast<const char*>(s.scales) + r * cols * scale_bytes,
                   s.zeros ? s.zeros + r * cols : nullptr};
      }
      pack_block(s, shape, rows, dst + (e * shape.blocks + b) * shape.block_bytes);
    }
}

}  // namespace cpumoe
