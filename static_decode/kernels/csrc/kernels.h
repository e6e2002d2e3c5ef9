// What one of our CPU kernel files calls in another (decode_layers.cpp calls the attention and the bfloat16 rows):
// plain functions, no dispatcher in between. Built together by static_decode/cpu_kernel.py.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "gguf_blocks.h"

namespace static_decode_kernels {

// decode_attention.cpp: q [B, Hkv, M, d] (M = G * slots query rows per KV head), k/v [B, Hkv, S, d] (rows
// contiguous), lens (counting the chunk) / n_new [B] int64, a sliding window of `window` keys (0: none)
// -> [B, Hkv, M, d] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                            const at::Tensor& n_new, int64_t slots, double scale, int64_t window);

// A float cache's rows as decode_attention reads them, without a tensor view: [B, H, S, d] from element pointers k
// and v, strides in elements (rows of d contiguous). decode_layers.cpp makes one per layer from the layers' cache.
struct KVRows {
  const void* k;
  const void* v;
  at::ScalarType dtype;  // float32, bfloat16 or float16, both
  int64_t S, d;
  int64_t kb, kh, ks, vb, vh, vs;  // strides of b, h and the key row
};

// decode_attention over `kv` (checked by the caller as check_decode_attention checks k and v) without a tensor on
// either side: float32 queries q [B, H, M, kv.d] (values of the model's dtype; bf16_q: bfloat16 ones), lens /
// n_new [B], the output [B, H, M, kv.d] written at `out` (O: float or at::BFloat16), and the work items' partial
// results in `scratch`, grown as needed and reused across calls: a decode layer's attention allocates nothing.
template <typename O>
void decode_attention_into(const float* q, bool bf16_q, const KVRows& kv, const int64_t* lens, const int64_t* n_new,
                           int64_t B, int64_t H, int64_t M, int64_t slots, double scale, int64_t window,
                           std::vector<float>& scratch, O* out);

// decode_attention_int8.cpp: the same over an int8 cache, k/v [B, Hkv, S, d] int8 codes and k_scale/v_scale
// [B, Hkv, S] float32 (value = code * scale; static_decode/core/kv_quant.py), read in place.
at::Tensor decode_attention_int8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& lens,
                                 const at::Tensor& n_new, int64_t slots, double scale, int64_t window);

// Which inner loops this build has for the one-row products: AVX512-BF16's dot product (gemv_bf16.cpp), AVX512-VNNI's
// (gemv_quant.cpp), or AVX2's widening and byte products (gemv_avx2.cpp) where neither is there.
#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512BF16__) && defined(__AVX512VNNI__))
#define STATIC_DECODE_AVX2 1
#else
#define STATIC_DECODE_AVX2 0
#endif
#if defined(__AVX512BF16__) || STATIC_DECODE_AVX2
#define STATIC_DECODE_BF16_ROWS 1
// gemv_bf16.cpp: rows [n0, n1) of bfloat16 W [N, K] times the bfloat16 row x [K], float32 sums into y[n0..n1).
void bf16_rows(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, float* y);
#else
#define STATIC_DECODE_BF16_ROWS 0
#endif

// gemv_quant.cpp: whether the one-row products take the rows per step and prefetch measured fastest on AMD's cores
// (else the AMX Xeon's); $STATIC_DECODE_ROW_PLAN ("amd" or "intel") forces either, so that both run in tests.
bool amd_row_plan();

