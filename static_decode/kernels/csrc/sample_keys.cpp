// The thresholds of top-k and top-p sampling without a sort (static_decode/steps/sampling.py, `_kept`): per row, the
// largest order key b with fewer than k keys below it (top-k), or with less than p of the probability below it
// (top-p). The Python bisection computes the same thresholds in 31 full-vocabulary passes each; here one pass over
// the row fills a histogram of the keys' top 12 bits (4,096 bins: a count and a mass each), and two more over the
// keys of the bin where the threshold falls (bits 7..18, then 0..6) end at the key itself.
//
// Keys are the bit patterns of |scaled logit| as int32 (0 .. 0x7F800000 = +inf, so they order as the values do);
// a NaN's pattern lies above +inf and is never below any threshold, as in the bisection, whose range ends there.
// Masses are summed in float64 here (the bisection's are torch's float32 sums), so the two can part only where a
// prefix of the probabilities sums to p within float32 rounding. Built on first use by static_decode/cpu_kernel.py.
#include <torch/library.h>

#include "checks.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int32_t kTop = 0x7F800000;  // +inf's pattern: the bisection's largest answer (its range ends one past it)
constexpr int kLevels = 3;
constexpr int kShift[kLevels] = {19, 7, 0};    // each level's low bit
constexpr int kBins[kLevels] = {4096, 4096, 128};  // bits 19..30, 7..18, 0..6

// The largest key b <= kTop with below(b) < target, where below(b) is the count (probs null) or the mass of the
// row's valid keys < b; `target` > 0 (below(0) = 0 < target). That is the smallest key u whose running total (the
// keys <= u) reaches the target. Level by level, the first bin whose keys bring the running total to the target holds
// u; the last level's bins are single keys. At the first level no bin reaches it when all valid keys together stay
// below the target: then kTop. (A deeper level sums its bin's keys in another order: where rounding keeps its running
// total a hair below the target, u is in its last non-empty bin.)
int32_t threshold(const int32_t* keys, const float* probs, int64_t V, double target) {
  std::vector<int64_t> members;  // the keys of the bin the answer is in (after the first level)
  std::vector<double> total;
  std::vector<char> filled;
  double before = 0.0;  // the count or mass of the valid keys below the current bin
  int32_t prefix = 0;   // the answer's bits found so far
  const auto valid = [&](int64_t v) { return keys[v] >= 0 && keys[v] <= kTop; };
  for (int level = 0; level < kLevels; ++level) {
    const int shift = kShift[level], bins = kBins[level];
    total.assign(bins, 0.0);
    filled.assign(bins, 0);
    const auto add = [&](int64_t v) {
      const int j = (keys[v] >> shift) & (bins - 1);
      total[j] += probs == nullptr ? 1.0 : static_cast<double>(probs[v]);
      filled[j] = 1;
    };
    if (level == 0) {
      for (int64_t v = 0; v < V; ++v)
        if (valid(v)) add(v);
    } else {
      for (const int64_t v : members) add(v);
    }
    int bin = -1, last = -1;
    for (int j = 0; j < bins && bin < 0; ++j) {
      if (!filled[j]) continue;
      last = j;
      if (!(before + total[j] < target)) bin = j;  // where below(key + 1) < target fails (a NaN mass fails it)
      else before += total[j];
    }
    if (bin < 0) {
      if (level == 0 || last < 0) return kTop;
      bin = last;
    }
    prefix |= bin << shift;
    if (level + 1 == kLevels) break;
    std::vector<int64_t> next;
    const auto keep = [&](int64_t v) {
      if (((keys[v] >> shift) & (bins - 1)) == bin) next.push_back(v);
    };
    if (level == 0) {
      for (int64_t v = 0; v < V; ++v)
        if (valid(v)) keep(v);
    } else {
      for (const int64_t v : members) keep(v);
    }
    members.swap(next);
  }
  return prefix;
}

