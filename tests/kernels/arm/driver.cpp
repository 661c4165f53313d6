// Runs cpumoe::fused_moe without PyTorch, so the Arm kernel backends can be tested under qemu-aarch64
// (tests/kernels/arm/test_arm_qemu.py builds it statically with the cross compiler).
//
//   driver                prints the CPU features, every kernel backend with whether it can run here, and the
//                         tiles (dense, quantized formats) of each that can
//   driver CASE_DIR...    the same, then runs each case: reads CASE_DIR/meta.txt and the arrays beside it,
//                         packs the weights for the case's kernel backend, writes CASE_DIR/out.bin
//
// meta.txt has one "key value" per line: kernel (a backend name), dtype (float32, bfloat16, float16),
// activation (silu, gelu, gelu_tanh, swigluoai), M, H, I, E (experts in the weights), topk,
// global_experts (range of topk_ids), and 0/1 flags w13_bias, w2_bias, expert_map, router_weight_on_input.
// Arrays are raw little-endian, row-major:
//   hidden.bin [M][H] dtype, w13.bin [E][2I][H] dtype (gate rows then up rows), w2.bin [E][H][I] dtype,
//   topk_weights.bin [M][topk] f32, topk_ids.bin [M][topk] i32, expert_map.bin [global_experts] i32,
//   w13_bias.bin [E][2I] f32, w2_bias.bin [E][H] f32 (unpacked: reordered here as cpumoe/ops.py does)
//   -> out.bin [M][H] dtype
// Attention cases (op attention) take dtype, S, nh, nkv, d, dv, n, block_size, blocks, scale, sinks and q.bin
// [S][nh][d], k_cache.bin [blocks][block_size][nkv][d], v_cache.bin [..][nkv][dv] (dtype), block_table.bin [S][n],
// key_begin.bin, key_end.bin [S] (int64), sinks.bin [nh] f32 -> out.bin [S][nh][dv] dtype.
// Greedy cases (op greedy) take rows, vocab and logits.bin [rows][vocab] f32 -> out.bin [rows] int64 (greedy.h).
// Quantized cases add quant (int8_w8a8, int4_w4a16, ...: a format name) and group13, group2 (int4 group of
// w13 and w2; 0 = a whole row), and replace w13.bin / w2.bin with the canonical cpumoe.quant.QuantizedWeight
// tensors, packed here with quant_pack (as cpumoe/ops.py pack_quant does) and run on the backend's tiles:
//   w13_codes.bin [E][2I][H] and w2_codes.bin [E][H][I] (one byte per code), w13_scales.bin, w2_scales.bin
//   (f32 [E][N], int8, or [E][N][K/g]), and for asymmetric int4 (flag zeros) w13_zeros.bin, w2_zeros.bin
//   (u8, the scales' shape).
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/attention.h"
#include "core/cpu_features.h"
#include "core/fused_moe.h"
#include "core/greedy.h"
#include "core/pack.h"
#include "core/quant_pack.h"
#include "guarded.h"

namespace {

using namespace cpumoe;

Parallel two_threads() {
  Parallel p;
  p.workers = 2;
  p.run = [](int n, const std::function<void(int)>& body) {
    std::vector<std::thread> threads;
    for (int w = 1; w < n; ++w) threads.emplace_back(body, w);
    body(0);
    for (std::thread& t : threads) t.join();
  };
  return p;
}

class Meta {
 public:
  explicit Meta(const std::string& path) {
    std::ifstream f(path);
    if (!f) throw std::runtime_error("cannot open " + path);
    std::string key, value;
    while (f >> key >> value) values_[key] = value;
  }
  const std::string& str(const std::string& key) const {
    auto it = values_.find(key);
    if (it == values_.end()) throw std::runtime_error("meta.txt lacks '" + key + "'");
    return it->second;
  }
  int64_t num(const std::string& key) const { return std::stoll(str(key)); }
  bool has(const std::string& key) const { return values_.count(key) != 0; }
  bool flag(const std::string& key) const { return num(key) != 0; }

