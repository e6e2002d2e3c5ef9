// A batch-1 decode step's decoder layers in one call: for each layer, RMSNorm, q/k/v, the rotary embedding, the
// cache write, attention, o_proj and the residual, RMSNorm, gate/up/SiLU, down_proj and the residual.
// Built with the other kernels by static_decode/cpu_kernel.py; called by capture.regions in place of a compiled
// region for one-token, one-row steps (static_decode/fused_decode.py says when).
//
// Why: the products of a batch-1 decode step already run at the memory's rate (gemv_bf16.cpp), but each of a
// layer's ~15 kernels is a call from the step's compiled code, with its dispatch, allocation and glue, ~55 us a
// layer on the 2-vCPU machine: ~1.7 ms of SmolLM2's ~12.6 ms bfloat16 step (profiles/RESULTS.md, "Fixed cost
// around the kernels"). Here a layer is five parallel loops (q/k/v, attention, o, gate/up, down) and a few serial
// passes over one row of the hidden width, with no allocation but the attention's.
//
// The same math as the unfused eager layer, rounded where it rounds: each product's float32 sum rounded to the
// model's dtype, the norm's float32 result rounded before its weight, the rotary embedding's products and sums, the
// residual sums; SwiGLU's silu(gate) * up in float32 from the rounded products with at::vec's exp, rounded once
// (gemv_bf16_glu's). A bfloat16 model's layers come out as eager's, bit for bit in the tests (only the norm's sum
// of squares runs in another order than torch's mean, which can move a value by its last bit); float32 ones differ
// by the products' summation order (MKL's against ours), ~1e-7 relative.
//
// Sliding windows: `windows` holds one per layer (0: that layer attends every key; empty: none slides), passed to
// the attention, which then reads only the keys inside each layer's window.
#include <torch/library.h>

#include "checks.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kRows = 8;      // weight rows per inner step (gemv_bf16.cpp's)
constexpr int64_t kPerLayer = 9;  // weights per layer, in this order:
enum { kInNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown };
// A quantized model's layers also pass the scales of their 7 projections (decode_layers_q), in this order:
constexpr int64_t kQuantPerLayer = 7;
constexpr int kQuantIndex[kPerLayer] = {-1, 0, 1, 2, 3, -1, 4, 5, 6};  // weight index -> its scales' index

inline float hsum(const Vec& a) {
  alignas(64) float t[Vec::size()];
  a.store(t);
  float s = 0.f;
  for (int i = 0; i < Vec::size(); ++i) s += t[i];
  return s;
}

