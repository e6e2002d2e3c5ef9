// One-row products with bfloat16 weights on the CPU: y[n] = sum_k W[n, k] x[k], the GEMV of a batch-1 decode step.
// Built with static_decode/csrc/decode_attention.cpp by static_decode/cpu_kernel.py.
//
// Why: a decode step reads every weight once, so its projections are bound by memory. On this CPU (2 threads) the
// library GEMV (torch.mv / F.linear: oneDNN) reads bfloat16 weights at 10-19 GB/s by shape, inductor's
// multiply-and-row-sum form at 12-16, a plain sum at ~26 (profiles/RESULTS.md). Here AVX512-BF16's dot-product
// instruction takes 32 weight x input products per step, float32 accumulation, no widening, and each thread works on
// 8 rows at once with the next 8 rows prefetched: 25-27 GB/s on SmolLM2's shapes (AMD's cores: 2 rows, see `rows`).
#include <torch/library.h>

#include "checks.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 8;  // rows per inner step: 8 independent accumulators and load streams
constexpr int64_t kAhead = 8192;    // prefetch distance in bytes for short rows (see `rows8`)
constexpr int64_t kLongRow = 2048;  // rows of at least this many bytes prefetch row by row

#if defined(__AVX512BF16__)
// Rows [n0, n1) of W [N, K] (row stride K) times x [K] into y in the output's dtype O (the row's: float32 sums
// rounded once, as `.to()` rounds them); K's tail past a multiple of 32 read with masked loads (zeros past the end).
// `one_rows` a row at a time (a block's last rows); `rows_linear` R rows a step with one linear prefetch run
// `ahead_bytes` in front of the block, R lines a step (AMD's plan); `rows8` 8 rows a step (see there).
template <typename O>
void one_rows(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, O* y) {
  const int64_t body = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - body)) - 1);
  const __m512bh xt = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + body);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* w = W + n * K;
    __m512 a = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += 32)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    if (body < K) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + body), xt);
    y[n] = static_cast<O>(_mm512_reduce_add_ps(a));
  }
}

template <int R, typename O>
void rows_linear(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, O* y,
                 int64_t ahead_bytes) {
  const int64_t body = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - body)) - 1);
  const __m512bh xt = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + body);
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    const uint16_t* w = W + n * K;
    const char* ahead = reinterpret_cast<const char*>(w) + ahead_bytes;
    __m512 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += 32) {
      for (int j = 0; j < R; ++j) _mm_prefetch(ahead + k * 2 * R + 64 * j, _MM_HINT_T0);
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
      for (int r = 0; r < R; ++r) a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(w + r * K + k), xv);
    }
    for (int r = 0; r < R; ++r) {
      if (body < K) a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * K + body), xt);
      y[n + r] = static_cast<O>(_mm512_reduce_add_ps(a[r]));
    }
  }
  one_rows<O>(W, x, K, n, n1, y);
}

template <typename O>
void rows8(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, O* y) {
  const int64_t body = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - body)) - 1);
  const __m512bh xt = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + body);
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) {
    const uint16_t* w = W + n * K;
    // Prefetch: short rows (under kLongRow bytes) as one contiguous run, the 8 lines (512 bytes) a step consumes
    // kAhead bytes further on; long rows row by row, the next block's row r at the same k. Measured on one Zen 4
    // core (profiles/RESULTS.md, "Quantized one-row kernels"): SmolLM2's 576-wide rows read 12-13 GB/s linearly
    // against 9-11 row by row; its 1536-wide rows 16.5 row by row against 14-15 linearly.
    const char* ahead = reinterpret_cast<const char*>(w) + kAhead;
    const bool linear = K * 2 < kLongRow;
    __m512 a[kRows];
    for (int r = 0; r < kRows; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += 32) {
      for (int j = 0; j < kRows; ++j)
        _mm_prefetch(linear ? ahead + k * 2 * kRows + 64 * j : reinterpret_cast<const char*>(w + (j + kRows) * K + k),
                     _MM_HINT_T0);
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
      for (int r = 0; r < kRows; ++r) a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(w + r * K + k), xv);
    }
    for (int r = 0; r < kRows; ++r) {
      if (body < K) a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * K + body), xt);
      y[n + r] = static_cast<O>(_mm512_reduce_add_ps(a[r]));
    }
  }
  one_rows<O>(W, x, K, n, n1, y);
}
// The rows by CPU (static_decode_kernels::amd_row_plan): on a Zen 5, 2 rows a step with one linear run 16 KB ahead
// took a 3B-shape bf16 step from 122 to 83 ms a token in one process taking turns (8 KB and 32 KB alike; 4 rows
// 89 ms) and SmolLM2's from 6.2 to 4.5 (profiles/RESULTS.md, "the quantized products two chunks a step"); the AMX
// Xeon keeps the 8-row loop it was measured fastest with.
template <typename O>
void rows(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, O* y) {
  static const bool amd = static_decode_kernels::amd_row_plan();
  if (amd) return rows_linear<2, O>(W, x, K, n0, n1, y, 16384);
  rows8<O>(W, x, K, n0, n1, y);
}
#elif STATIC_DECODE_AVX2
// AVX2's loop (gemv_avx2.cpp) sums in float32; other outputs take its sums 64 rows at a time, each rounded once.
template <typename O>
void rows(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, O* y) {
  if constexpr (std::is_same_v<O, float>) {
    static_decode_kernels::avx2::bf16_rows(W, x, K, n0, n1, y);
  } else {
    float t[64];
    for (int64_t n = n0; n < n1; n += 64) {
      const int64_t e = std::min<int64_t>(n1, n + 64);
      static_decode_kernels::avx2::bf16_rows(W + n * K, x, K, 0, e - n, t);
      for (int64_t i = 0; i < e - n; ++i) y[n + i] = static_cast<O>(t[i]);
    }
  }
}
#endif