 private:
  std::map<std::string, std::string> values_;
};

std::vector<char> read_array(const std::string& path, int64_t bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::vector<char> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (int64_t(data.size()) != bytes)
    throw std::runtime_error(path + " holds " + std::to_string(data.size()) + " bytes, expected " +
                             std::to_string(bytes));
  return data;
}

DType parse_dtype(const std::string& s) {
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
    if (s == dtype_name(d)) return d;
  throw std::runtime_error("unknown dtype '" + s + "'");
}

Activation parse_activation(const std::string& s) {
  if (s == "silu") return Activation::kSilu;
  if (s == "gelu") return Activation::kGelu;
  if (s == "gelu_tanh") return Activation::kGeluTanh;
  if (s == "swigluoai") return Activation::kSwigluOai;
  throw std::runtime_error("unknown activation '" + s + "'");
}

// [E][2I] -> [E][Ip/32][32 gate, 32 up], zero-padded (cpumoe/ops.py pack_w13_bias).
std::vector<float> pack_w13_bias(const float* bias, int64_t E, int64_t I) {
  const int64_t blocks = round_up(I, kW13BlockInter) / kW13BlockInter;
  std::vector<float> out(E * blocks * kBlockCols, 0.0f);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < I; ++i) {
      float* block = out.data() + (e * blocks + i / kW13BlockInter) * kBlockCols;
      block[i % kW13BlockInter] = bias[e * 2 * I + i];
      block[kW13BlockInter + i % kW13BlockInter] = bias[e * 2 * I + I + i];
    }
  return out;
}

// [E][H] -> [E][Hp], zero-padded (cpumoe/ops.py pack_w2_bias).
std::vector<float> pack_w2_bias(const float* bias, int64_t E, int64_t H) {
  const int64_t Hp = round_up(H, kBlockCols);
  std::vector<float> out(E * Hp, 0.0f);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h) out[e * Hp + h] = bias[e * H + h];
  return out;
}

QuantFormat parse_format(const std::string& s) {
  for (int f = 0; f < kNumQuantFormats; ++f)
    if (s == quant_format_name(QuantFormat(f))) return QuantFormat(f);
  throw std::runtime_error("unknown quantized format '" + s + "'");
}

// One canonical quantized stack [E][N][K] read from PREFIX_{codes,scales,zeros}.bin and packed into quant.h
// blocks; returns the packed shape (its group is the tiles').
QuantPackedShape read_and_pack_quant(const std::string& dir, const char* prefix, QuantFormat f, int64_t E,
                                     int64_t N, int64_t K, int64_t group, bool zeros, bool w13,
                                     std::vector<uint8_t>& packed) {
  auto path = [&](const char* name) { return dir + "/" + prefix + "_" + name + ".bin"; };
  int64_t cols = 1, scale_bytes = 4;
  if (f == QuantFormat::kInt4W4A16) cols = group == 0 ? 1 : K / group;
  else if (f == QuantFormat::kFp8W8A16) cols = group == 0 ? 1 : (K + group - 1) / group;
  else if (f == QuantFormat::kMxfp4W4A16) cols = K / kMxfp4Group, scale_bytes = 1;
  const std::vector<char> codes = read_array(path("codes"), E * N * K);
  const std::vector<char> scales = read_array(path("scales"), E * N * cols * scale_bytes);
  std::vector<char> zero_points;
  if (zeros) zero_points = read_array(path("zeros"), E * N * cols);
  QuantSource src;
  src.format = f;
  src.codes = reinterpret_cast<const uint8_t*>(codes.data());
  src.scales = scales.data();
  src.zeros = zeros ? reinterpret_cast<const uint8_t*>(zero_points.data()) : nullptr;
  src.N = N, src.K = K, src.group = group;
  const QuantPackedShape shape = quant_packed_shape(f, N, K, group, w13, packs_symmetric(src));
  packed.assign(E * shape.blocks * shape.block_bytes, 0);
  pack_quant(src, w13, packed.data(), 0, E);
  return shape;
}

// An output with guard bytes around it (guarded.h), filled with a value no kernel writes by chance.
Guarded<char> new_output(int64_t bytes) { return Guarded<char>(bytes, char(0x7f), char(0xa5)); }

