// The ops over GGUF blocks (gguf_blocks.h): gemv_gguf (one row, the ISA's loop), dequant_gguf (the weight, each value
// as gguf.quants.dequantize computes it) and linear_gguf (several rows: the weight dequantized a block of rows at a
// time and multiplied there by the float GEMM, as linear_quant.cpp does for our own formats). Built with the other
// kernels by static_decode/cpu_kernel.py; static_decode/model/gguf_quant.py calls them.
#include <torch/library.h>

#include "checks.h"
#include "gguf_blocks.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

namespace {

namespace gguf = static_decode_kernels::gguf;

constexpr int64_t kGrainRows = 16;        // rows a thread takes at least in gemv_gguf

// Checks blocks (uint8 [N, row bytes], contiguous) of `type` for `op` and returns the weight's K.
int64_t check_blocks(const at::Tensor& blocks, int64_t type, const char* op) {
  const gguf::Layout L = gguf::layout(type);
  TORCH_CHECK(L.weights > 0, op, ": GGUF type ", type, " is not one the kernels read (Q4_0 2, Q4_1 3, Q5_0 6, ",
              "Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14)");
  static_decode_kernels::check_cpu(blocks, op, "blocks");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2, op, ": blocks must be uint8 [N, row bytes], got ",
              blocks.scalar_type(), " ", blocks.sizes());
  TORCH_CHECK(blocks.size(0) > 0 && blocks.size(1) > 0 && blocks.size(1) % L.bytes == 0, op, ": blocks ",
              blocks.sizes(), " must hold whole ", gguf::type_name(type), " blocks of ", L.bytes, " bytes a row");
  TORCH_CHECK(blocks.is_contiguous(), op, ": blocks must be contiguous, got strides ", blocks.strides());
  return blocks.size(1) / L.bytes * L.weights;
}

void check_row(const at::Tensor& x, int64_t K, const char* op) {
  static_decode_kernels::check_cpu(x, op, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x's dtype ", x.scalar_type(),
              " is not float32/bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.size(0) > 0 && x.size(1) == K, op, ": x ", x.sizes(), " is not [M, ", K,
              "] (the ", K, " values the weight's columns take)");
}

// The one row x [1, K] of a one-row product as its int8 codes (gguf::quantize_row), checked first.
gguf::Row one_row(const at::Tensor& x, int64_t K, const char* op) {
  check_row(x, K, op);
  TORCH_CHECK(x.size(0) == 1, op, ": x ", x.sizes(), " must be one row (linear_gguf takes several)");
  const auto xf = x.to(at::kFloat).contiguous();
  gguf::Row row;
  gguf::quantize_row(xf.data_ptr<float>(), K, row);
  return row;
}

// Sub j of the block at b, dequantized into out[32]: the product rounded, then the offset added, never fused (gguf's
// numpy computes them as two float32 operations).
#if defined(__clang__)
void dequant_sub(int64_t type, const uint8_t* b, int j, float* out) {
#pragma clang fp contract(off)
#else
__attribute__((optimize("fp-contract=off"))) void dequant_sub(int64_t type, const uint8_t* b, int j, float* out) {
#endif
  gguf::Sub s;
  gguf::decode_sub(type, b, j, s);
  for (int i = 0; i < 32; ++i) out[i] = s.s[i / 16] * static_cast<float>(s.q[i]);
  if (s.offset)
    for (int i = 0; i < 32; ++i) out[i] = out[i] + s.c[i / 16];
}

// Rows [n0, n1) of the weight into `out` (rows n0.. from its start) in `dtype` (float32 or bfloat16, rounded once).
void dequant_rows(int64_t type, const uint8_t* W, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1,
                  at::ScalarType dtype, void* out) {
  const gguf::Layout L = gguf::layout(type);
  const int subs = static_cast<int>(L.weights / 32);
  float v[32];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = W + n * row_bytes;
    for (int64_t blk = 0; blk < K / L.weights; ++blk) {
      for (int j = 0; j < subs; ++j) {
        dequant_sub(type, w + blk * L.bytes, j, v);
        const int64_t at = (n - n0) * K + blk * L.weights + 32 * j;
        if (dtype == at::kFloat) {
          std::copy(v, v + 32, static_cast<float*>(out) + at);
        } else {
          auto* o = static_cast<c10::BFloat16*>(out) + at;
          for (int i = 0; i < 32; ++i) o[i] = c10::BFloat16(v[i]);
        }
      }
    }
  }
}

// x [1, K] (float32 or bfloat16) times the weight's transpose -> [1, N] in x's dtype: the row quantized to int8 codes
// once (gguf::quantize_row), each weight row multiplied by them in the ISA's loop.
at::Tensor gemv_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  constexpr const char* op = "gemv_gguf";
  const int64_t K = check_blocks(blocks, type, op);
  const gguf::Row row = one_row(x, K, op);
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1);
  const auto* W = blocks.data_ptr<uint8_t>();
  auto y = at::empty({1, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) { gguf::rows(type, W, row_bytes, row, n0, n1, yp); });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The portable loop on any build, for tests of the ISA loop against it.
