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
#include "decode_layers.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
using namespace static_decode_kernels::layers;  // the tensors' order, Cache, check_layers
constexpr int64_t kRows = 8;  // weight rows per inner step (gemv_bf16.cpp's)

// Adds n to `count` when it goes out of scope (a part of the row done, or thrown out of).
struct Arrive {
  std::atomic<int64_t>& count;
  int64_t n;
  ~Arrive() { count.fetch_add(n, std::memory_order_release); }
};

inline void pause() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

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
  std::vector<int64_t> first{0};  // first row block of each matrix, then the total
  for (const Product& p : mats) first.push_back(first.back() + (p.n + kRows - 1) / kRows);
  const auto blocks = [&](int64_t b, int64_t e) {  // row blocks [b, e) of all the matrices
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
#if STATIC_DECODE_BF16_ROWS
        static_decode_kernels::bf16_rows(static_cast<const uint16_t*>(p.w), reinterpret_cast<const uint16_t*>(x),
                                         K, n0, n1, p.y);
#else
        TORCH_CHECK(false, "decode_layers: bfloat16 weights need AVX512-BF16 or AVX2");
#endif
      }
    }
  };
  if (head.q == nullptr) {  // a layer's products are all quantized or none
    at::parallel_for(0, first.back(), 8, blocks);
    return;
  }
  if (head.q->gguf != 0) {  // GGUF blocks (one layer's may be of several types): the row's codes made once
    std::vector<float> xf(K);
    at::vec::convert(x, xf.data(), K);
    static_decode_kernels::gguf::quantize_row(xf.data(), K, row.g);
    at::parallel_for(0, first.back(), 8, blocks);
    return;
  }
  const int64_t group = head.q->group;
  const bool bf16 = static_decode_kernels::int4_bf16_path(*head.q);
  const bool int8 = static_decode_kernels::int8_dot_path(*head.q);
  std::vector<float> xf(K);  // the row in float32
  static_decode_kernels::prepare_row_size(K, group, row, int8);
  const auto prepare = [&](int64_t k0, int64_t k1) {
    at::vec::convert(x + k0, xf.data() + k0, k1 - k0);
    static_decode_kernels::prepare_row_part(xf.data(), k0, k1, group, bf16, row, int8);
  };
#if AT_PARALLEL_OPENMP
  // Each thread prepares a part of the row, waits until all parts are in, then runs its share of the row blocks:
  // one parallel loop, where the row's preparation before it ran on one thread while the other waited. OpenMP's
  // threads of one loop run at once, so the wait ends (elsewhere a loop's chunks may run one after another).
  const int64_t parts = (K + static_decode_kernels::kRowPart - 1) / static_decode_kernels::kRowPart;
  const int64_t T = std::min<int64_t>(at::get_num_threads(), parts);
  if (T > 1 && !at::in_parallel_region()) {
    std::atomic<int64_t> ready{0};
    at::parallel_for(0, T, 1, [&](int64_t b, int64_t e) {
      {
        const Arrive arrive{ready, e - b};  // counted however the part ends: no thread waits on a part that threw
        prepare(std::min(K, b * parts / T * static_decode_kernels::kRowPart),
                std::min(K, e * parts / T * static_decode_kernels::kRowPart));
      }
      while (ready.load(std::memory_order_acquire) < T) pause();
      blocks(b * first.back() / T, e * first.back() / T);
    });
    return;
  }
#endif
  prepare(0, K);
  at::parallel_for(0, first.back(), 8, blocks);
}

template <typename S>
inline float rnd(float f) {  // a float32 value rounded to the model's dtype (what storing it in a tensor does)
  return static_cast<float>(static_cast<S>(f));
}

// rnd of 16 values at once: bfloat16's round to nearest even, as c10::BFloat16 rounds one value.
template <typename S>
inline Vec rnd(const Vec& v) {
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<S>(at::vec::convert_from_float<S>(v, v)));
  }
}