// Rows [n0, n1) of float32 W [N, K] times x [K] into y: 8 rows at once with the next 8 prefetched, float32 FMAs.
void f32_rows(const float* W, const float* x, int64_t K, int64_t n0, int64_t n1, float* y) {
  const int64_t body = K / Vec::size() * Vec::size();
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) {
    const float* w = W + n * K;
    Vec a[kRows];
    for (int r = 0; r < kRows; ++r) a[r] = Vec(0.f);
    for (int64_t k = 0; k < body; k += Vec::size()) {
      const Vec xv = Vec::loadu(x + k);
      for (int r = 0; r < kRows; ++r) {
        __builtin_prefetch(w + (r + kRows) * K + k);
        a[r] = at::vec::fmadd(Vec::loadu(w + r * K + k), xv, a[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      float s = hsum(a[r]);
      for (int64_t k = body; k < K; ++k) s += w[r * K + k] * x[k];
      y[n + r] = s;
    }
  }
  for (; n < n1; ++n) {
    const float* w = W + n * K;
    Vec a(0.f);
    for (int64_t k = 0; k < body; k += Vec::size()) a = at::vec::fmadd(Vec::loadu(w + k), Vec::loadu(x + k), a);
    float s = hsum(a);
    for (int64_t k = body; k < K; ++k) s += w[k] * x[k];
    y[n] = s;
  }
}

// One matrix of a parallel product: W [n, K] in the model's dtype (w), or a quantized weight (q; csrc/gemv_quant.cpp),
// float32 sums into y.
struct Product {
  const void* w;
  const static_decode_kernels::QuantMat* q;
  int64_t n;
  float* y;
};

// The products that read the same row x (q/k/v; gate/up; o; down) in one parallel loop over all their row blocks.
// x is the row in the weights' dtype (S); the sums are float32, not rounded. Quantized products read the row as
// `row` holds it, prepared here once for all of them.
template <typename S>
void products(const S* x, int64_t K, std::initializer_list<Product> mats, static_decode_kernels::QuantRow& row) {
  const Product& head = *mats.begin();
  if (head.q != nullptr) {  // a layer's products are all quantized or none
    const std::vector<float> xf(x, x + K);  // the row in float32 (each value converted on the copy)
    static_decode_kernels::prepare_row(xf.data(), K, head.q->group, static_decode_kernels::int4_bf16_path(*head.q),
                                       row, static_decode_kernels::int8_dot_path(*head.q));
  }
  std::vector<int64_t> first{0};  // first row block of each matrix, then the total
  for (const Product& p : mats) first.push_back(first.back() + (p.n + kRows - 1) / kRows);
  at::parallel_for(0, first.back(), 8, [&](int64_t b, int64_t e) {
    int64_t i = 0;
    for (const Product& p : mats) {
      const int64_t lo = std::max(b, first[i]), hi = std::min(e, first[i + 1]);
      ++i;
      if (lo >= hi) continue;
      const int64_t n0 = (lo - first[i - 1]) * kRows, n1 = std::min(p.n, (hi - first[i - 1]) * kRows);
      if (p.q != nullptr) {
        static_decode_kernels::quant_rows(*p.q, row, n0, n1, p.y);
      } else if constexpr (std::is_same_v<S, float>) {
        f32_rows(static_cast<const float*>(p.w), x, K, n0, n1, p.y);
      } else {
#if defined(__AVX512BF16__)
        static_decode_kernels::bf16_rows(static_cast<const uint16_t*>(p.w), reinterpret_cast<const uint16_t*>(x),
                                         K, n0, n1, p.y);
#else
        TORCH_CHECK(false, "decode_layers: bfloat16 weights need AVX512-BF16");
#endif
      }
    }
  });
}

template <typename S>
inline float rnd(float f) {  // a float32 value rounded to the model's dtype (what storing it in a tensor does)
  return static_cast<float>(static_cast<S>(f));
}

// RMSNorm of x [D] (float32 values of the model's dtype) into out [D] in the model's dtype: x / rms(x) in float32,
// rounded, times the weight, rounded (static_decode.model.RMSNorm).
template <typename S>
void rms_norm(const float* x, const S* weight, int64_t D, double eps, S* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
  for (int64_t i = 0; i < D; ++i) out[i] = static_cast<S>(static_cast<float>(weight[i]) * rnd<S>(x[i] * r));
}

// The rotary embedding of `heads` heads of d values (rounded products in y) in place, half-split pairing
// (static_decode.rope.apply): x1 * cos + (-x2) * sin, x2 * cos + x1 * sin, each product and the sum rounded to the
// model's dtype, as the eager ops round them.
template <typename S>
void rotate(float* y, int64_t heads, int64_t d, const S* cos, const S* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* p = y + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = p[i], x2 = p[i + half], c = static_cast<float>(cos[i]), s = static_cast<float>(sin[i]);
      p[i] = rnd<S>(rnd<S>(x1 * c) + rnd<S>(-x2 * s));
      p[i + half] = rnd<S>(rnd<S>(x2 * c) + rnd<S>(x1 * s));
    }
  }
}

