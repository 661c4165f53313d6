// Tile-level check of the Arm A8 tiles (arm-i8mm's SMMLA and arm-dotprod's SDOT, int8_w8a8, int4_w4a16
// and mxfp4_w4a16), and of the generic ones they are held to, against a scalar float64 reading of
// ../../../csrc/core/quant.h: random packed blocks and
// quantized activation rows, every row count 1..9 (so every register tile and a split by run_row_tiles),
// Kp 32, 96, 2048, int4 groups 32, 64, 128 and Kp where they divide Kp (mxfp4: 32), the four activations, bias and
// row_scale on and off, a w2 right edge (out_cols < 64). Outputs are written with a row stride wider
// than the tile, the gap filled with a sentinel that must survive. Cross-compiled with the Arm units and
// run under qemu-aarch64 by test_arm_qemu.py; prints one line per (backend, format, Kp, g) with the largest
// error relative to the largest |reference| of its tile, and exits 1 when one is over the tolerance.
//
//   quant_tiles [TOL]        TOL: relative tolerance (default 1e-5)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/quant.h"
#include "guarded.h"

namespace {

using namespace cpumoe;

constexpr float kSentinel = -1234.5f;

struct Rows {
  int64_t Kp;
  std::vector<uint8_t> data;  // rows * quant_row_stride(Kp)
  std::vector<const void*> ptrs;
};

// n quantized rows (signed int8 in [-127, 127], scale, sums per 32), in reverse order in memory so the
// tile's row pointers are not one stride apart.
Rows make_rows(std::mt19937& rng, int n, int64_t Kp) {
  const int64_t stride = quant_row_stride(Kp);
  Rows r{Kp, std::vector<uint8_t>(n * stride), {}};
  std::uniform_int_distribution<int> q(-127, 127);
  std::uniform_real_distribution<float> scale(0.005f, 0.02f);
  for (int i = 0; i < n; ++i) {
    uint8_t* row = r.data.data() + (n - 1 - i) * stride;
    int8_t* a = reinterpret_cast<int8_t*>(row);
    for (int64_t k = 0; k < Kp; ++k) a[k] = int8_t(q(rng));
    const float s = scale(rng);
    std::memcpy(row + Kp, &s, 4);
    for (int64_t c = 0; c < Kp / 32; ++c) {
      int32_t sum = 0;
      for (int k = 0; k < 32; ++k) sum += a[32 * c + k];
      std::memcpy(row + Kp + 4 + 4 * c, &sum, 4);
    }
    r.ptrs.push_back(row);
  }
  return r;
}

// A random block of `f` over Kp with group g, as quant.h lays it out; column 63 is a missing row (scale 0).
std::vector<uint8_t> make_block(std::mt19937& rng, QuantFormat f, int64_t Kp, int64_t g) {
  std::vector<uint8_t> b(quant_block_bytes(f, Kp, g));
  std::uniform_real_distribution<float> unit(0.5f, 1.5f);
  if (f == QuantFormat::kInt8W8A8) {
    std::uniform_int_distribution<int> w(-128, 127);
    for (int64_t i = 0; i < 64 * Kp; ++i) b[i] = uint8_t(w(rng));
    float* scale = reinterpret_cast<float*>(b.data() + 64 * Kp);
    for (int n = 0; n < 64; ++n) scale[n] = n == 63 ? 0.0f : unit(rng) * 0.02f / std::sqrt(float(Kp));
    // colsum: unused by signed tiles, filled anyway
    int32_t* colsum = reinterpret_cast<int32_t*>(b.data() + 64 * Kp + 256);
    for (int n = 0; n < 64; ++n) {
      colsum[n] = 0;
      for (int64_t k = 0; k < Kp; ++k) colsum[n] += int8_t(b[(k / 4 * 64 + n) * 4 + k % 4]);
    }
  } else if (f == QuantFormat::kMxfp4W4A16) {
    std::uniform_int_distribution<int> code(0, 255), exponent(118, 126);
    for (int64_t i = 0; i < 32 * Kp; ++i) b[i] = uint8_t(code(rng));
    for (int64_t i = 0; i < 2 * Kp; ++i) b[32 * Kp + i] = i % 64 == 63 ? 0 : uint8_t(exponent(rng));
  } else {
    std::uniform_int_distribution<int> code(0, 255);
    for (int64_t i = 0; i < 32 * Kp; ++i) b[i] = uint8_t(code(rng));
    std::uniform_real_distribution<float> zero(0.0f, 15.0f);
    for (int64_t G = 0; G < Kp / g; ++G) {
      float* scale = reinterpret_cast<float*>(b.data() + 32 * Kp + 512 * G);
      const bool symmetric = G % 2 == 0;  // zero 8, else an arbitrary float zero point
      for (int n = 0; n < 64; ++n) {
        scale[n] = n == 63 ? 0.0f : unit(rng) * 0.3f / std::sqrt(float(Kp));
        scale[64 + n] = symmetric ? 8.0f : zero(rng);
      }
    }
  }
  return b;
}

// Scalar reading of quant.h: row r's dot with column n, before bias (float64).
double ref_dot(QuantFormat f, const uint8_t* block, const void* row, int64_t Kp, int64_t g, int n) {
  const int8_t* a = static_cast<const int8_t*>(row);
  float sa;
  std::memcpy(&sa, static_cast<const uint8_t*>(row) + Kp, 4);
  if (f == QuantFormat::kInt8W8A8) {
    int64_t acc = 0;
    for (int64_t k = 0; k < Kp; ++k) acc += int64_t(a[k]) * int8_t(block[(k / 4 * 64 + n) * 4 + k % 4]);
    const float* scale = reinterpret_cast<const float*>(block + 64 * Kp);
    return double(sa) * scale[n] * double(acc);
  }
  double y = 0.0;
  for (int64_t G = 0; G < Kp / g; ++G) {
    int64_t acc = 0, sum = 0;
    double mx = 0.0;
    for (int64_t k = G * g; k < (G + 1) * g; ++k) {
      const int64_t s = k / 8, kk = k % 8;
      const uint8_t byte = block[s * 256 + (n / 16) * 64 + (n % 16) * 4 + kk % 4];
      const int q = kk < 4 ? byte & 0xF : byte >> 4;
      acc += int64_t(a[k]) * q;
      sum += a[k];
      mx += double(a[k]) * kE2m1[q];
    }
    if (f == QuantFormat::kMxfp4W4A16) {
      const int e = block[32 * Kp + 64 * G + n];
      y += e ? std::ldexp(mx, e - 127) : 0.0;
      continue;
    }
    const float* scale = reinterpret_cast<const float*>(block + 32 * Kp + 512 * G);
    y += double(scale[n]) * (double(acc) - double(scale[64 + n]) * double(sum));
  }
  return double(sa) * y;
}

double ref_act(Activation act, double gate, double up) {
  switch (act) {
    case Activation::kSilu: return gate / (1.0 + std::exp(-gate)) * up;
    case Activation::kGelu: return 0.5 * gate * (1.0 + std::erf(gate / std::sqrt(2.0))) * up;
    case Activation::kGeluTanh:
      return 0.5 * gate * (1.0 + std::tanh(0.79788456080286536 * (gate + 0.044715 * gate * gate * gate))) * up;
    default: {
      gate = std::fmin(gate, kSwigluOaiLimit);
      up = std::fmax(std::fmin(up, kSwigluOaiLimit), -kSwigluOaiLimit);
      return gate / (1.0 + std::exp(-kSwigluOaiAlpha * gate)) * (up + 1.0);
    }
  }
}

struct Result {
  double max_err = 0.0;
  int failures = 0;
  std::string first_failure;
};

void check(Result& res, double tol, const std::string& what, const Guarded<float>& out, int rows,
           int64_t stride, int cols, const std::vector<double>& ref) {
  double scale = 1e-30, err = 0.0;
  for (double v : ref) scale = std::fmax(scale, std::fabs(v));
  bool sentinel_ok = true;
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < stride; ++c) {
      const float v = out[r * stride + c];
      if (c < cols) err = std::fmax(err, std::isfinite(v) ? std::fabs(v - ref[r * cols + c]) / scale : 1e30);
      else if (v != kSentinel) sentinel_ok = false;
    }
  std::string outside;
  try {
    out.check(what);
  } catch (const std::runtime_error& e) {
    outside = std::string(" (") + e.what() + ")";
  }
  res.max_err = std::fmax(res.max_err, err);
  if (err > tol || !sentinel_ok || !outside.empty()) {
    if (res.failures++ == 0)
      res.first_failure = what + (sentinel_ok ? "" : " (wrote past its columns)") + outside + ": error " +
                          std::to_string(err);
  }
}