// Rounds n float32 values to the model's dtype in place.
template <typename S>
void round_all(float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int64_t c = std::min<int64_t>(Vec::size(), n - i);
    rnd<S>(Vec::loadu(p + i, c)).store(p + i, c);
  }
}

// The first `count` values of v stored at out in the model's dtype.
template <typename S>
inline void store_as(const Vec& v, S* out, int64_t count) {
  if constexpr (std::is_same_v<S, float>) {
    v.store(out, count);
  } else {
    at::vec::convert_from_float<S>(v, v).store(out, count);
  }
}

// The residual x += rnd(o), rounded, in place over D values.
template <typename S>
void add_residual(float* x, const float* o, int64_t D) {
  for (int64_t i = 0; i < D; i += Vec::size()) {
    const int64_t c = std::min<int64_t>(Vec::size(), D - i);
    rnd<S>(Vec::loadu(x + i, c) + rnd<S>(Vec::loadu(o + i, c))).store(x + i, c);
  }
}

// RMSNorm of x [D] (float32 values of the model's dtype) into out [D] in the model's dtype: x / rms(x) in float32,
// rounded, times the weight, rounded (static_decode.model.RMSNorm). The sum of squares is taken in float64 (exact
// squares, 8 independent sums): one float32 chain was ~5 us a call at 3,072 values, and a float32 sum in another
// order than torch's mean moved the result by more than the last bit where the eager layer's did not.
template <typename S>
void rms_norm(const float* x, const S* weight, int64_t D, double eps, S* out) {
  double a[8] = {0., 0., 0., 0., 0., 0., 0., 0.};
  int64_t i = 0;
  for (; i + 8 <= D; i += 8)
    for (int j = 0; j < 8; ++j) a[j] += static_cast<double>(x[i + j]) * x[i + j];
  for (; i < D; ++i) a[0] += static_cast<double>(x[i]) * x[i];
  const float ss = static_cast<float>(((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])));
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(eps));
  for (i = 0; i < D; i += Vec::size()) {
    const int64_t c = std::min<int64_t>(Vec::size(), D - i);
    Vec w;
    if constexpr (std::is_same_v<S, float>) {
      w = Vec::loadu(weight + i, c);
    } else {
      w = std::get<0>(at::vec::convert_to_float<S>(at::vec::Vectorized<S>::loadu(weight + i, c)));
    }
    store_as<S>(w * rnd<S>(Vec::loadu(x + i, c) * Vec(r)), out + i, c);
  }
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

// Head dim values x [d] (of the model's dtype) as int8 codes and a float32 scale, core/kv_quant.quantize's math:
// scale = max |x| / 127, code = x / scale rounded to nearest even, clamped to -127..127; an all-zero row has scale 0
// and codes 0. A NaN in x makes the scale NaN (torch's amax), its codes 0.
inline void quantize_kv_row(const float* x, int64_t d, int8_t* codes, float* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < d; ++i) amax = std::isnan(x[i]) || std::isnan(amax) ? NAN : std::max(amax, std::fabs(x[i]));
  const float s = amax / 127.f, safe = s > 0.f ? s : 1.f;
  for (int64_t i = 0; i < d; ++i) {
    const float c = std::nearbyint(x[i] / safe);
    codes[i] = std::isnan(c) ? 0 : static_cast<int8_t>(std::clamp(c, -127.f, 127.f));
  }
  *scale = s;
}