at::Tensor gemv_gguf_portable(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  constexpr const char* op = "gemv_gguf_portable";
  const int64_t K = check_blocks(blocks, type, op);
  const gguf::Row row = one_row(x, K, op);
  auto y = at::empty({1, blocks.size(0)}, x.options().dtype(at::kFloat));
  gguf::rows_portable(type, blocks.data_ptr<uint8_t>(), blocks.size(1), row, 0, blocks.size(0), y.data_ptr<float>());
  return y;
}

at::Tensor dequant_gguf(const at::Tensor& blocks, int64_t type, at::ScalarType dtype) {
  const int64_t K = check_blocks(blocks, type, "dequant_gguf");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequant_gguf: dtype ", dtype, " (float32 or bfloat16)");
  const int64_t N = blocks.size(0);
  auto out = at::empty({N, K}, blocks.options().dtype(dtype));
  const auto* W = blocks.data_ptr<uint8_t>();
  const int64_t item = static_cast<int64_t>(out.element_size());
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    dequant_rows(type, W, blocks.size(1), K, n0, n1, dtype, static_cast<char*>(out.data_ptr()) + n0 * K * item);
  });
  return out;
}

// x [M, K] times the weight's transpose -> [M, N] in x's dtype.
at::Tensor linear_gguf(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  constexpr const char* op = "linear_gguf";
  const int64_t K = check_blocks(blocks, type, op);
  check_row(x, K, op);
  const auto* W = blocks.data_ptr<uint8_t>();
  return static_decode_kernels::linear_by_row_blocks(x, blocks.size(0), K, [&](int64_t n0, int64_t n1, void* out) {
    dequant_rows(type, W, blocks.size(1), K, n0, n1, x.scalar_type(), out);
  });
}

int64_t meta_k(const at::Tensor& blocks, int64_t type) {
  const gguf::Layout L = gguf::layout(type);
  TORCH_CHECK(L.weights > 0, "GGUF type ", type, " is not one the kernels read");
  return blocks.size(1) / L.bytes * L.weights;
}

at::Tensor gemv_gguf_meta(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  return at::empty({x.size(0), blocks.size(0)}, x.options());
}
at::Tensor dequant_gguf_meta(const at::Tensor& blocks, int64_t type, at::ScalarType dtype) {
  return at::empty({blocks.size(0), meta_k(blocks, type)}, blocks.options().dtype(dtype));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(static_decode_cpu, m) {
  m.def("gemv_gguf(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("gemv_gguf_portable(Tensor x, Tensor blocks, int type) -> Tensor");
  m.def("dequant_gguf(Tensor blocks, int type, ScalarType dtype) -> Tensor");
  m.def("linear_gguf(Tensor x, Tensor blocks, int type) -> Tensor");
}
TORCH_LIBRARY_IMPL(static_decode_cpu, CPU, m) {
  m.impl("gemv_gguf", &gemv_gguf);
  m.impl("gemv_gguf_portable", &gemv_gguf_portable);
  m.impl("dequant_gguf", &dequant_gguf);
  m.impl("linear_gguf", &linear_gguf);
}
TORCH_LIBRARY_IMPL(static_decode_cpu, Meta, m) {
  m.impl("gemv_gguf", &gemv_gguf_meta);
  m.impl("gemv_gguf_portable", &gemv_gguf_meta);
  m.impl("dequant_gguf", &dequant_gguf_meta);
  m.impl("linear_gguf", &gemv_gguf_meta);
}