template <typename S>
at::Tensor layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k, at::Tensor& v,
                  const at::Tensor& lens, const at::Tensor& n_new, const at::Tensor& lens_after, int64_t read_len,
                  at::TensorList w, const std::vector<static_decode_kernels::QuantMat>& quant, double eps,
                  at::IntArrayRef windows) {
  const int64_t L = k.size(0), Hkv = k.size(2), d = k.size(4), D = x.size(-1);
  const int64_t Nq = w[kQ].size(0), Nkv = w[kK].size(0), inner = w[kGate].size(0), Hq = Nq / d, G = Hq / Hkv;
  const int64_t max_len = k.size(3) - 1;  // the spare row past max_len takes a padded slot (cache.SPARE_ROWS)
  const int64_t n = n_new.data_ptr<int64_t>()[0];
  const int64_t pos = n > 0 ? lens.data_ptr<int64_t>()[0] : max_len;  // the old length (rule 3)
  const S* cs = cos.data_ptr<S>();
  const S* sn = sin.data_ptr<S>();
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));

  std::vector<float> xs(D), qkv(Nq + 2 * Nkv), o(D), gu(2 * inner);
  std::vector<S> h(std::max(D, inner));
  const S* xin = x.data_ptr<S>();
  for (int64_t i = 0; i < D; ++i) xs[i] = static_cast<float>(xin[i]);
  static_decode_kernels::QuantRow row;  // the row the quantized products read, reused by every product
  auto q = at::empty({1, Hkv, G, d}, x.options());  // the queries in the model's dtype, as the unfused layer has them
  S* qp = q.data_ptr<S>();

  for (int64_t l = 0; l < L; ++l) {
    // One profiler range per layer (torch.profiler, and Nsight/VTune through its ITT/NVTX observers): the op is
    // opaque otherwise. Free when no profiler is on (a flag test).
    RECORD_FUNCTION("static_decode::decode_layer", c10::ArrayRef<const c10::IValue>{});
    const at::Tensor* lw = w.data() + l * kPerLayer;
    const auto ptr = [&](int i) { return lw[i].data_ptr<S>(); };
    const auto mat = [&](int i, int64_t rows, float* y) {  // weight i's product: float, or its QuantMat
      return quant.empty() ? Product{ptr(i), nullptr, rows, y}
                           : Product{nullptr, &quant[l * kQuantPerLayer + kQuantIndex[i]], rows, y};
    };
    rms_norm<S>(xs.data(), ptr(kInNorm), D, eps, h.data());
    products<S>(h.data(), D, {mat(kQ, Nq, qkv.data()), mat(kK, Nkv, qkv.data() + Nq),
                              mat(kV, Nkv, qkv.data() + Nq + Nkv)}, row);
    for (float& f : qkv) f = rnd<S>(f);
    rotate<S>(qkv.data(), Hq + Hkv, d, cs, sn);  // q's heads then k's: adjacent
    for (int64_t i = 0; i < Nq; ++i) qp[i] = static_cast<S>(qkv[i]);  // head h = kv * G + g: [1, Hkv, G, d]
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "decode_layers_write", [&] {
      for (int64_t hh = 0; hh < Hkv; ++hh) {  // row 0, head hh, position pos: written in place (rule 1)
        scalar_t* kd = k.data_ptr<scalar_t>() + l * k.stride(0) + hh * k.stride(2) + pos * k.stride(3);
        scalar_t* vd = v.data_ptr<scalar_t>() + l * v.stride(0) + hh * v.stride(2) + pos * v.stride(3);
        for (int64_t i = 0; i < d; ++i) {
          kd[i] = static_cast<scalar_t>(static_cast<S>(qkv[Nq + hh * d + i]));
          vd[i] = static_cast<scalar_t>(static_cast<S>(qkv[Nq + Nkv + hh * d + i]));
        }
      }
    });
    const auto kl = k.select(0, l).slice(2, 0, read_len);  // [1, Hkv, read_len, d] views
    const auto vl = v.select(0, l).slice(2, 0, read_len);
    const int64_t window = windows.empty() ? 0 : windows[l];
    const auto att =
        static_decode_kernels::decode_attention(q, kl, vl, lens_after, n_new, 1, scale, window);  // [1, Hkv, G, d]
    products<S>(att.data_ptr<S>(), Nq, {mat(kO, D, o.data())}, row);
    for (int64_t i = 0; i < D; ++i) xs[i] = rnd<S>(xs[i] + rnd<S>(o[i]));
    rms_norm<S>(xs.data(), ptr(kPostNorm), D, eps, h.data());
    products<S>(h.data(), D, {mat(kGate, inner, gu.data()), mat(kUp, inner, gu.data() + inner)}, row);
    for (float& f : gu) f = rnd<S>(f);
    for (int64_t i = 0; i < inner; i += Vec::size()) {  // silu(gate) * up, rounded once: gemv_bf16_glu's math
      const int64_t c = std::min<int64_t>(Vec::size(), inner - i);
      const Vec g = Vec::loadu(gu.data() + i, c), u = Vec::loadu(gu.data() + inner + i, c);
      alignas(64) float t[Vec::size()];
      (g / (Vec(1.f) + g.neg().exp()) * u).store(t);
      for (int64_t j = 0; j < c; ++j) h[i + j] = static_cast<S>(t[j]);
    }
    products<S>(h.data(), inner, {mat(kDown, D, o.data())}, row);
    for (int64_t i = 0; i < D; ++i) xs[i] = rnd<S>(xs[i] + rnd<S>(o[i]));
  }
  auto out = at::empty_like(x);
  S* op = out.data_ptr<S>();
  for (int64_t i = 0; i < D; ++i) op[i] = static_cast<S>(xs[i]);
  return out;
}