const Activation kActs[] = {Activation::kSilu, Activation::kGelu, Activation::kGeluTanh, Activation::kSwigluOai};

// Every row count, activation, bias / row_scale combination for one block shape.
void run_shape(Result& res, double tol, std::mt19937& rng, const char* backend, const QuantKernel& qk, QuantFormat f,
               int64_t Kp, int64_t g) {
  const std::vector<uint8_t> block = make_block(rng, f, Kp, g);
  std::vector<float> bias(64), row_scale(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : bias) v = normal(rng);
  for (float& v : row_scale) v = 0.5f + std::fabs(normal(rng));
  for (int rows = 1; rows <= 9; ++rows) {
    const Rows a = make_rows(rng, rows, Kp);
    std::vector<double> dot(rows * 64);
    for (int r = 0; r < rows; ++r)
      for (int n = 0; n < 64; ++n) dot[r * 64 + n] = ref_dot(f, block.data(), a.ptrs[r], Kp, g, n);
    GemmTile t{};
    t.a_rows = a.ptrs.data();
    t.rows = rows;
    t.k = Kp;
    t.b = block.data();
    t.dtype = DType::kFloat32;
    t.group = g;
    const std::string base = std::string(backend) + " " + quant_format_name(f) + " Kp=" + std::to_string(Kp) +
                             " g=" + std::to_string(g) + " rows=" + std::to_string(rows);
    for (Activation act : kActs)
      for (bool with_bias : {false, true}) {
        t.act = act;
        t.bias = with_bias ? bias.data() : nullptr;
        t.out_stride = 40;
        Guarded<float> out(rows * t.out_stride, kSentinel, kSentinel);
        std::vector<double> ref(rows * 32);
        t.out = out.data();
        qk.w13_tile(t);
        for (int r = 0; r < rows; ++r)
          for (int n = 0; n < 32; ++n) {
            const double b0 = with_bias ? bias[n] : 0.0, b1 = with_bias ? bias[32 + n] : 0.0;
            ref[r * 32 + n] = ref_act(act, dot[r * 64 + n] + b0, dot[r * 64 + 32 + n] + b1);
          }
        check(res, tol, base + " w13 act=" + std::to_string(int(act)) + (with_bias ? " bias" : ""), out, rows,
              t.out_stride, 32, ref);
      }
    for (int cols : {64, 37})
      for (bool with_bias : {false, true})
        for (bool with_scale : {false, true}) {
          t.bias = with_bias ? bias.data() : nullptr;
          t.row_scale = with_scale ? row_scale.data() : nullptr;
          t.out_cols = cols;
          t.out_stride = 72;
          Guarded<float> out(rows * t.out_stride, kSentinel, kSentinel);
          std::vector<double> ref(rows * cols);
          t.out = out.data();
          qk.w2_tile(t);
          for (int r = 0; r < rows; ++r)
            for (int n = 0; n < cols; ++n)
              ref[r * cols + n] = (dot[r * 64 + n] + (with_bias ? bias[n] : 0.0)) * (with_scale ? row_scale[r] : 1.0);
          check(res, tol, base + " w2 cols=" + std::to_string(cols) + (with_bias ? " bias" : "") +
                              (with_scale ? " row_scale" : ""),
                out, rows, t.out_stride, cols, ref);
        }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const double tol = argc > 1 ? std::atof(argv[1]) : 1e-5;
  struct Backend {
    const char* name;
    const QuantKernel* (*quant)(QuantFormat);
    const char* feature;
  };
  const Backend backends[] = {{"arm-i8mm", quant_arm_i8mm, "i8mm"},
                             {"arm-dotprod", quant_arm_dotprod, "asimddp"},
                             {"generic", [](QuantFormat f) { return &quant_generic(f); }, nullptr}};
  std::mt19937 rng(20240601);
  int failures = 0;
  for (const Backend& p : backends) {
    if (p.feature && !cpu_has(p.feature)) {
      std::printf("%s: skipped, CPU lacks %s\n", p.name, p.feature);
      continue;
    }
    for (QuantFormat f : {QuantFormat::kInt8W8A8, QuantFormat::kInt4W4A16, QuantFormat::kMxfp4W4A16}) {
      const QuantKernel* qk = p.quant(f);
      if (!qk) {
        std::printf("%s %s: no tiles\n", p.name, quant_format_name(f));
        ++failures;
        continue;
      }
      for (int64_t Kp : {32, 96, 2048}) {
        std::vector<int64_t> groups{f == QuantFormat::kMxfp4W4A16 ? kMxfp4Group : Kp};
        if (f == QuantFormat::kInt4W4A16)
          for (int64_t g : {32, 64, 128})
            if (g < Kp && Kp % g == 0) groups.insert(groups.begin(), g);
        for (int64_t g : groups) {
          Result res;
          run_shape(res, tol, rng, p.name, *qk, f, Kp, g);
          std::printf("%s %s Kp=%lld g=%lld: max error %.3g%s%s\n", p.name, quant_format_name(f), (long long)Kp,
                      (long long)g, res.max_err, res.failures ? ", FAILED: " : "", res.first_failure.c_str());
          failures += res.failures;
        }
      }
    }
  }
  std::printf("%s\n", failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