// The new token's K and V rows (float32 sums kn/vn [Hkv * d], rounded to the model's dtype here) written into layer
// l of the cache at position pos, in place: rounded to a float cache's dtype, or quantized into an int8 cache's codes
// and scales.
template <typename S>
void write_kv(const Cache& c, int64_t l, int64_t pos, const float* kn, const float* vn, int64_t Hkv, int64_t d) {
  if (c.k_scale != nullptr) {
    std::vector<float> row(d);
    const at::Tensor* codes[2] = {&c.k, &c.v};
    const at::Tensor* scales[2] = {c.k_scale, c.v_scale};
    const float* src[2] = {kn, vn};
    for (int64_t hh = 0; hh < Hkv; ++hh) {
      for (int j = 0; j < 2; ++j) {
        const at::Tensor &t = *codes[j], &s = *scales[j];
        for (int64_t i = 0; i < d; ++i) row[i] = rnd<S>(src[j][hh * d + i]);
        quantize_kv_row(row.data(), d,
                        static_cast<int8_t*>(t.data_ptr()) + l * t.stride(0) + hh * t.stride(2) + pos * t.stride(3),
                        static_cast<float*>(s.data_ptr()) + l * s.stride(0) + hh * s.stride(2) + pos * s.stride(3));
      }
    }
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, c.k.scalar_type(), "decode_layers_write", [&] {
    for (int64_t hh = 0; hh < Hkv; ++hh) {  // row 0, head hh, position pos
      scalar_t* kd = c.k.data_ptr<scalar_t>() + l * c.k.stride(0) + hh * c.k.stride(2) + pos * c.k.stride(3);
      scalar_t* vd = c.v.data_ptr<scalar_t>() + l * c.v.stride(0) + hh * c.v.stride(2) + pos * c.v.stride(3);
      for (int64_t i = 0; i < d; ++i) {
        kd[i] = static_cast<scalar_t>(static_cast<S>(kn[hh * d + i]));
        vd[i] = static_cast<scalar_t>(static_cast<S>(vn[hh * d + i]));
      }
    }
  });
}

template <typename S>
at::Tensor layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const Cache& cache,
                  const at::Tensor& lens, const at::Tensor& n_new, const at::Tensor& lens_after, int64_t read_len,
                  at::TensorList w, const std::vector<static_decode_kernels::QuantMat>& quant, double eps,
                  at::IntArrayRef windows) {
  // Everything below reads and writes raw memory: the views and buffers made here need no autograd tracking, which
  // made a layer's cache views (select, slice) several times dearer, serially, between the parallel products.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const at::Tensor &k = cache.k, &v = cache.v;
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
  std::vector<S> att(Nq);  // the attention's output [1, Hkv, G, d], o_proj's row
  std::vector<float> scratch;  // the attention's partial results, reused by every layer
  // An int8 cache's attention takes the queries as a tensor in the model's dtype, [1, Hkv, G, d]: head h = kv * G + g.
  const at::Tensor q = cache.k_scale != nullptr ? at::empty({1, Hkv, G, d}, x.options()) : at::Tensor();

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
    round_all<S>(qkv.data(), Nq + 2 * Nkv);
    rotate<S>(qkv.data(), Hq + Hkv, d, cs, sn);  // q's heads then k's: adjacent
    write_kv<S>(cache, l, pos, qkv.data() + Nq, qkv.data() + Nq + Nkv, Hkv, d);  // in place at pos (rule 1)
    const int64_t window = windows.empty() ? 0 : windows[l];
    if (cache.k_scale == nullptr) {  // layer l's rows [0, read_len) by pointer, the queries straight from qkv
      const int64_t item = static_cast<int64_t>(k.element_size());
      const static_decode_kernels::KVRows rows{
          static_cast<const char*>(k.data_ptr()) + l * k.stride(0) * item,
          static_cast<const char*>(v.data_ptr()) + l * v.stride(0) * item, k.scalar_type(), read_len, d,
          k.stride(1), k.stride(2), k.stride(3), v.stride(1), v.stride(2), v.stride(3)};
      static_decode_kernels::decode_attention_into<S>(qkv.data(), std::is_same_v<S, at::BFloat16>, rows,
                                                      lens_after.data_ptr<int64_t>(), n_new.data_ptr<int64_t>(), 1,
                                                      Hkv, G, 1, scale, window, scratch, att.data());
    } else {
      S* qp = q.data_ptr<S>();
      for (int64_t i = 0; i < Nq; ++i) qp[i] = static_cast<S>(qkv[i]);
      const auto kl = k.select(0, l).slice(2, 0, read_len);  // [1, Hkv, read_len, d] views
      const auto vl = v.select(0, l).slice(2, 0, read_len);
      const at::Tensor out = static_decode_kernels::decode_attention_int8(
          q, kl, vl, cache.k_scale->select(0, l).slice(2, 0, read_len),
          cache.v_scale->select(0, l).slice(2, 0, read_len), lens_after, n_new, 1, scale, window);
      std::copy(out.data_ptr<S>(), out.data_ptr<S>() + Nq, att.data());
    }
    products<S>(att.data(), Nq, {mat(kO, D, o.data())}, row);
    add_residual<S>(xs.data(), o.data(), D);
    rms_norm<S>(xs.data(), ptr(kPostNorm), D, eps, h.data());
    products<S>(h.data(), D, {mat(kGate, inner, gu.data()), mat(kUp, inner, gu.data() + inner)}, row);
    round_all<S>(gu.data(), 2 * inner);
    for (int64_t i = 0; i < inner; i += Vec::size()) {  // silu(gate) * up, rounded once: gemv_bf16_glu's math
      const int64_t c = std::min<int64_t>(Vec::size(), inner - i);
      const Vec g = Vec::loadu(gu.data() + i, c), u = Vec::loadu(gu.data() + inner + i, c);
      store_as<S>(g / (Vec(1.f) + g.neg().exp()) * u, h.data() + i, c);
    }
    products<S>(h.data(), inner, {mat(kDown, D, o.data())}, row);
    add_residual<S>(xs.data(), o.data(), D);
  }
  auto out = at::empty_like(x);
  S* op = out.data_ptr<S>();
  for (int64_t i = 0; i < D; ++i) op[i] = static_cast<S>(xs[i]);
  return out;
}

