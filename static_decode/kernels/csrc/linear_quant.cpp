// Several rows times a quantized weight (prefill chunks, verify steps): y [M, N] = x [M, K] W^T, W dequantized a
// block of rows at a time into a buffer that stays in the core's L2 and each block multiplied there by the float
// GEMM. Built with the other kernels by static_decode/cpu_kernel.py.
//
// Why: the whole weight dequantized first (dequant_q, then one GEMM) is written to memory at 2 or 4 bytes a value and
// read back, 4-8x the bytes of its codes, into an allocation that large the system pages in afresh on every call:
// most of a quantized prefill's extra time over the float model's (profiles/RESULTS.md, "Quantized prefill by row
// blocks"). The values are the same (dequant_rows_into: each computed in float32, rounded once to x's dtype).
#include <torch/library.h>

#include "checks.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cstdint>
#include <functional>

// Dequantized bytes a block of rows: half the L2 of the cores this was measured on, a multiple of 16 rows.
constexpr int64_t kBlockBytes = 1 << 20;

at::Tensor static_decode_kernels::linear_by_row_blocks(
    const at::Tensor& x, int64_t N, int64_t K, const std::function<void(int64_t, int64_t, void*)>& dequant) {
  const auto xc = x.contiguous();  // [M, K]
  const int64_t M = x.size(0), item = static_cast<int64_t>(x.element_size());
  // rows a block: kBlockBytes of weight, and at least one block a thread (a small weight is still split)
  const int64_t by_cache = std::max<int64_t>(16, kBlockBytes / (K * item) / 16 * 16);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t rows = std::min({N, by_cache, ((N + threads - 1) / threads + 15) / 16 * 16});
  auto y = at::empty({M, N}, x.options());
  const at::ThreadLocalState caller;  // inference mode and the like: OpenMP's threads do not inherit them
  at::parallel_for(0, (N + rows - 1) / rows, 1, [&](int64_t b0, int64_t b1) {
    const at::ThreadLocalStateGuard same(caller);  // y may be an inference tensor, written in place here
    auto w = at::empty({rows, K}, x.options());  // this thread's block of the weight, reused block after block
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * rows, n = std::min(rows, N - n0);
      dequant(n0, n0 + n, w.data_ptr());
      // [M, K] x [K, n]: x as the GEMM's first operand, read in place; the block, new to the GEMM anyway, as the one
      // it packs (the other way round the GEMM packed x again for every block). One thread's GEMM: this is inside
      // the parallel region.
      y.narrow(1, n0, n).copy_(at::mm(xc, w.narrow(0, 0, n).t()));
    }
  });
  return y;
}

namespace {

// x [M, K] (float32 or bfloat16) times the quantized weight's transpose -> [M, N] in x's dtype.
at::Tensor linear_q(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  constexpr const char* op = "linear_q";
  int64_t N = 0, K = 0;
  const auto m = static_decode_kernels::quant_mat(qweight, scales, group, op, "the weight", &N, &K);
  static_decode_kernels::check_cpu(x, op, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x's dtype ",
              x.scalar_type(), " is not float32/bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.size(0) > 0 && x.size(1) == K, op, ": x ", x.sizes(), " is not [M, ", K,
              "] (M >= 1 rows of the ", K, " values the weight's columns take)");
  return static_decode_kernels::linear_by_row_blocks(x, N, K, [&](int64_t n0, int64_t n1, void* out) {
    static_decode_kernels::dequant_rows_into(m, K, n0, n1, x.scalar_type(), out);
  });
}

at::Tensor linear_q_meta(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  return at::empty({x.size(0), qweight.size(0)}, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(static_decode_cpu, m) {
  m.def("linear_q(Tensor x, Tensor qweight, Tensor scales, int group) -> Tensor");
}
TORCH_LIBRARY_IMPL(static_decode_cpu, CPU, m) { m.impl("linear_q", &linear_q); }
TORCH_LIBRARY_IMPL(static_decode_cpu, Meta, m) { m.impl("linear_q", &linear_q_meta); }