// Checks the guard bytes around `out`, then writes it.
void write_out(const std::string& path, const Guarded<char>& out, const std::string& what) {
  out.check(what);
  std::ofstream f(path, std::ios::binary);
  f.write(out.data(), std::streamsize(out.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

// An "op attention" case: decode attention on the backend that runs it here (attention_kernel), printed as
// "attention BACKEND".
void run_attention(const std::string& dir, const Meta& meta, const Parallel& parallel) {
  auto path = [&](const char* name) { return dir + "/" + name; };
  DecodeAttentionArgs a;
  a.dtype = parse_dtype(meta.str("dtype"));
  a.S = meta.num("S"), a.nh = meta.num("nh"), a.nkv = meta.num("nkv"), a.d = meta.num("d"), a.dv = meta.num("dv");
  a.n = meta.num("n"), a.block_size = meta.num("block_size");
  a.scale = std::stof(meta.str("scale"));
  const int64_t blocks = meta.num("blocks"), es = dtype_size(a.dtype);
  const std::vector<char> q = read_array(path("q.bin"), a.S * a.nh * a.d * es);
  const std::vector<char> k_cache = read_array(path("k_cache.bin"), blocks * a.block_size * a.nkv * a.d * es);
  const std::vector<char> v_cache = read_array(path("v_cache.bin"), blocks * a.block_size * a.nkv * a.dv * es);
  const std::vector<char> table = read_array(path("block_table.bin"), a.S * a.n * 8);
  const std::vector<char> begin = read_array(path("key_begin.bin"), a.S * 8);
  const std::vector<char> end = read_array(path("key_end.bin"), a.S * 8);
  std::vector<char> sinks;
  if (meta.flag("sinks")) sinks = read_array(path("sinks.bin"), a.nh * 4);
  a.q = q.data(), a.k_cache = k_cache.data(), a.v_cache = v_cache.data();
  a.block_table = reinterpret_cast<const int64_t*>(table.data());
  a.key_begin = reinterpret_cast<const int64_t*>(begin.data());
  a.key_end = reinterpret_cast<const int64_t*>(end.data());
  a.sinks = sinks.empty() ? nullptr : reinterpret_cast<const float*>(sinks.data());
  Guarded<char> out = new_output(a.S * a.nh * a.dv * es);
  a.out = out.data();
  std::string name;
  const KernelTable& kernel = attention_kernel(&name);
  std::printf("attention %s\n", name.c_str());
  decode_attention(a, kernel, parallel);
  write_out(path("out.bin"), out, "decode_attention on " + name);
}

// An "op greedy" case: greedy_tokens over logits.bin [rows][vocab] f32 -> out.bin [rows] int64.
void run_greedy(const std::string& dir, const Meta& meta, const Parallel& parallel) {
  const int64_t rows = meta.num("rows"), vocab = meta.num("vocab");
  const std::vector<char> logits = read_array(dir + "/logits.bin", rows * vocab * 4);
  Guarded<char> out = new_output(rows * 8);
  greedy_tokens(reinterpret_cast<const float*>(logits.data()), rows, vocab, reinterpret_cast<int64_t*>(out.data()),
                parallel);
  write_out(dir + "/out.bin", out, "greedy_tokens");
}

void run_case(const std::string& dir, const Parallel& parallel) {
  const Meta meta(dir + "/meta.txt");
  if (meta.has("op") && meta.str("op") == "attention") return run_attention(dir, meta, parallel);
  if (meta.has("op") && meta.str("op") == "greedy") return run_greedy(dir, meta, parallel);
  const DType dtype = parse_dtype(meta.str("dtype"));
  const int64_t M = meta.num("M"), H = meta.num("H"), I = meta.num("I"), E = meta.num("E"), K = meta.num("topk");
  const int64_t G = meta.num("global_experts"), es = dtype_size(dtype);
  auto path = [&](const char* name) { return dir + "/" + name; };

  const std::vector<char> hidden = read_array(path("hidden.bin"), M * H * es);
  const std::vector<char> topk_weights = read_array(path("topk_weights.bin"), M * K * 4);
  const std::vector<char> topk_ids = read_array(path("topk_ids.bin"), M * K * 4);

  FusedMoeArgs a;
  std::string why;
  std::vector<char> w13_packed, w2_packed;
  std::vector<uint8_t> w13_quant, w2_quant;
  if (meta.has("quant")) {
    const QuantFormat f = parse_format(meta.str("quant"));
    a.quant = find_quant_kernel(meta.str("kernel"), f, &why);
    if (!a.quant)
      throw std::runtime_error("kernel backend '" + meta.str("kernel") + "' cannot run " + quant_format_name(f) + ": " + why);
    a.format = f;
    const bool zeros = meta.flag("zeros");
    const QuantPackedShape s13 =
        read_and_pack_quant(dir, "w13", f, E, 2 * I, H, meta.num("group13"), zeros, true, w13_quant);
    const QuantPackedShape s2 = read_and_pack_quant(dir, "w2", f, E, H, I, meta.num("group2"), zeros, false, w2_quant);
    a.group13 = s13.group;
    a.group2 = s2.group;
    a.symmetric13 = a.symmetric2 = f == QuantFormat::kInt4W4A16 && !zeros;  // packed without zero points
    a.I = s13.blocks * kW13BlockInter;  // the packed intermediate size
    a.w13 = w13_quant.data();
    a.w2 = w2_quant.data();
  } else {
    const KernelTable* kt = find_kernel(meta.str("kernel"), &why);
    if (!kt) throw std::runtime_error("kernel backend '" + meta.str("kernel") + "' cannot run here: " + why);
    if (!kt->supports(dtype)) throw std::runtime_error(std::string(kt->name) + " does not take " + dtype_name(dtype));
    const std::vector<char> w13 = read_array(path("w13.bin"), E * 2 * I * H * es);
    const std::vector<char> w2 = read_array(path("w2.bin"), E * H * I * es);
    const PackedShape s13 = w13_packed_shape(H, I, kt->layout), s2 = w2_packed_shape(H, I, kt->layout);
    w13_packed.resize(E * s13.expert_elems() * es);
    w2_packed.resize(E * s2.expert_elems() * es);
    pack_w13(w13.data(), w13_packed.data(), H, I, dtype, kt->layout, 0, E);
    pack_w2(w2.data(), w2_packed.data(), H, I, dtype, kt->layout, 0, E);
    a.kernels = kt;
    a.I = I;
    a.w13 = w13_packed.data();
    a.w2 = w2_packed.data();
  }
  a.dtype = dtype;
  a.act = parse_activation(meta.str("activation"));
  a.M = M, a.H = H, a.topk = K;
  a.local_experts = E;
  a.global_experts = G;
  a.hidden = hidden.data();
  a.topk_weights = reinterpret_cast<const float*>(topk_weights.data());
  a.topk_ids = reinterpret_cast<const int32_t*>(topk_ids.data());
  a.apply_router_weight_on_input = meta.flag("router_weight_on_input");

  std::vector<char> expert_map, w13_bias, w2_bias;
  std::vector<float> w13_bias_packed, w2_bias_packed;
  if (meta.flag("expert_map")) {
    expert_map = read_array(path("expert_map.bin"), G * 4);
    a.expert_map = reinterpret_cast<const int32_t*>(expert_map.data());
  }
  if (meta.flag("w13_bias")) {
    w13_bias = read_array(path("w13_bias.bin"), E * 2 * I * 4);
    w13_bias_packed = pack_w13_bias(reinterpret_cast<const float*>(w13_bias.data()), E, I);
    a.w13_bias = w13_bias_packed.data();
  }
  if (meta.flag("w2_bias")) {
    w2_bias = read_array(path("w2_bias.bin"), E * H * 4);
    w2_bias_packed = pack_w2_bias(reinterpret_cast<const float*>(w2_bias.data()), E, H);
    a.w2_bias = w2_bias_packed.data();
  }

  Guarded<char> out = new_output(M * H * es);
  a.out = out.data();
  fused_moe(a, parallel);
  write_out(path("out.bin"), out, "fused_moe on " + meta.str("kernel"));
}

}  // namespace

int main(int argc, char** argv) {
  std::printf("features:");
  for (const std::string& f : cpumoe::cpu_features()) std::printf(" %s", f.c_str());
  std::printf("\n");
  for (const cpumoe::KernelInfo& k : cpumoe::kernel_backends()) {
    std::printf("backend %s: %s\n", k.name.c_str(), k.unavailable.empty() ? "available" : ("unavailable, " + k.unavailable).c_str());
    if (!k.unavailable.empty()) continue;
    std::printf("tiles %s:%s", k.name.c_str(), k.table ? " dense" : "");
    for (int f = 0; f < cpumoe::kNumQuantFormats; ++f)
      if (k.quant[f]) std::printf(" %s", cpumoe::quant_format_name(cpumoe::QuantFormat(f)));
    std::printf("\n");
  }

  const cpumoe::Parallel parallel = two_threads();
  for (int i = 1; i < argc; ++i) {
    try {
      run_case(argv[i], parallel);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: %s\n", argv[i], e.what());
      return 1;
    }
  }
  return 0;
}