// The checks every entry point makes: weights contiguous bfloat16 [N, K] on the CPU, all with the first one's K; x
// one row of K values ([..., K] with every other size 1) in a float dtype. Returns x as a bfloat16 row (exact for a
// bfloat16 model; the products are exact in float32 either way).
at::Tensor bf16_row(const at::Tensor& x, std::initializer_list<const at::Tensor*> weights, const char* op) {
  static_decode_kernels::check_cpu(x, op, "x");
  int64_t K = -1;
  for (const at::Tensor* w : weights) {
    static_decode_kernels::check_cpu(*w, op, "a weight");
    TORCH_CHECK(w->dim() == 2 && w->scalar_type() == at::kBFloat16 && w->is_contiguous(), op,
                ": weights must be contiguous bfloat16 [N, K] matrices, got ", w->scalar_type(), " ", w->sizes());
    if (K < 0) K = w->size(1);
    TORCH_CHECK(w->size(1) == K, op, ": a weight has ", w->size(1), " columns, the first ", K);
  }
  TORCH_CHECK(static_decode_kernels::kernel_float(x.scalar_type()) || x.scalar_type() == at::kDouble, op,
              ": x's dtype ", x.scalar_type(), " is not float32/bfloat16/float16/float64");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && x.numel() == K, op, ": x ", x.sizes(), " is not one row of the ",
              K, " values the weights' columns take");
  return x.reshape({K}).to(at::kBFloat16).contiguous();
}

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight) {
#if STATIC_DECODE_BF16_ROWS
  const auto xb = bf16_row(x, {&weight}, "gemv_bf16");
  const int64_t N = weight.size(0), K = xb.numel();
  // Written in x's dtype by the kernel: a separate `.to()` was an allocation and a pass per call, ~0.7 ms of a
  // SmolLM2 bf16 decode step's 211 calls.
  auto y = at::empty({N}, x.options());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "gemv_bf16", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, (N + kRows - 1) / kRows, 8, [&](int64_t b, int64_t e) {
      rows<scalar_t>(w, xp, K, b * kRows, std::min(N, e * kRows), yp);
    });
  });
  return y;
#else
  TORCH_CHECK(false, "gemv_bf16: built without AVX512-BF16 or AVX2 (this CPU or compiler lacks both)");
#endif
}

at::Tensor gemv_bf16_meta(const at::Tensor& x, const at::Tensor& weight) {
  return at::empty({weight.size(0)}, x.options());
}


// One call for the three projections that read the same row (q, k and v): [N0 + N1 + N2] in x's dtype, the three
// products concatenated, each row's value exactly what gemv_bf16 gives it. Why: each call of a decode step costs a
// dispatch, an allocation and a fork/join of the threads (~2 us on this 2-vCPU machine, measured with a GEMV of
// 64 KB): one region over all three matrices' row blocks instead of three.
at::Tensor gemv_bf16_cat3(const at::Tensor& x, const at::Tensor& w0, const at::Tensor& w1, const at::Tensor& w2) {
#if STATIC_DECODE_BF16_ROWS
  const auto xb = bf16_row(x, {&w0, &w1, &w2}, "gemv_bf16_cat3");
  const int64_t K = xb.numel();
  const at::Tensor* ws[3] = {&w0, &w1, &w2};
  int64_t first[4] = {0, 0, 0, 0};  // first row block of each matrix, then the total
  int64_t offset[3] = {0, 0, 0};    // first output element of each matrix
  for (int i = 0; i < 3; ++i) {
    first[i + 1] = first[i] + (ws[i]->size(0) + kRows - 1) / kRows;
    if (i < 2) offset[i + 1] = offset[i] + ws[i]->size(0);
  }
  auto y = at::empty({offset[2] + w2.size(0)}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "gemv_bf16_cat3", [&] {
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, first[3], 8, [&](int64_t b, int64_t e) {
      for (int i = 0; i < 3; ++i) {  // this range's blocks of matrix i
        const int64_t lo = std::max(b, first[i]), hi = std::min(e, first[i + 1]);
        if (lo >= hi) continue;
        const int64_t N = ws[i]->size(0);
        const auto* w = reinterpret_cast<const uint16_t*>(ws[i]->data_ptr());
        rows<scalar_t>(w, xp, K, (lo - first[i]) * kRows, std::min(N, (hi - first[i]) * kRows), yp + offset[i]);
      }
    });
  });
  return y;