void check_keys(const at::Tensor& keys, const at::Tensor& per_row, at::ScalarType row_dtype, const char* op,
                const char* name) {
  static_decode_kernels::check_cpu(keys, op, "keys");
  static_decode_kernels::check_cpu(per_row, op, name);
  TORCH_CHECK(keys.scalar_type() == at::kInt && keys.dim() == 2 && keys.is_contiguous() && keys.size(1) > 0, op,
              ": keys must be contiguous int32 [B, V] with V > 0, got ", keys.scalar_type(), " ", keys.sizes());
  TORCH_CHECK(per_row.scalar_type() == row_dtype && per_row.dim() == 1 && per_row.size(0) == keys.size(0), op, ": ",
              name, " must be ", row_dtype, " [", keys.size(0), "] (one a row of keys ", keys.sizes(), "), got ",
              per_row.scalar_type(), " ", per_row.sizes());
}

// keys [B, V] int32, k [B] int64 -> [B] int32: the k-th smallest valid key of each row (kTop when a row has fewer
// than k; 0 where k <= 0, the bisection's answer for a row without top-k).
at::Tensor top_k_key(const at::Tensor& keys, const at::Tensor& k) {
  check_keys(keys, k, at::kLong, "top_k_key", "k");
  const int64_t B = keys.size(0), V = keys.size(1);
  auto out = at::empty({B}, keys.options());
  const auto kc = k.contiguous();
  const int32_t* kp = keys.data_ptr<int32_t>();
  const int64_t* want = kc.data_ptr<int64_t>();
  int32_t* o = out.data_ptr<int32_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      o[b] = want[b] <= 0 ? 0 : threshold(kp + b * V, nullptr, V, static_cast<double>(want[b]));
  });
  return out;
}

// keys [B, V] int32, probs [B, V] float32, p [B] float32 -> [B] int32: the largest key b with less than p[b] of the
// row's probability on keys below b (kTop when the whole row stays below p, and where p >= 1: top-p is off there;
// 0 where p <= 0 or is NaN).
at::Tensor top_p_key(const at::Tensor& keys, const at::Tensor& probs, const at::Tensor& p) {
  check_keys(keys, p, at::kFloat, "top_p_key", "p");
  static_decode_kernels::check_cpu(probs, "top_p_key", "probs");
  TORCH_CHECK(probs.scalar_type() == at::kFloat && probs.sizes() == keys.sizes() && probs.is_contiguous(),
              "top_p_key: probs must be contiguous float32 ", keys.sizes(), " as the keys, got ", probs.scalar_type(),
              " ", probs.sizes());
  const int64_t B = keys.size(0), V = keys.size(1);
  auto out = at::empty({B}, keys.options());
  const auto pc = p.contiguous();
  const int32_t* kp = keys.data_ptr<int32_t>();
  const float* pp = probs.data_ptr<float>();
  const float* want = pc.data_ptr<float>();
  int32_t* o = out.data_ptr<int32_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      o[b] = !(want[b] > 0.f) ? 0 : want[b] >= 1.f ? kTop : threshold(kp + b * V, pp + b * V, V, want[b]);
  });
  return out;
}

at::Tensor top_k_key_meta(const at::Tensor& keys, const at::Tensor& k) {
  return at::empty({keys.size(0)}, keys.options());
}

at::Tensor top_p_key_meta(const at::Tensor& keys, const at::Tensor& probs, const at::Tensor& p) {
  return at::empty({keys.size(0)}, keys.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(static_decode_cpu, m) {
  m.def("top_k_key(Tensor keys, Tensor k) -> Tensor");
  m.def("top_p_key(Tensor keys, Tensor probs, Tensor p) -> Tensor");
}
TORCH_LIBRARY_IMPL(static_decode_cpu, CPU, m) {
  m.impl("top_k_key", &top_k_key);
  m.impl("top_p_key", &top_p_key);
}
TORCH_LIBRARY_IMPL(static_decode_cpu, Meta, m) {
  m.impl("top_k_key", &top_k_key_meta);
  m.impl("top_p_key", &top_p_key_meta);
}
