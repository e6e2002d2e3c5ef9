// What every public op checks before it reads or writes anything (rule 6: a refusal names the argument and the
// value, and the cache is exactly as it was). The ops are reachable from Python with any tensors, so nothing the
// kernels index with is trusted: devices, dtypes, ranks, sizes (none zero), the strides the loops rely on, and every
// length against the cache's range. A few comparisons per call (B integer compares for the lengths: they are CPU
// tensors), nothing per key or per weight.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

namespace static_decode_kernels {

constexpr int64_t kMaxRows = 64;  // query rows per KV head the attention takes (its scores buffer)

// The head sizes the attention has code for: these, where they are whole float vectors (16 floats on AVX-512, 8 on
// AVX2 and the portable build). static_decode/cpu_kernel.py's head_dims() mirrors the list for each ISA.
constexpr int64_t kHeadDims[] = {8, 16, 32, 48, 64, 80, 96, 128, 256};

inline bool head_dim_supported(int64_t d) {
  if (d % at::vec::Vectorized<float>::size() != 0) return false;
  for (int64_t h : kHeadDims)
    if (h == d) return true;
  return false;
}

inline void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " is on ", t.device(), "; the kernels run on the CPU");
}

// float32, bfloat16, float16: the dtypes the kernels read and write.
inline bool kernel_float(at::ScalarType s) { return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf; }

// `count` int64 lengths on the CPU, as one contiguous tensor the caller then reads.
inline at::Tensor lengths(const at::Tensor& t, int64_t count, const char* op, const char* name) {
  check_cpu(t, op, name);
  TORCH_CHECK(t.scalar_type() == at::kLong && t.numel() == count, op, ": ", name, " must hold ", count,
              " int64 values (one per row), got ", t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

// A sliding window argument: 0 (none) or the keys a query sees, >= 1.
inline void check_window(int64_t window, const char* op, const char* name) {
  TORCH_CHECK(window >= 0, op, ": ", name, " = ", window, " (0 for no sliding window, else the keys a query sees)");
}

// decode_attention's arguments: q [B, H, M, d], k/v [B, H, S, d] with rows of d contiguous, lens/n_new [B] int64
// with 0 <= n_new[b] <= slots and n_new[b] <= lens[b] <= S (the bounds static_decode.reference refuses outside),
// window >= 0.
// int8_kv: k/v are an int8 cache's codes (decode_attention_int8; their scales checked by check_kv_scales).
inline void check_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& lens, const at::Tensor& n_new, int64_t slots,
                                   int64_t window = 0, bool int8_kv = false) {
  const char* op = int8_kv ? "decode_attention_int8" : "decode_attention";
  check_window(window, op, "window");
  check_cpu(q, op, "q");
  check_cpu(k, op, "k");
  check_cpu(v, op, "v");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must be rank 4, got q ", q.sizes(),
              " k ", k.sizes(), " v ", v.sizes());
  TORCH_CHECK(kernel_float(q.scalar_type()), op, ": q's dtype ", q.scalar_type(), " is not float32/bfloat16/float16");
  if (int8_kv) {
    TORCH_CHECK(k.scalar_type() == at::kChar && v.scalar_type() == at::kChar, op, ": K/V dtypes ", k.scalar_type(),
                "/", v.scalar_type(), " (int8 codes for both)");
  } else {
    TORCH_CHECK(kernel_float(k.scalar_type()) && v.scalar_type() == k.scalar_type(), op, ": K/V dtypes ",
                k.scalar_type(), "/", v.scalar_type(), " (one of float32/bfloat16/float16 for both)");
  }
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k ", k.sizes(), " and v ", v.sizes(), " differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3), op, ": q ", q.sizes(),
              " does not match k ", k.sizes(), " ([B, H, M, d] against [B, H, S, d])");
  TORCH_CHECK(q.size(0) > 0 && q.size(1) > 0 && q.size(2) > 0, op, ": q ", q.sizes(), " has a zero size");
  const int64_t d = q.size(3);
  TORCH_CHECK(head_dim_supported(d), op, ": head_dim ", d, " is not supported (this build takes the multiples of ",
              at::vec::Vectorized<float>::size(), " among 8, 16, 32, 48, 64, 80, 96, 128, 256)");
  TORCH_CHECK(slots >= 1 && q.size(2) % slots == 0 && q.size(2) <= kMaxRows, op, ": ", q.size(2),
              " query rows for slots ", slots, " (a multiple of slots, at most ", kMaxRows, " rows)");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, op, ": k and v rows must be contiguous, got strides ",
              k.strides(), " and ", v.strides());
  const int64_t B = q.size(0), S = k.size(2);
  const auto lc = lengths(lens, B, op, "lens");
  const auto nc = lengths(n_new, B, op, "n_new");
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t* np = nc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(np[b] >= 0 && np[b] <= slots, op, ": n_new[", b, "] = ", np[b], " outside 0..", slots, " (slots)");
    TORCH_CHECK(lp[b] >= np[b] && lp[b] <= S, op, ": lens[", b, "] = ", lp[b], " outside ", np[b], "..", S,
                " (n_new[", b, "]..the keys read)");
  }
}

// An int8 cache's scales for its codes `codes` [B, H, S, d]: float32 [B, H, S] on the CPU, the key axis contiguous
// (one scale per token and KV head; the kernel reads scale j of a row at offset j).
inline void check_kv_scales(const at::Tensor& scales, const at::Tensor& codes, const char* op, const char* name) {
  check_cpu(scales, op, name);
  TORCH_CHECK(scales.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", scales.scalar_type());
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  scales.size(2) == codes.size(2),
              op, ": ", name, " ", scales.sizes(), " must be [B, H, S] of the codes ", codes.sizes());
  TORCH_CHECK(scales.stride(2) == 1 || scales.size(2) <= 1, op, ": ", name, "'s key axis must be contiguous, got strides ",
              scales.strides());
}

}  // namespace static_decode_kernels