#else
  TORCH_CHECK(false, "gemv_bf16_cat3: built without AVX512-BF16 or AVX2 (this CPU or compiler lacks both)");
#endif
}

at::Tensor gemv_bf16_cat3_meta(const at::Tensor& x, const at::Tensor& w0, const at::Tensor& w1,
                               const at::Tensor& w2) {
  return at::empty({w0.size(0) + w1.size(0) + w2.size(0)}, x.options());
}

// SwiGLU's first half in one call: silu(x W_gate^T) * (x W_up^T), [N] in x's dtype. Each product is rounded to x's
// dtype first, as the two separate GEMVs and the elementwise kernel after them round it; silu in float32 with
// at::vec's exp. Saves two of a layer's calls and the elementwise kernel (see gemv_bf16_cat3).
constexpr int64_t kGlu = 16;  // rows per step: one float vector of gate and of up values

at::Tensor gemv_bf16_glu(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up) {
#if STATIC_DECODE_BF16_ROWS
  const auto xb = bf16_row(x, {&gate, &up}, "gemv_bf16_glu");
  TORCH_CHECK(gate.size(0) == up.size(0), "gemv_bf16_glu: gate has ", gate.size(0), " rows, up ", up.size(0));
  const int64_t N = gate.size(0), K = xb.numel();
  auto y = at::empty({N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const auto* wg = reinterpret_cast<const uint16_t*>(gate.data_ptr());
  const auto* wu = reinterpret_cast<const uint16_t*>(up.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "gemv_bf16_glu", [&] {
    using Vec = at::vec::Vectorized<float>;
    static_assert(kGlu % Vec::size() == 0, "a step is whole float vectors");
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, (N + kGlu - 1) / kGlu, 4, [&](int64_t b, int64_t e) {
      scalar_t g[kGlu], u[kGlu];
      alignas(64) float gf[kGlu], uf[kGlu], h[kGlu];
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t n0 = blk * kGlu, n = std::min(kGlu, N - n0);
        rows<scalar_t>(wg + n0 * K, xp, K, 0, n, g);  // this step's rows, from row n0
        rows<scalar_t>(wu + n0 * K, xp, K, 0, n, u);
        for (int64_t i = 0; i < kGlu; ++i) {
          gf[i] = i < n ? static_cast<float>(g[i]) : 0.f;
          uf[i] = i < n ? static_cast<float>(u[i]) : 0.f;
        }
        for (int64_t i = 0; i < kGlu; i += Vec::size()) {
          const Vec gv = Vec::loadu(gf + i);
          (gv / (Vec(1.f) + gv.neg().exp()) * Vec::loadu(uf + i)).store(h + i);
        }
        for (int64_t i = 0; i < n; ++i) yp[n0 + i] = static_cast<scalar_t>(h[i]);
      }
    });
  });
  return y;
#else
  TORCH_CHECK(false, "gemv_bf16_glu: built without AVX512-BF16 or AVX2 (this CPU or compiler lacks both)");
#endif
}

at::Tensor gemv_bf16_glu_meta(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up) {
  return at::empty({gate.size(0)}, x.options());
}

}  // namespace

#if STATIC_DECODE_BF16_ROWS
void static_decode_kernels::bf16_rows(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1,
                                      float* y) {
  rows<float>(W, x, K, n0, n1, y);
}
#endif

TORCH_LIBRARY_FRAGMENT(static_decode_cpu, m) {
  m.def("gemv_bf16(Tensor x, Tensor weight) -> Tensor");
  m.def("gemv_bf16_cat3(Tensor x, Tensor w0, Tensor w1, Tensor w2) -> Tensor");
  m.def("gemv_bf16_glu(Tensor x, Tensor gate, Tensor up) -> Tensor");
}
TORCH_LIBRARY_IMPL(static_decode_cpu, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_bf16_cat3", &gemv_bf16_cat3);
  m.impl("gemv_bf16_glu", &gemv_bf16_glu);
}
TORCH_LIBRARY_IMPL(static_decode_cpu, Meta, m) {
  m.impl("gemv_bf16", &gemv_bf16_meta);
  m.impl("gemv_bf16_cat3", &gemv_bf16_cat3_meta);
  m.impl("gemv_bf16_glu", &gemv_bf16_glu_meta);
}