// gemv_quant.cpp: one-row products with quantized weights (static_decode/quant.py's formats).
struct QuantMat {
  const void* q;     // int8 [N, K], or int4 packed uint8 [N, K / 2]
  const void* s;     // int8: scales [N]; int4: (scale, offset) pairs [N, K / group, 2]; float32 or bfloat16
  int64_t bits;      // 8 or 4
  int64_t group;     // int4's group size (32, 64, 128); 0 for int8
  bool bf16_scales;  // scales in bfloat16 (else float32)
  bool bf16_row;     // the row it multiplies is bfloat16 (quant_mat: as the scales; int4 then takes the bf16 path)
  int64_t gguf = 0;       // else a GGUF block type (gguf_blocks.h): q its blocks, row_bytes a row, no scales
  int64_t row_bytes = 0;
};
// A bfloat16's bits as float32 (its upper half), and scale i of a quantized weight (float32 or bfloat16 scales).
inline float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float scale_at(const QuantMat& m, int64_t i) {
  return m.bf16_scales ? bf16_to_float(static_cast<const uint16_t*>(m.s)[i]) : static_cast<const float*>(m.s)[i];
}
struct QuantRow {  // the row x [K] as the products read it: prepare_row
  int64_t K = 0;
  const float* xf = nullptr;     // float32 values
  const uint16_t* xb = nullptr;  // bfloat16 bits
  const float* xsum = nullptr;   // sums of xf in groups of the int4 group size
  // int8 codes of the row (int8_dot_path): per chunk of 64 values, 64 codes (zero past K), then for each of the 16
  // int32 lanes a VNNI dot product fills, the block's scale and its correction -16 * (sum of the block's codes)
  const int8_t* a8 = nullptr;
  const float* a8d = nullptr;
  const int32_t* a8fix = nullptr;
  const float* a4d = nullptr;    // int4: a8d with the upper 8 lanes of each chunk over 16
  const float* a8grp = nullptr;  // int4: per group, the sum over its blocks of d * (sum of the block's codes)
  const float* a4blk = nullptr;  // int4 group 32: each block's d (over 16 for the odd blocks, as a4d has them)
  // int4 group 32: a8 with each 128 values' middle 64 codes' halves swapped, so 64 codes a vector line up with the
  // low (then the high) nibbles of 64 packed bytes: the columns 128p + [0, 32) and + [64, 96), then + [32, 64) and
  // + [96, 128)
  const int8_t* a4pair = nullptr;
  const float* ablk = nullptr;   // AVX2 (gemv_avx2.cpp): each block's d, one float a block of kRowBlock8 codes
  std::vector<float> f, sums, d8, d4, grp8, blk4, blkd;
  std::vector<uint16_t> b;
  std::vector<int8_t> q8, q4;
  std::vector<int32_t> fix8;
  gguf::Row g;  // GGUF blocks' products: the row's codes (gguf::quantize_row)
};
// `int8`: the row is also quantized to int8 in blocks of kRowBlock8 values (int8_dot_path).
void prepare_row(const float* x, int64_t K, int64_t group, bool bf16, QuantRow& row, bool int8 = false);
// prepare_row in parts, so that threads can share a row's preparation: prepare_row_size once (the buffers, zeroed),
// then prepare_row_part over ranges [k0, k1) covering [0, K), each starting at a multiple of kRowPart (and ending at
// one, or at K), from any thread; nothing is read across parts. x: the row's float32 values (x[k0..k1) read).
constexpr int64_t kRowPart = 128;
void prepare_row_size(int64_t K, int64_t group, QuantRow& row, bool int8 = false);
void prepare_row_part(const float* x, int64_t k0, int64_t k1, int64_t group, bool bf16, QuantRow& row,
                      bool int8 = false);
bool int4_bf16_path(const QuantMat& m);  // whether m's products round the row to bfloat16 (prepare_row's bf16)
// Whether m's products multiply int8 codes of the row (prepare_row's int8): a bfloat16 row times int8 weights, or
// int4 weights with bfloat16 scales, on a CPU with AVX512-VNNI.
bool int8_dot_path(const QuantMat& m);
constexpr int64_t kRowBlock8 = 32;  // values per scale of the row's int8 codes (llama.cpp's Q8_0 block)
// Rows [n0, n1) of m times the row into y[n0..n1) (float32 sums, scales applied).
void quant_rows(const QuantMat& m, const QuantRow& x, int64_t n0, int64_t n1, float* y);
int64_t quant_block(const QuantMat& m);  // rows per inner step: split the rows across threads in multiples of it
// Checks a quantized weight (qweight, scales, group: 0 for int8) of [N, K] (N or K < 0: whatever it has) for `op`,
// naming `name`, and returns its QuantMat; the weight's N and K in *N and *K.
QuantMat quant_mat(const at::Tensor& q, const at::Tensor& s, int64_t group, const char* op, const char* name,
                   int64_t* N, int64_t* K);
// Rows [n0, n1) of m's weight [N, K] at `out` (rows n0.. from its start) in `dtype` (float32 or bfloat16): each value
// computed in float32 and rounded once, the weight the several-row products multiply by (dequant_q's values).
void dequant_rows_into(const QuantMat& m, int64_t K, int64_t n0, int64_t n1, at::ScalarType dtype, void* out);

// linear_quant.cpp: y [M, N] = x [M, K] W^T for a weight that `dequant(n0, n1, out)` writes rows [n0, n1) of, in x's
// dtype, into `out`: a block of rows at a time, each into a buffer that stays in L2, then the float GEMM there
// (linear_q's and linear_gguf's several-row products).
at::Tensor linear_by_row_blocks(const at::Tensor& x, int64_t N, int64_t K,
                                const std::function<void(int64_t, int64_t, void*)>& dequant);

#if STATIC_DECODE_AVX2
// gemv_avx2.cpp: the AVX2 loops, which the files above call where their own ISA's are missing.
namespace avx2 {
void bf16_rows(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, float* y);
// Quantized rows [n0, n1) times the row's int8 codes (a8, ablk; int4: a8grp too) into y (scales applied).
void int8_rows(const QuantMat& m, const QuantRow& x, int64_t n0, int64_t n1, float* y);
void int4_rows(const QuantMat& m, const QuantRow& x, int64_t n0, int64_t n1, float* y);
// The row's int8 codes: row_size sizes them (zeroed) and points the row at them; quantize_row fills the blocks of
// values [k0, k1) (prepare_row_part's parts).
void row_size(int64_t K, int64_t group, QuantRow& row);
void quantize_row(const float* x, int64_t k0, int64_t k1, int64_t group, QuantRow& row);
// The row rounded to bfloat16 (row.b; row.f: the rounded values where `bf16`, else x's), values [k0, k1).
void round_bf16(const float* x, int64_t k0, int64_t k1, bool bf16, QuantRow& row);
}  // namespace avx2
#endif

}  // namespace static_decode_kernels
