#include "routing.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace cpumoe {
namespace {

constexpr int64_t kRowsPerItem = 16;

// NaN sorts above everything, as in torch.topk.
inline float selection_key(float v) { return std::isnan(v) ? INFINITY : v; }

void route_row(const RoutingArgs& a, int64_t t, std::vector<float>& logits, std::vector<float>& scores,
               std::vector<float>& best_key, std::vector<int32_t>& best_id) {
  const int64_t E = a.E, k = a.top_k;
  for (int64_t e = 0; e < E; ++e) logits[e] = load_as_f32(a.logits, t * E + e, a.dtype);
  if (a.sigmoid) {
    for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  } else {
    float top = -INFINITY;
    for (int64_t e = 0; e < E; ++e) top = std::fmax(top, logits[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += scores[e] = std::exp(logits[e] - top);
    for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
  }
  // Insertion into a sorted list of the best k: a later expert enters only above a strictly smaller key,
  // so equal keys keep the lower id first; the first k experts always enter, so every slot is filled.
  int64_t count = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float key = selection_key(a.bias ? scores[e] + a.bias[e] : logits[e]);
    if (count == k && !(key > best_key[k - 1])) continue;
    int64_t pos = count < k ? count++ : k - 1;
    while (pos > 0 && key > best_key[pos - 1]) {
      best_key[pos] = best_key[pos - 1];
      best_id[pos] = best_id[pos - 1];
      --pos;
    }
    best_key[pos] = key;
    best_id[pos] = int32_t(e);
  }
  float* w = a.weights + t * k;
  int32_t* ids = a.ids + t * k;
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = best_id[j];
    w[j] = scores[best_id[j]];
    total += w[j];
  }
  if (a.renormalize)
    for (int64_t j = 0; j < k; ++j) w[j] /= total + 1e-20f;
  if (a.scale != 1.0f)
    for (int64_t j = 0; j < k; ++j) w[j] *= a.scale;
}

}  // namespace

void route(const RoutingArgs& a, const Parallel& parallel) {
  parallel_items(parallel, (a.M + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
    std::vector<float> logits(a.E), scores(a.E), best_key(a.top_k);
    std::vector<int32_t> best_id(a.top_k);
    for (int64_t t = item * kRowsPerItem; t < std::min(a.M, (item + 1) * kRowsPerItem); ++t)
      route_row(a, t, logits, scores, best_key, best_id);
  });
}

}  // namespace cpumoe