// Everything `layers` indexes with, before the cache is written (rule 6): devices, dtypes, shapes, strides, no zero
// size, every layer's weights the shapes of the first's (the buffers are sized by it), the head size the attention
// has code for, and the lengths: n_new 0 or 1, lens_after = lens + n_new <= read_len <= max_len (the write at lens
// stays inside the cache's rows, the attention inside the read); the windows: none or one per layer, each >= 0.
std::vector<static_decode_kernels::QuantMat> check_layers(
    const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& lens, const at::Tensor& n_new, const at::Tensor& lens_after, int64_t read_len,
    at::TensorList weights, at::TensorList scales, int64_t group, at::IntArrayRef windows) {
  using static_decode_kernels::check_cpu;
  constexpr const char* op = "decode_layers";
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&cos, "cos"}, {&sin, "sin"}, {&k, "k"}, {&v, "v"}})
    check_cpu(*t, op, name);
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(1) == 1 && x.size(2) > 0 && x.is_contiguous(),
              "decode_layers: x must be one contiguous row [1, 1, D], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "decode_layers: model dtype ",
              x.scalar_type(), " is not supported here (float32, bfloat16)");
  TORCH_CHECK(k.dim() == 5 && k.sizes() == v.sizes() && k.size(1) == 1 && k.stride(4) == 1 && v.stride(4) == 1,
              "decode_layers: k and v must be [L, 1, Hkv, S, d] with contiguous rows, got ", k.sizes(), " ", v.sizes());
  TORCH_CHECK(static_decode_kernels::kernel_float(k.scalar_type()) && v.scalar_type() == k.scalar_type(),
              "decode_layers: K/V dtypes ", k.scalar_type(), "/", v.scalar_type(), " (float32/bfloat16/float16)");
  TORCH_CHECK(k.size(0) > 0 && k.size(2) > 0, "decode_layers: k ", k.sizes(), " has no layer or no KV head");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * k.size(0), "decode_layers: ", weights.size(),
              " weights for ", k.size(0), " layers (", kPerLayer, " a layer)");
  TORCH_CHECK(read_len >= 1 && read_len <= k.size(3) - 1, "decode_layers: read_len ", read_len, " outside 1..",
              k.size(3) - 1);
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == k.size(0), "decode_layers: ",
              windows.size(), " windows for ", k.size(0), " layers (none, or one a layer)");
  for (size_t l = 0; l < windows.size(); ++l) {
    const std::string name = "windows[" + std::to_string(l) + "]";
    static_decode_kernels::check_window(windows[l], op, name.c_str());
  }
  const int64_t Hkv = k.size(2), d = k.size(4), D = x.size(2), max_len = k.size(3) - 1;
  TORCH_CHECK(static_decode_kernels::head_dim_supported(d), "decode_layers: head_dim ", d, " is not supported");
  TORCH_CHECK(cos.numel() == d / 2 && sin.numel() == d / 2 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "decode_layers: cos/sin must hold head_dim / 2 values in x's dtype, got ", cos.scalar_type(), " ",
              cos.sizes(), " and ", sin.scalar_type(), " ", sin.sizes());
  const int64_t Nq = weights[kQ].dim() == 2 ? weights[kQ].size(0) : 0, Nkv = Hkv * d;
  const int64_t inner = weights[kGate].dim() == 2 ? weights[kGate].size(0) : 0;
  TORCH_CHECK(Nq >= Nkv && Nq % Nkv == 0 && Nq / Nkv <= static_decode_kernels::kMaxRows && inner > 0,
              "decode_layers: q rows ", Nq, " for ", Hkv, " KV heads of ", d, " (1..", static_decode_kernels::kMaxRows,
              " query heads a KV head), gate rows ", inner);
  const int64_t want[kPerLayer][2] = {{D, -1}, {Nq, D}, {Nkv, D}, {Nkv, D}, {D, Nq}, {D, -1}, {inner, D},
                                      {inner, D}, {D, inner}};
  const bool quantized = group >= 0;
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == (quantized ? kQuantPerLayer * k.size(0) : 0),
              "decode_layers: ", scales.size(), " scales for ", k.size(0), " layers of ",
              quantized ? "quantized" : "float", " weights (", quantized ? kQuantPerLayer : 0, " a layer)");
  std::vector<static_decode_kernels::QuantMat> mats;
  for (int64_t l = 0; l < k.size(0); ++l) {
    for (int i = 0; i < kPerLayer; ++i) {
      const at::Tensor& t = weights[l * kPerLayer + i];
      check_cpu(t, op, "a weight");
      if (quantized && want[i][1] >= 0) {  // a projection: its codes and scales, the shape of the float weight's
        int64_t N = 0, K = 0;
        const std::string name = "layer " + std::to_string(l) + " weight " + std::to_string(i);
        mats.push_back(static_decode_kernels::quant_mat(t, scales[l * kQuantPerLayer + kQuantIndex[i]], group, op,
                                                        name.c_str(), &N, &K));
        TORCH_CHECK(N == want[i][0] && K == want[i][1], "decode_layers: ", name, " is a quantized [", N, ", ", K,
                    "] weight, [", want[i][0], ", ", want[i][1], "] wanted");
        TORCH_CHECK(mats.back().bf16_scales == (x.scalar_type() == at::kBFloat16), "decode_layers: ", name,
                    "'s scales are not in x's dtype ", x.scalar_type());
        continue;
      }
      const bool shape = want[i][1] < 0 ? (t.dim() == 1 && t.size(0) == want[i][0])
                                        : (t.dim() == 2 && t.size(0) == want[i][0] && t.size(1) == want[i][1]);
      TORCH_CHECK(shape && t.is_contiguous() && t.scalar_type() == x.scalar_type(), "decode_layers: layer ", l,
                  " weight ", i, " is ", t.scalar_type(), " ", t.sizes(), " (contiguous, x's dtype, [", want[i][0],
                  want[i][1] < 0 ? "" : ", ", want[i][1] < 0 ? "" : std::to_string(want[i][1]), "] wanted)");
    }
  }
  const int64_t n = static_decode_kernels::lengths(n_new, 1, op, "n_new").data_ptr<int64_t>()[0];
  const int64_t old = static_decode_kernels::lengths(lens, 1, op, "lens").data_ptr<int64_t>()[0];
  const int64_t after = static_decode_kernels::lengths(lens_after, 1, op, "lens_after").data_ptr<int64_t>()[0];
  TORCH_CHECK(n == 0 || n == 1, "decode_layers: n_new ", n, " (one slot: 0 or 1)");
  TORCH_CHECK(old >= 0 && old <= max_len - n, "decode_layers: lens ", old, " outside 0..", max_len - n,
              " (the cache's rows for n_new ", n, ")");
  TORCH_CHECK(after == old + n && after <= read_len, "decode_layers: lens_after ", after, " is not lens + n_new = ",
              old + n, " within read_len ", read_len);
  return mats;
}

