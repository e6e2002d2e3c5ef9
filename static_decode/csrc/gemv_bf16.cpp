// One-row products with bfloat16 weights on the CPU: y[n] = sum_k W[n, k] x[k], the GEMV of a batch-1 decode step.
// Built with static_decode/csrc/decode_attention.cpp by static_decode/cpu_kernel.py.
//
// Why: a decode step reads every weight once, so its projections are bound by memory. On this CPU (2 threads) the
// library GEMV (torch.mv / F.linear: oneDNN) reads bfloat16 weights at 10-19 GB/s by shape, inductor's
// multiply-and-row-sum form at 12-16, a plain sum at ~26 (profiles/RESULTS.md). Here AVX512-BF16's dot-product
// instruction takes 32 weight x input products per step, float32 accumulation, no widening, and each thread works on
// 8 rows at once with the next 8 rows prefetched: 25-27 GB/s on SmolLM2's shapes.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 8;  // rows per inner step: 8 independent accumulators and load streams

#if defined(__AVX512BF16__)
// Rows [n0, n1) of W [N, K] (row stride K) times x [K]; K's tail past a multiple of 32 read with masked loads
// (zeros past the end).
void rows(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, float* y) {
  const int64_t body = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (K - body)) - 1);
  const __m512bh xt = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + body);
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) {
    const uint16_t* w = W + n * K;
    __m512 a[kRows];
    for (int r = 0; r < kRows; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += 32) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
      for (int r = 0; r < kRows; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + kRows) * K + k), _MM_HINT_T0);  // the next 8 rows
        a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(w + r * K + k), xv);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      if (body < K) a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * K + body), xt);
      y[n + r] = _mm512_reduce_add_ps(a[r]);
    }
  }
  for (; n < n1; ++n) {
    const uint16_t* w = W + n * K;
    __m512 a = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += 32)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    if (body < K) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + body), xt);
    y[n] = _mm512_reduce_add_ps(a);
  }
}
#endif

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& weight) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "gemv_bf16: weight must be a contiguous bfloat16 [N, K] matrix, got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.numel() == K, "gemv_bf16: x has ", x.numel(), " elements, the weight ", K, " columns");
  // The row in bfloat16: exact for a bfloat16 model (the products are exact in float32 either way).
  const auto xb = x.reshape({K}).to(at::kBFloat16).contiguous();
  auto y = at::empty({N}, x.options().dtype(at::kFloat));
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kRows - 1) / kRows, 8, [&](int64_t b, int64_t e) {
    rows(w, xp, K, b * kRows, std::min(N, e * kRows), yp);
  });
  return y.to(x.scalar_type());
#else
  TORCH_CHECK(false, "gemv_bf16: built without AVX512-BF16 (this CPU or compiler lacks it)");
#endif
}

at::Tensor gemv_bf16_meta(const at::Tensor& x, const at::Tensor& weight) {
  return at::empty({weight.size(0)}, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(static_decode_cpu, m) { m.def("gemv_bf16(Tensor x, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(static_decode_cpu, CPU, m) { m.impl("gemv_bf16", &gemv_bf16); }
TORCH_LIBRARY_IMPL(static_decode_cpu, Meta, m) { m.impl("gemv_bf16", &gemv_bf16_meta); }