at::Tensor run_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const Cache& cache,
                      const at::Tensor& lens, const at::Tensor& n_new, const at::Tensor& lens_after, int64_t read_len,
                      at::TensorList weights, at::TensorList scales, int64_t group, double eps,
                      at::IntArrayRef windows, at::IntArrayRef types = {}) {
  const auto quant =
      check_layers(x, cos, sin, cache, lens, n_new, lens_after, read_len, weights, scales, group, windows, types);
  switch (x.scalar_type()) {
    case at::kFloat:
      return layers<float>(x, cos, sin, cache, lens, n_new, lens_after, read_len, weights, quant, eps, windows);
#if STATIC_DECODE_BF16_ROWS
    case at::kBFloat16:
      return layers<at::BFloat16>(x, cos, sin, cache, lens, n_new, lens_after, read_len, weights, quant, eps,
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
  return run_layers(x, cos, sin, Cache{k, v}, lens, n_new, lens_after, read_len, weights, {}, -1, eps, windows);
}

// The same for quantized projections (static_decode/quant.py): `weights` holds each projection's codes (qweight) in
// place of its float weight, `scales` the 7 projections' scales per layer (kQuantIndex's order), `group` 0 for
// int8, the int4 group size otherwise.
at::Tensor decode_layers_q(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k,
                           at::Tensor& v, const at::Tensor& lens, const at::Tensor& n_new, const at::Tensor& lens_after,
                           int64_t read_len, at::TensorList weights, at::TensorList scales, int64_t group,
                           double eps, at::IntArrayRef windows) {
  TORCH_CHECK(group >= 0, "decode_layers_q: group ", group, " (0 for int8; 32, 64 or 128 for int4)");
  return run_layers(x, cos, sin, Cache{k, v}, lens, n_new, lens_after, read_len, weights, scales, group, eps,
                    windows);
}

// The same for GGUF blocks (static_decode/model/gguf_quant.py): `weights` holds each projection's blocks (uint8
// [N, row bytes]) in place of its float weight, `types` the 7 projections' GGUF types per layer (kQuantIndex's order).
at::Tensor decode_layers_gguf(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k,
                              at::Tensor& v, const at::Tensor& lens, const at::Tensor& n_new,
                              const at::Tensor& lens_after, int64_t read_len, at::TensorList weights,
                              at::IntArrayRef types, double eps, at::IntArrayRef windows) {
  return run_layers(x, cos, sin, Cache{k, v}, lens, n_new, lens_after, read_len, weights, {}, -1, eps, windows,
                    types);
}

at::Tensor decode_layers_gguf_meta(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k,
                                   at::Tensor& v, const at::Tensor& lens, const at::Tensor& n_new,
                                   const at::Tensor& lens_after, int64_t read_len, at::TensorList weights,
                                   at::IntArrayRef types, double eps, at::IntArrayRef windows) {
  return at::empty_like(x);
}

// Over an int8 cache: k/v its codes, k_scale/v_scale [L, 1, Hkv, max_len + 1] float32 its scales, both written at
// the old length; float weights (group -1, no scales) or quantized ones (decode_layers_q's).
at::Tensor decode_layers_kv8(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k,
                             at::Tensor& v, at::Tensor& k_scale, at::Tensor& v_scale, const at::Tensor& lens,
                             const at::Tensor& n_new, const at::Tensor& lens_after, int64_t read_len,
                             at::TensorList weights, at::TensorList scales, int64_t group, double eps,
                             at::IntArrayRef windows) {
  TORCH_CHECK(group >= -1, "decode_layers_kv8: group ", group, " (-1 for float weights, 0 for int8, 32/64/128 int4)");
  return run_layers(x, cos, sin, Cache{k, v, &k_scale, &v_scale}, lens, n_new, lens_after, read_len, weights, scales,
                    group, eps, windows);
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

at::Tensor decode_layers_kv8_meta(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k,
                                  at::Tensor& v, at::Tensor& k_scale, at::Tensor& v_scale, const at::Tensor& lens,
                                  const at::Tensor& n_new, const at::Tensor& lens_after, int64_t read_len,
                                  at::TensorList weights, at::TensorList scales, int64_t group, double eps,
                                  at::IntArrayRef windows) {
  return at::empty_like(x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(static_decode_cpu, m) {
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor lens, Tensor n_new, "
        "Tensor lens_after, int read_len, Tensor[] weights, float eps, int[] windows=[]) -> Tensor");
  m.def("decode_layers_q(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor lens, Tensor n_new, "
        "Tensor lens_after, int read_len, Tensor[] weights, Tensor[] scales, int group, float eps, "
        "int[] windows=[]) -> Tensor");
  m.def("decode_layers_gguf(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor lens, "
        "Tensor n_new, Tensor lens_after, int read_len, Tensor[] weights, int[] types, float eps, "
        "int[] windows=[]) -> Tensor");
  m.def("decode_layers_kv8(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor(c!) k_scale, "
        "Tensor(d!) v_scale, Tensor lens, Tensor n_new, Tensor lens_after, int read_len, Tensor[] weights, "
        "Tensor[] scales, int group, float eps, int[] windows=[]) -> Tensor");
}
TORCH_LIBRARY_IMPL(static_decode_cpu, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_layers_q", &decode_layers_q);
  m.impl("decode_layers_kv8", &decode_layers_kv8);
  m.impl("decode_layers_gguf", &decode_layers_gguf);
}
TORCH_LIBRARY_IMPL(static_decode_cpu, Meta, m) {
  m.impl("decode_layers", &decode_layers_meta);
  m.impl("decode_layers_q", &decode_layers_q_meta);
  m.impl("decode_layers_kv8", &decode_layers_kv8_meta);
  m.impl("decode_layers_gguf", &decode_layers_gguf_meta);
}