at::Tensor run_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k, at::Tensor& v,
                      const at::Tensor& lens, const at::Tensor& n_new, const at::Tensor& lens_after, int64_t read_len,
                      at::TensorList weights, at::TensorList scales, int64_t group, double eps,
                      at::IntArrayRef windows) {
  const auto quant =
      check_layers(x, cos, sin, k, v, lens, n_new, lens_after, read_len, weights, scales, group, windows);
  switch (x.scalar_type()) {
    case at::kFloat:
      return layers<float>(x, cos, sin, k, v, lens, n_new, lens_after, read_len, weights, quant, eps, windows);
#if defined(__AVX512BF16__)
    case at::kBFloat16:
      return layers<at::BFloat16>(x, cos, sin, k, v, lens, n_new, lens_after, read_len, weights, quant, eps,
                                  windows);
#endif
    default: TORCH_CHECK(false, "decode_layers: model dtype ", x.scalar_type(), " is not supported here");
  }
}

// x [1, 1, D]; cos/sin [1, 1, 1, d/2]; k/v [L, 1, Hkv, max_len + 1, d] (the layers' cache, written at the old
// length); lens (old) / n_new / lens_after [1] int64; weights: kPerLayer per layer; windows: each layer's sliding
// window (0: none), or empty. Returns x after the L layers.
at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k,
                         at::Tensor& v, const at::Tensor& lens, const at::Tensor& n_new, const at::Tensor& lens_after,
                         int64_t read_len, at::TensorList weights, double eps, at::IntArrayRef windows) {
  return run_layers(x, cos, sin, k, v, lens, n_new, lens_after, read_len, weights, {}, -1, eps, windows);
}

