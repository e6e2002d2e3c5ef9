// What one of our CPU kernel files calls in another (decode_layers.cpp calls the attention and the bfloat16 rows):
// plain functions, no dispatcher in between. Built together by static_decode/cpu_kernel.py.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace static_decode_kernels {

// decode_attention.cpp: q [B, Hkv, M, d] (M = G * slots query rows per KV head), k/v [B, Hkv, S, d] (rows
// contiguous), lens (counting the chunk) / n_new [B] int64 -> [B, Hkv, M, d] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                            const at::Tensor& n_new, int64_t slots, double scale);

#if defined(__AVX512BF16__)
// gemv_bf16.cpp: rows [n0, n1) of bfloat16 W [N, K] times the bfloat16 row x [K], float32 sums into y[n0..n1).
void bf16_rows(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, float* y);
#endif

}  // namespace static_decode_kernels