// The same for quantized projections (static_decode/quant.py): `weights` holds each projection's codes (qweight) in
// place of its float weight, `scales` the 7 projections' scales per layer (kQuantIndex's order), `group` 0 for
// int8, the int4 group size otherwise.
at::Tensor decode_layers_q(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k,
                           at::Tensor& v, const at::Tensor& lens, const at::Tensor& n_new, const at::Tensor& lens_after,
                           int64_t read_len, at::TensorList weights, at::TensorList scales, int64_t group,
                           double eps, at::IntArrayRef windows) {
  TORCH_CHECK(group >= 0, "decode_layers_q: group ", group, " (0 for int8; 32, 64 or 128 for int4)");
  return run_layers(x, cos, sin, k, v, lens, n_new, lens_after, read_len, weights, scales, group, eps, windows);
}

at::Tensor decode_layers_meta(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k,
                              at::Tensor& v, const at::Tensor& lens, const at::Tensor& n_new,
                              const at::Tensor& lens_after, int64_t read_len, at::TensorList weights, double eps,
                              at::IntArrayRef windows) {
  return at::empty_like(x);
}

at::Tensor decode_layers_q_meta(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k,
                                at::Tensor& v, const at::Tensor& lens, const at::Tensor& n_new,
                                const at::Tensor& lens_after, int64_t read_len, at::TensorList weights,
                                at::TensorList scales, int64_t group, double eps, at::IntArrayRef windows) {
  return at::empty_like(x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(static_decode_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor lens, Tensor n_new, "
        "Tensor lens_after, int read_len, Tensor[] weights, float eps, int[] windows=[]) -> Tensor");
  m.def("decode_layers_q(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor lens, Tensor n_new, "
        "Tensor lens_after, int read_len, Tensor[] weights, Tensor[] scales, int group, float eps, "
        "int[] windows=[]) -> Tensor");
}
TORCH_LIBRARY_IMPL(static_decode_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_layers_q", &decode_layers_q);
}
TORCH_LIBRARY_IMPL(static_decode_cpu, Meta, m) {
  m.impl("decode_layers", &decode_layers_meta);
  m.impl("decode_layers_q", &decode_layers_q_meta);
}
