// One-row products with weight-only quantized weights (static_decode/quant.py's formats): y[n] = sum_k W[n, k] x[k]
// where W is int8 with one scale per row, or int4 in groups along K with a scale and an offset per group.
// Built with the other kernels by static_decode/cpu_kernel.py; decode_layers.cpp calls `quant_rows` directly.
//
// Why: a batch-1 decode step reads every weight once, so its projections take the weight bytes over the rate they
// are read at. torch's own CPU kernels (aten._weight_int8pack_mm, _weight_int4pack_mm_for_cpu) read int8 at half
// the rate our bfloat16 GEMV reads bfloat16 (profiles/RESULTS.md, "Quantized weights"): the smaller weights saved
// nothing. Here each weight is read once, widened in registers, and multiplied by the row:
//
// * int8: 16 codes widened to float32 (two instructions) and one FMA against the float32 row, 8 rows at once with
//   the next 8 prefetched (gemv_bf16.cpp's loop), the row's scale applied once to its sum.
// * int8 with a bfloat16 row on a CPU with AVX512-VNNI (int8_dot_path): the row is quantized once per call to int8
//   codes in blocks of 32 (d = max|x| / 127, codes x / d rounded to nearest even, as llama.cpp's Q8_0 quantizes
//   activations), and one vpdpbusd adds 64 code products. It multiplies unsigned by signed bytes, so the weight's
//   codes go in with their sign bit flipped (q + 128) and each int32 lane starts at -16 * (its block's row codes'
//   sum), which makes a block's lanes sum to exactly sum q * a; the lanes are then scaled by their block's d. Four
//   instructions per 64 codes where widening takes twelve: at a large model's size the widening, not the memory,
//   was the bound.
// * int4 with a bfloat16 row (a bfloat16 model, AVX512-BF16): a code q (0..15) OR'ed into the bits of bfloat16
//   128.0 is the bfloat16 value 128 + q exactly, so 32 codes become bfloat16 with two bit operations and take the
//   dot-product instruction like bfloat16 weights. sum_k (128 + q_k) x_k = 128 * sum_k x_k + sum_k q_k x_k, and a
//   group's weights are (q - 8) * s + z, so the group's share is s * dot + (z - 136 s) * sum_k x_k: the row's sums
//   per group are computed once per call and the offset term is one FMA per group.
// * Elsewhere (float32 models, CPUs without AVX-512): the same math with the codes widened to float32.
//
// int4 layout (quant.py, pack_int4): row n is K / 2 bytes; columns come in chunks of 64, and byte j of chunk c holds
// column 64c + j in its low nibble and 64c + 32 + j in its high nibble, so a chunk's 32 bytes widen to two runs of
// 32 consecutive columns. Scales [N, K / group, 2]: (s, z) per group, in the model's dtype.
#include <torch/library.h>

#include "checks.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using static_decode_kernels::QuantMat;
using static_decode_kernels::QuantRow;
using static_decode_kernels::bf16_to_float;
using static_decode_kernels::check_cpu;
using static_decode_kernels::scale_at;

constexpr int64_t kRows8 = 8;  // int8 rows per inner step: independent accumulators and load streams
constexpr int64_t kRows4 = 4;  // int4 rows per inner step
// Prefetch distance (int8_rows, int4_block): a block of rows is one contiguous run of bytes, read as kRows
// interleaved streams; each step prefetches the lines it consumes this many bytes further on. Short rows (SmolLM2's
// K = 576 bytes of int8) leave the hardware prefetcher too little of each stream to learn: without this the int8
// loop read 6-7 GB/s on one Zen 4 core, with it 20-26 (profiles/RESULTS.md, "Quantized one-row kernels").
constexpr int64_t kAhead = 8192;
// The VNNI loops' rows per step and prefetch, measured on the 3B shape's 8192 x 3072 and 3072 x 8192 weights
// (profiles/RESULTS.md, "int8 dot products" and "the quantized products on Zen 5"), differ by CPU:
// * int8 (int8_block_vnni): on the AMX Xeon 4 rows, each row's bytes prefetched in the next block at the column being
//   read, read at 0.93-0.98 of the bfloat16 GEMV's rate (8 rows 0.8). On a Zen 5 that read 0.86-0.91; 2 rows with one
//   linear run 16 KB ahead of the block 1.00-1.05 on two threads (3 rows 0.94-1.04, 4 rows 0.88-1.02).
// * int4 group 32: on the Zen 5 two chunks a step (int4_pair_vnni), 2 rows, a linear run 8 KB ahead (2 KB 0.92, 4 KB
//   1.05, 8 KB 1.09, 16 KB 1.05 of bf16's rate on two threads; 3 rows 0.96-1.06); whole 3B-shape steps 39.8 -> 32.3
//   ms. On the Xeon that loop made the same steps slower (70 -> 90 ms, 2 threads), so it keeps one chunk a step
//   (int4_block_vnni), 2 rows, 4 KB ahead. int4_block_vnni also takes groups 64 and 128: 2 rows on the Xeon, 3 rows
//   8 KB ahead on the Zen 5, where 2 rows ran short of independent work.
constexpr int64_t kRowStream = 4096;  // int4 rows of this many packed bytes or more: each one's two halves side by side
struct QuantPlan {
  int64_t int8_linear;  // 2 rows with a linear run this many bytes ahead of the block; 0: 4 rows, each per row
  int int4_rows;        // int4_block_vnni's
  int64_t int4_ahead;   // bytes; the int4 loops prefetch one linear run ahead
  int64_t pair_ahead;   // int4_pair_vnni's (2 rows)
  bool int4_pair;       // group 32 two chunks a step (int4_pair_vnni), else one (int4_block_vnni)
};
inline const QuantPlan& quant_plan() {
  static const QuantPlan plan = static_decode_kernels::amd_row_plan() ? QuantPlan{16384, 3, 8192, 8192, true}
                                                                       : QuantPlan{0, 2, 4096, 4096, false};
  return plan;
}

// A packed chunk's 32 bytes as its 64 codes in column order (the layout above), as float32.
inline void unpack_chunk(const uint8_t* q, float* out) {
  for (int j = 0; j < 32; ++j) {
    out[j] = static_cast<float>(q[j] & 15);
    out[j + 32] = static_cast<float>(q[j] >> 4);
  }
}

// ---- int8 ---------------------------------------------------------------------------------------------------------
void int8_rows(const QuantMat& m, const float* x, int64_t K, int64_t n0, int64_t n1, float* y) {
  const auto* Q = static_cast<const int8_t*>(m.q);
  int64_t n = n0;
#if defined(__AVX512F__)
  const int64_t body = K / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - body)) - 1);
  const __m512 xt = _mm512_maskz_loadu_ps(tail, x + body);
  const auto widen = [](const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                                   reinterpret_cast<const __m128i*>(p)))); };
  const auto widen_tail = [tail](const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, p)));
  };
  for (; n + kRows8 <= n1; n += kRows8) {
    const int8_t* w = Q + n * K;
    const char* ahead = reinterpret_cast<const char*>(w) + kAhead;
    __m512 a[kRows8];
    for (int r = 0; r < kRows8; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += 16) {
      _mm_prefetch(ahead + k * kRows8, _MM_HINT_T0);  // the 128 bytes this step consumes, kAhead further on
      _mm_prefetch(ahead + k * kRows8 + 64, _MM_HINT_T0);
      const __m512 xv = _mm512_loadu_ps(x + k);
      for (int r = 0; r < kRows8; ++r) a[r] = _mm512_fmadd_ps(widen(w + r * K + k), xv, a[r]);
    }
    for (int r = 0; r < kRows8; ++r) {
      if (body < K) a[r] = _mm512_fmadd_ps(widen_tail(w + r * K + body), xt, a[r]);
      y[n + r] = _mm512_reduce_add_ps(a[r]) * scale_at(m, n + r);
    }
  }
  for (; n < n1; ++n) {
    const int8_t* w = Q + n * K;
    __m512 a = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += 16) a = _mm512_fmadd_ps(widen(w + k), _mm512_loadu_ps(x + k), a);
    if (body < K) a = _mm512_fmadd_ps(widen_tail(w + body), xt, a);
    y[n] = _mm512_reduce_add_ps(a) * scale_at(m, n);
  }
#else
  for (; n < n1; ++n) {  // 8 partial sums a row: a pattern the compiler vectorises without reassociating
    const int8_t* w = Q + n * K;
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
      for (int j = 0; j < 8; ++j) a[j] += static_cast<float>(w[k + j]) * x[k + j];
    float s = 0.f;
    for (int j = 0; j < 8; ++j) s += a[j];
    for (; k < K; ++k) s += static_cast<float>(w[k]) * x[k];
    y[n] = s * scale_at(m, n);
  }
#endif
}

#if defined(__AVX512VNNI__)
// int8 rows [n, n + R) times the row's int8 codes (QuantRow's a8, a8d, a8fix; the scheme above).
template <int R, bool kLinear>
void int8_block_vnni(const QuantMat& m, const QuantRow& x, int64_t n, float* y, int64_t linear) {
  const int64_t K = x.K, body = K / 64;
  const int8_t* Q = static_cast<const int8_t*>(m.q) + n * K;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  // linear 0: each row's bytes are prefetched in the row rows_ahead further on, at the column this step reads, one
  // stream per row as the loop consumes them (on the Xeon a linear run ahead of a 4-row block reached rows 2 and 3
  // after they were read); else one linear run `linear` bytes ahead of the block, R lines a step (quant_plan).
  const int64_t rows_ahead = std::max<int64_t>(R, (kAhead + K - 1) / K);
  const char* ahead = kLinear ? reinterpret_cast<const char*>(Q) + linear
                              : reinterpret_cast<const char*>(Q + rows_ahead * K);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const auto chunk = [&](int64_t c, auto load) {
    const __m512i a = _mm512_loadu_si512(x.a8 + 64 * c);
    const __m512i fix = _mm512_loadu_si512(x.a8fix + 16 * c);
    const __m512 d = _mm512_loadu_ps(x.a8d + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_xor_si512(load(Q + r * K + 64 * c), flip);  // q + 128, unsigned
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(fix, w, a)), d, acc[r]);
    }
  };
  for (int64_t c = 0; c < body; ++c) {
    for (int r = 0; r < R; ++r) _mm_prefetch(ahead + (kLinear ? (c * R + r) * 64 : r * K + c * 64), _MM_HINT_T0);
    chunk(c, [](const int8_t* p) { return _mm512_loadu_si512(p); });
  }
  if (body * 64 < K) {  // the last chunk's codes past K load as zero: 128 after the flip, times a zero row code
    const __mmask64 tail = (1ull << (K - body * 64)) - 1;
    chunk(body, [tail](const int8_t* p) { return _mm512_maskz_loadu_epi8(tail, p); });
  }
  for (int r = 0; r < R; ++r) y[n + r] = _mm512_reduce_add_ps(acc[r]) * scale_at(m, n + r);
}

void int8_rows_vnni(const QuantMat& m, const QuantRow& x, int64_t n0, int64_t n1, float* y) {
  const QuantPlan& plan = quant_plan();
  int64_t n = n0;
  if (plan.int8_linear > 0) {  // AMD's: 2 rows, one linear run
    for (; n + 2 <= n1; n += 2) int8_block_vnni<2, true>(m, x, n, y, plan.int8_linear);
    for (; n < n1; ++n) int8_block_vnni<1, true>(m, x, n, y, plan.int8_linear);
    return;
  }
  for (; n + 4 <= n1; n += 4) int8_block_vnni<4, false>(m, x, n, y, 0);  // the Xeon's: 4 rows, per row
  for (; n + 2 <= n1; n += 2) int8_block_vnni<2, false>(m, x, n, y, 0);
  for (; n < n1; ++n) int8_block_vnni<1, false>(m, x, n, y, 0);
}

// The row's int8 codes for int8_block_vnni: per block of kRowBlock8 values d = max|x| / 127 and codes x / d rounded
// to nearest even (0 where d is 0); a block with a NaN or an infinity gets d NaN, so every sum it enters is NaN.
// quantize_row8_size sizes the buffers (zeroed) and points the row at them; quantize_row8_part fills the blocks of
// values [k0, k1) (k0 a multiple of kRowPart, k1 too or K), so that threads can fill a row's parts side by side.
void quantize_row8_size(int64_t K, int64_t group, QuantRow& row) {
  const int64_t chunks = (K + 63) / 64;
  row.q8.assign(64 * chunks, 0);
  row.d8.assign(16 * chunks, 0.f);
  row.fix8.assign(16 * chunks, 0);
  const bool int4 = group > 0;
  if (int4) {  // the upper lanes' scale over 16 (their codes come in 16 times their value), and per group the sum of
    row.d4.assign(16 * chunks, 0.f);  // d * (sum of codes) over its blocks, and at group 32 each block's d4
    row.grp8.assign(K / group, 0.f);
    row.blk4.assign(group == static_decode_kernels::kRowBlock8 ? K / group : 0, 0.f);
  }
  row.a8 = row.q8.data();
  row.a8d = row.d8.data();
  row.a8fix = row.fix8.data();
  if (int4) {
    row.a4d = row.d4.data();
    row.a8grp = row.grp8.data();
    if (group == static_decode_kernels::kRowBlock8) row.a4blk = row.blk4.data();
    if (group == static_decode_kernels::kRowBlock8 && quant_plan().int4_pair) {  // int4_pair_vnni's order
      row.q4.assign(64 * chunks, 0);
      row.a4pair = row.q4.data();
    }
  }
}

void quantize_row8_part(const float* x, int64_t k0, int64_t k1, int64_t group, QuantRow& row) {
  constexpr int64_t B = static_decode_kernels::kRowBlock8;
  static_assert(B == 32, "two blocks a 64-code chunk, 16 values a vector");
  static_assert(static_decode_kernels::kRowPart % 128 == 0, "parts of whole chunks, pairs and groups");
  const bool int4 = group > 0;
  // the buffers as locals: through the vectors, every store made the compiler reload their pointers
  int8_t* q8 = row.q8.data();
  float* d8 = row.d8.data();
  int32_t* fix8 = row.fix8.data();
  float *d4s = row.d4.data(), *grp8 = row.grp8.data(), *blk4 = row.blk4.data();
  for (int64_t b = k0 / B; b * B < k1; ++b) {
    const int64_t kb = b * B, n = std::min(B, k1 - kb);
    const __mmask16 m0 = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    const __mmask16 m1 = static_cast<__mmask16>(n >= 32 ? 0xFFFF : n > 16 ? (1u << (n - 16)) - 1 : 0);
    const __m512 v0 = _mm512_maskz_loadu_ps(m0, x + kb), v1 = _mm512_maskz_loadu_ps(m1, x + kb + 16);
    const bool finite = !(_mm512_fpclass_ps_mask(v0, 0x99) | _mm512_fpclass_ps_mask(v1, 0x99));  // NaN, +-inf
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
    __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
    if (finite && d > 0.f) {
      const __m512 dv = _mm512_set1_ps(d), lim = _mm512_set1_ps(127.f);
      // cvtps rounds by MXCSR: to nearest even unless someone changed it (nothing in torch does)
      q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_div_ps(v0, dv), -lim), lim));
      q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_div_ps(v1, dv), -lim), lim));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + kb), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + kb + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    // block b fills lanes 8 (b % 2) .. of its chunk's 16: one masked store each (this runs before every product)
    const __mmask16 lanes = static_cast<__mmask16>(b % 2 ? 0xFF00 : 0x00FF);
    _mm512_mask_storeu_ps(d8 + 16 * (b / 2), lanes, _mm512_set1_ps(d));
    _mm512_mask_storeu_epi32(fix8 + 16 * (b / 2), lanes, _mm512_set1_epi32(-16 * sum));
    if (int4) {
      const float d4 = b % 2 ? d * 0.0625f : d;
      _mm512_mask_storeu_ps(d4s + 16 * (b / 2), lanes, _mm512_set1_ps(d4));
      grp8[kb / group] += d * static_cast<float>(sum);  // K is whole groups here (quant_mat checks it)
      if (group == B) blk4[b] = d4;  // group 32: each group is one block; its d4 for int4_scales
    }
  }
  if (row.a4pair != nullptr) {  // int4_pair_vnni's order of the codes: each 128 values' middle halves swapped
    const int64_t end = std::min<int64_t>(static_cast<int64_t>(row.q8.size()), (k1 + 63) / 64 * 64);
    std::memcpy(row.q4.data() + k0, q8 + k0, end - k0);
    for (int64_t p = k0; p + 128 <= k1; p += 128) {
      std::memcpy(row.q4.data() + p + 32, q8 + p + 64, 32);
      std::memcpy(row.q4.data() + p + 64, q8 + p + 32, 32);
    }
  }
}
#endif

// ---- int4 ---------------------------------------------------------------------------------------------------------
// Any CPU, float32 row: the codes widened one by one, each group's dot product scaled, the offset term from the
// row's group sums.
void int4_rows_float(const QuantMat& m, const QuantRow& x, int64_t n0, int64_t n1, float* y) {
  const int64_t K = x.K, G = K / m.group, half = K / 2;
  const auto* Q = static_cast<const uint8_t*>(m.q);
  float codes[64];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = Q + n * half;
    float total = 0.f, dot = 0.f;
    for (int64_t c = 0; c < K / 64; ++c) {
      unpack_chunk(w + 32 * c, codes);
      for (int64_t part = 0; part < 64; part += std::min<int64_t>(m.group, 64)) {  // the chunk's groups
        const int64_t len = std::min<int64_t>(m.group, 64);
        float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int64_t k = 0; k < len; k += 8)
          for (int j = 0; j < 8; ++j) a[j] += codes[part + k + j] * x.xf[64 * c + part + k + j];
        for (int j = 0; j < 8; ++j) dot += a[j];
        const int64_t g = (64 * c + part + len) / m.group - 1;  // the group this run ends in
        if ((64 * c + part + len) % m.group == 0) {  // the group is complete: scale its dot product
          const float s = scale_at(m, (n * G + g) * 2), z = scale_at(m, (n * G + g) * 2 + 1);
          total += s * dot + (z - 8.f * s) * x.xsum[g];
          dot = 0.f;
        }
      }
    }
    y[n] = total;
  }
}

#if defined(__AVX512BF16__)
// Rows [n, n + R)'s int4 scales as float32 into sbuf [R, G] (broadcast from memory in the product loop), and each
// row's offset term sum_g (z_g + zmul * s_g) * sums[g] into acc[r] (the row's sums per group, as its loop needs).
// `dmul` (G values, or null): each scale is stored times it (int4_block_vnni at group 32: the row block's d, so its
// loop multiplies once per chunk and row instead of twice).
template <int R>
void int4_scales(const QuantMat& m, int64_t n, int64_t G, const float* sums, float zmul, float* sbuf, __m512* acc,
                 const float* dmul = nullptr) {
  const auto* S = static_cast<const uint16_t*>(m.s);  // (s, z) bfloat16 pairs [N, G]
  const __m512i zhalf = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  // The scales are a second stream, read here a row block at a time: prefetched kAhead / 4 bytes ahead (at group
  // 32 they are a quarter of the codes' bytes). Without it the loop stalled on the scales' loads (perf annotate:
  // ~15% of its samples on the instruction after them).
  const char* sahead = reinterpret_cast<const char*>(S + n * G * 2) + kAhead / 4;
  for (int64_t b = 0; b < R * G * 4; b += 64) _mm_prefetch(sahead + b, _MM_HINT_T0);
  for (int r = 0; r < R; ++r) {
    __m512 off = _mm512_setzero_ps();  // a local: acc[r] went through memory per group
    const uint32_t* pairs = reinterpret_cast<const uint32_t*>(S + (n + r) * G * 2);  // (s | z << 16) per group
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 mk = static_cast<__mmask16>(G - g >= 16 ? 0xFFFF : (1u << (G - g)) - 1);
      const __m512i p = _mm512_maskz_loadu_epi32(mk, pairs + g);
      const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(p, 16));
      const __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(p, zhalf));
      _mm512_mask_storeu_ps(sbuf + r * G + g, mk,
                            dmul == nullptr ? sv : _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(mk, dmul + g)));
      const __m512 zt = _mm512_fmadd_ps(sv, _mm512_set1_ps(zmul), zv);
      off = _mm512_fmadd_ps(zt, _mm512_maskz_loadu_ps(mk, sums + g), off);
    }
    acc[r] = off;
  }
}

// acc[r] = the offsets `fill` writes into a local array: a product loop's accumulators whose address went to
// int4_scales (out of line) were kept on the stack, every chunk's FMA a store and a reload (perf annotate: a third
// of the int4 loop's samples on that store, ~17 GB/s on one core from L2).
template <int R, typename Fill>
inline void from_scales(__m512* acc, Fill fill) {
  __m512 off[R];
  fill(off);
  for (int r = 0; r < R; ++r) acc[r] = off[r];
}

// A bfloat16 row and bfloat16 scales on a CPU with AVX512-BF16: the 128 + q trick above. `int4_block` takes R rows
// from row n with R a compile-time count, so its accumulators stay in registers (a runtime row count left the loop
// over rows rolled and the accumulators on the stack).
template <int kGroup, int R>
void int4_block(const QuantMat& m, const QuantRow& x, int64_t n, float* sbuf, float* y) {
  const int64_t K = x.K, G = K / kGroup, half = K / 2, C = K / 64;
  const auto* Q = static_cast<const uint8_t*>(m.q);
  const auto* S = static_cast<const uint16_t*>(m.s);  // (s, z) bfloat16 pairs [N, G]
  const __m512i magic = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000F);
  __m512 acc[R], d[R];
  for (int r = 0; r < R; ++r) d[r] = _mm512_setzero_ps();
  from_scales<R>(acc, [&](__m512* off) { int4_scales<R>(m, n, G, x.xsum, -136.f, sbuf, off); });  // z - 136 s
  const char* ahead = reinterpret_cast<const char*>(Q + n * half) + kAhead;
  for (int64_t c = 0; c < C; ++c) {
    _mm_prefetch(ahead + c * 32 * R, _MM_HINT_T0);  // the bytes this step consumes, kAhead further on
    if (R > 2) _mm_prefetch(ahead + c * 32 * R + 64, _MM_HINT_T0);
    const __m512bh xl = (__m512bh)_mm512_loadu_si512(x.xb + 64 * c);
    const __m512bh xh = (__m512bh)_mm512_loadu_si512(x.xb + 64 * c + 32);
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Q + (n + r) * half + 32 * c)));
      const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(w, low, magic, 0xEA);  // (w & 15) | magic
      const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), magic);
      const float* s = sbuf + r * G;
      if constexpr (kGroup == 32) {
        acc[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), lo, xl), _mm512_set1_ps(s[2 * c]), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), hi, xh), _mm512_set1_ps(s[2 * c + 1]),
                                 acc[r]);
      } else {
        d[r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(d[r], lo, xl), hi, xh);
        if ((64 * (c + 1)) % kGroup == 0) {  // the group ends with this chunk
          acc[r] = _mm512_fmadd_ps(d[r], _mm512_set1_ps(s[64 * (c + 1) / kGroup - 1]), acc[r]);
          d[r] = _mm512_setzero_ps();
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) y[n + r] = _mm512_reduce_add_ps(acc[r]);
}

#if defined(__AVX512VNNI__)
// One 32-byte chunk c of a row's codes (q) times the row's int8 codes a: the scheme below (int4_block_vnni), into
// acc (and, groups over 32, dacc until the group ends). s: the row's scales (times d at group 32).
template <int kGroup>
inline void int4_chunk(const uint8_t* q, __m512i a, __m512 dv, const float* s, int64_t c, __m512i nib, __m512& acc,
                       __m512& dacc) {
  const __m512i w = _mm512_and_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))), nib);
  const __m512 v = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a));
  if constexpr (kGroup == 32) {  // s holds s * d: the block's d came in with the scales
    const __m512 sv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[2 * c]), _mm512_set1_ps(s[2 * c + 1]));
    acc = _mm512_fmadd_ps(v, sv, acc);
  } else {
    dacc = _mm512_fmadd_ps(v, dv, dacc);
    if ((64 * (c + 1)) % kGroup == 0) {  // the group ends with this chunk
      acc = _mm512_fmadd_ps(dacc, _mm512_set1_ps(s[64 * (c + 1) / kGroup - 1]), acc);
      dacc = _mm512_setzero_ps();
    }
  }
}

// int4 rows [n, n + R) times the row's int8 codes (int8_dot_path): a chunk's 32 bytes broadcast to both halves of
// a vector and masked, the low nibbles (columns 64c..64c+31) in the lower half and the high ones, 16 times their
// value, in the upper; one vpdpbusd then gives each block's sum q * a in 8 lanes (the upper ones 16 times it, which
// their scale a4d takes back), scaled by the block's d and the group's s. The offset term (z - 8 s) times the row's
// sum per group (a8grp: sum over its blocks of d * sum of codes) comes from int4_scales.
template <int kGroup, int R>
void int4_block_vnni(const QuantMat& m, const QuantRow& x, int64_t n, float* sbuf, float* y, int64_t ahead_bytes) {
  const int64_t K = x.K, G = K / kGroup, half = K / 2, C = K / 64;
  const auto* Q = static_cast<const uint8_t*>(m.q);
  const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8(static_cast<char>(0xF0)), 1);
  __m512 acc[R], dacc[R];
  for (int r = 0; r < R; ++r) dacc[r] = _mm512_setzero_ps();
  from_scales<R>(acc, [&](__m512* off) {  // group 32: s * d
    int4_scales<R>(m, n, G, x.a8grp, -8.f, sbuf, off, kGroup == 32 ? x.a4blk : nullptr);
  });
  const char* ahead = reinterpret_cast<const char*>(Q + n * half) + ahead_bytes;
  for (int64_t c = 0; c < C; ++c) {
    _mm_prefetch(ahead + c * 32 * R, _MM_HINT_T0);  // the bytes this step consumes, ahead_bytes further on
    if (R > 2) _mm_prefetch(ahead + c * 32 * R + 64, _MM_HINT_T0);
    const __m512i a = _mm512_loadu_si512(x.a8 + 64 * c);
    const __m512 dv = kGroup == 32 ? _mm512_setzero_ps() : _mm512_loadu_ps(x.a4d + 16 * c);  // group 32: in sbuf
    for (int r = 0; r < R; ++r)
      int4_chunk<kGroup>(Q + (n + r) * half + 32 * c, a, dv, sbuf + r * G, c, nib, acc[r], dacc[r]);
  }
  for (int r = 0; r < R; ++r) y[n + r] = _mm512_reduce_add_ps(acc[r]);
}

// One long row (kRowStream packed bytes or more: the 3B shape's down projection, K 8192) as two streams side by
// side, its first and second halves, with one linear run ahead_bytes ahead (the next row). Two rows side by side were
// two streams a row apart, each crossing a 4 KB page every row: prefetched per row they read at 0.93-0.96 of the
// bfloat16 GEMV's rate in a standalone copy of the loop, the halves 1.02-1.03 (profiles/RESULTS.md). The halves'
// sums add at the end: a row's sum is that of its two halves.
template <int kGroup>
void int4_row_halves_vnni(const QuantMat& m, const QuantRow& x, int64_t n, float* sbuf, float* y,
                          int64_t ahead_bytes) {
  const int64_t K = x.K, G = K / kGroup, half = K / 2, C = K / 64, H = C / 2;
  const auto* Q = static_cast<const uint8_t*>(m.q) + n * half;
  const __m512i nib = _mm512_inserti64x4(_mm512_set1_epi8(0x0F), _mm256_set1_epi8(static_cast<char>(0xF0)), 1);
  __m512 acc[2], dacc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  from_scales<1>(acc, [&](__m512* off) {  // the whole row's offset term, in the first half's sum
    int4_scales<1>(m, n, G, x.a8grp, -8.f, sbuf, off, kGroup == 32 ? x.a4blk : nullptr);
  });
  acc[1] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(Q) + ahead_bytes;
  for (int64_t c = 0; c < H; ++c) {
    _mm_prefetch(ahead + c * 64, _MM_HINT_T0);  // the 64 bytes this step consumes, ahead_bytes further on
    for (int r = 0; r < 2; ++r) {
      const int64_t cc = c + r * H;  // this half's chunk
      const __m512 dv = kGroup == 32 ? _mm512_setzero_ps() : _mm512_loadu_ps(x.a4d + 16 * cc);
      int4_chunk<kGroup>(Q + 32 * cc, _mm512_loadu_si512(x.a8 + 64 * cc), dv, sbuf, cc, nib, acc[r], dacc[r]);
    }
  }
  y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}

// Group 32, two chunks a step: a row's 64 packed bytes (one cache line) give its low nibbles (columns 128p + [0, 32)
// and + [64, 96)) and its high nibbles, 16 times their value, by one AND each; the row's codes in that order
// (a4pair) make one vpdpbusd per 64 columns where int4_block_vnni broadcasts each half line and masks it. A vector's
// lanes are then groups 4p and 4p + 2 (low) or 4p + 1 and 4p + 3 (high): their four scales (times d, sbuf) come in
// with one 16-byte broadcast and an in-lane permute each.
// Kept out of line: inlined beside the Xeon's int4_block_vnni, SmolLM2's int4 steps there ran 4-11% slower.
template <int R>
__attribute__((noinline)) void int4_pair_vnni(const QuantMat& m, const QuantRow& x, int64_t n, float* sbuf, float* y,
                                              int64_t ahead_bytes) {
  const int64_t K = x.K, G = K / 32, half = K / 2, P = K / 128;
  const auto* Q = static_cast<const uint8_t*>(m.q);
  const __m512i lo_mask = _mm512_set1_epi8(0x0F), hi_mask = _mm512_set1_epi8(static_cast<char>(0xF0));
  const __m512i sel_lo = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i sel_hi = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[R], acc2[R];
  for (int r = 0; r < R; ++r) acc2[r] = _mm512_setzero_ps();
  from_scales<R>(acc, [&](__m512* off) { int4_scales<R>(m, n, G, x.a8grp, -8.f, sbuf, off, x.a4blk); });  // s * d
  const char* ahead = reinterpret_cast<const char*>(Q + n * half) + ahead_bytes;
  for (int64_t p = 0; p < P; ++p) {
    for (int r = 0; r < R; ++r) _mm_prefetch(ahead + (p * R + r) * 64, _MM_HINT_T0);
    const __m512i alo = _mm512_loadu_si512(x.a4pair + 128 * p);
    const __m512i ahi = _mm512_loadu_si512(x.a4pair + 128 * p + 64);
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_loadu_si512(Q + (n + r) * half + 64 * p);
      const __m512 vlo = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                                _mm512_and_si512(w, lo_mask), alo));
      const __m512 vhi = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                                                _mm512_and_si512(w, hi_mask), ahi));
      const __m512 s4 = _mm512_broadcast_f32x4(_mm_loadu_ps(sbuf + r * G + 4 * p));
      acc[r] = _mm512_fmadd_ps(vlo, _mm512_permutevar_ps(s4, sel_lo), acc[r]);
      acc2[r] = _mm512_fmadd_ps(vhi, _mm512_permutevar_ps(s4, sel_hi), acc2[r]);
    }
  }
  if (P * 128 < K) {  // an odd last chunk: int4_block_vnni's step
    const int64_t c = 2 * P;
    const __m512i nib = _mm512_inserti64x4(lo_mask, _mm256_set1_epi8(static_cast<char>(0xF0)), 1);
    const __m512i a = _mm512_loadu_si512(x.a8 + 64 * c);
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_and_si512(_mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Q + (n + r) * half + 32 * c))), nib);
      const __m512 v = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, a));
      const float* s = sbuf + r * G;
      const __m512 sv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[2 * c]), _mm512_set1_ps(s[2 * c + 1]));
      acc[r] = _mm512_fmadd_ps(v, sv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[n + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc2[r]));
}
#endif

template <int kGroup>
void int4_rows_bf16(const QuantMat& m, const QuantRow& x, int64_t n0, int64_t n1, float* y) {
  std::vector<float> sbuf(kRows4 * (x.K / kGroup));  // a block's scales as float32
  int64_t n = n0;
#if defined(__AVX512VNNI__)
  if (x.a8 != nullptr) {
    const QuantPlan& plan = quant_plan();
    if (kGroup == 32 && plan.int4_pair) {
      for (; n + 2 <= n1; n += 2) int4_pair_vnni<2>(m, x, n, sbuf.data(), y, plan.pair_ahead);
    } else {
      if (plan.int4_rows == 3)
        for (; n + 3 <= n1; n += 3) int4_block_vnni<kGroup, 3>(m, x, n, sbuf.data(), y, plan.int4_ahead);
      if (x.K / 2 >= kRowStream && (x.K / 2) % kGroup == 0 && (x.K / 64) % 2 == 0)
        for (; n < n1; ++n) int4_row_halves_vnni<kGroup>(m, x, n, sbuf.data(), y, plan.int4_ahead);
      for (; n + 2 <= n1; n += 2) int4_block_vnni<kGroup, 2>(m, x, n, sbuf.data(), y, plan.int4_ahead);
    }
    for (; n < n1; ++n) int4_block_vnni<kGroup, 1>(m, x, n, sbuf.data(), y, plan.int4_ahead);
    return;
  }
#endif
  for (; n + kRows4 <= n1; n += kRows4) int4_block<kGroup, kRows4>(m, x, n, sbuf.data(), y);
  for (; n < n1; ++n) int4_block<kGroup, 1>(m, x, n, sbuf.data(), y);
}
#endif

}  // namespace

// The row a quantized product reads, prepared once per call (QuantRow): float32 and bfloat16 copies and the sums of
// its values in groups of `group`; `bf16`: the row is rounded to bfloat16 first (the int4 bfloat16 path reads it so).
void static_decode_kernels::prepare_row(const float* x, int64_t K, int64_t group, bool bf16, QuantRow& row,
                                        bool int8) {
  prepare_row_size(K, group, row, int8);
  prepare_row_part(x, 0, K, group, bf16, row, int8);
}

void static_decode_kernels::prepare_row_size(int64_t K, int64_t group, QuantRow& row, bool int8) {
#if !defined(__AVX512VNNI__) && !STATIC_DECODE_AVX2
  TORCH_CHECK(!int8, "prepare_row: int8 row codes need AVX512-VNNI or AVX2");
#endif
  row.K = K;
  row.f.resize(K);
  row.b.resize(K);
  // The sums per group, for the products that take the row in float32 or bfloat16 (int4_rows_float, int4_block);
  // those over the row's int8 codes (int8 set) use the codes' own sums (a8grp), so that pass is skipped there.
  row.sums.assign(group > 0 && !int8 ? K / group : 0, 0.f);  // K is whole groups (quant_mat checks it)
  row.xf = row.f.data();
  row.xb = row.b.data();
  row.xsum = row.sums.empty() ? nullptr : row.sums.data();
  row.a8 = nullptr;
  row.a4blk = nullptr;
  row.a4pair = nullptr;
  row.ablk = nullptr;
#if defined(__AVX512VNNI__)
  if (int8) quantize_row8_size(K, group, row);
#elif STATIC_DECODE_AVX2
  if (int8) avx2::row_size(K, group, row);
#endif
}

void static_decode_kernels::prepare_row_part(const float* x, int64_t k0, int64_t k1, int64_t group, bool bf16,
                                             QuantRow& row, bool int8) {
  int64_t k = k0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // 16 values a step, each rounded as c10::BFloat16 rounds it (to nearest even on the bits, NaN to 0x7FC0): this
  // runs before every product, and a value at a time it cost an int4 product more than its 8 rows.
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), qnan = _mm512_set1_epi32(0x7FC0);
  uint16_t* rb = row.b.data();  // locals: through the vectors, each store reloaded their pointers
  float* rf = row.f.data();
  for (; k + 16 <= k1; k += 16) {
    const __m512 v = _mm512_loadu_ps(x + k);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_fpclass_ps_mask(v, 0x81), qnan);  // QNaN | SNaN
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rb + k), _mm512_cvtepi32_epi16(r));
    _mm512_storeu_ps(rf + k, bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)) : v);
  }
#elif STATIC_DECODE_AVX2
  avx2::round_bf16(x, k0, k1, bf16, row);
  k = k1;
#endif
  for (; k < k1; ++k) {
    const c10::BFloat16 r(x[k]);
    row.b[k] = r.x;
    row.f[k] = bf16 ? static_cast<float>(r) : x[k];  // the bfloat16 path's sums are of the values it multiplies
  }
  if (!row.sums.empty()) {  // the groups of this part (row.sums is sized only where group > 0)
    for (int64_t g = k0 / group; g * group < k1; ++g) {
      float sum = 0.f;
      for (int64_t j = g * group; j < (g + 1) * group; ++j) sum += row.f[j];
      row.sums[g] = sum;
    }
  }
#if defined(__AVX512VNNI__)
  if (int8) quantize_row8_part(row.xf, k0, k1, group, row);
#elif STATIC_DECODE_AVX2
  if (int8) avx2::quantize_row(row.xf, k0, k1, group, row);
#endif
}

bool static_decode_kernels::amd_row_plan() {
  const char* e = std::getenv("STATIC_DECODE_ROW_PLAN");
  if (e == nullptr || *e == '\0') return __builtin_cpu_is("amd");
  TORCH_CHECK(std::strcmp(e, "amd") == 0 || std::strcmp(e, "intel") == 0, "STATIC_DECODE_ROW_PLAN is '", e,
              "' (amd or intel)");
  return std::strcmp(e, "amd") == 0;
}

bool static_decode_kernels::int8_dot_path(const QuantMat& m) {
#if defined(__AVX512VNNI__)
  if (m.bits == 8) return m.bf16_row;
#if defined(__AVX512BF16__)
  return m.bf16_row && m.bf16_scales && (m.group == 32 || m.group == 64 || m.group == 128);  // int4_block_vnni's
#else
  return false;
#endif
#elif STATIC_DECODE_AVX2
  return m.bf16_row && (m.bits == 8 || m.bf16_scales);  // avx2::int8_rows, avx2::int4_rows
#else
  return false;
#endif
}

bool static_decode_kernels::int4_bf16_path(const QuantMat& m) {
#if defined(__AVX512BF16__)
  return m.bits == 4 && m.bf16_scales && m.bf16_row;
#else
  return false;
#endif
}

void static_decode_kernels::quant_rows(const QuantMat& m, const QuantRow& x, int64_t n0, int64_t n1, float* y) {
  if (m.gguf != 0) {  // GGUF blocks (gguf_blocks.h), times the row's codes there
    gguf::rows(m.gguf, static_cast<const uint8_t*>(m.q), m.row_bytes, x.g, n0, n1, y);
    return;
  }
#if defined(__AVX512VNNI__)
  if (m.bits == 8 && x.a8 != nullptr) return int8_rows_vnni(m, x, n0, n1, y);
#elif STATIC_DECODE_AVX2
  if (x.a8 != nullptr) return m.bits == 8 ? avx2::int8_rows(m, x, n0, n1, y) : avx2::int4_rows(m, x, n0, n1, y);
#endif
  if (m.bits == 8) return int8_rows(m, x.xf, x.K, n0, n1, y);
#if defined(__AVX512BF16__)
  if (int4_bf16_path(m)) {
    switch (m.group) {
      case 32: return int4_rows_bf16<32>(m, x, n0, n1, y);
      case 64: return int4_rows_bf16<64>(m, x, n0, n1, y);
      case 128: return int4_rows_bf16<128>(m, x, n0, n1, y);
      default: break;
    }
  }
#endif
  int4_rows_float(m, x, n0, n1, y);
}

int64_t static_decode_kernels::quant_block(const QuantMat& m) { return m.bits == 8 ? kRows8 : kRows4; }

QuantMat static_decode_kernels::quant_mat(const at::Tensor& q, const at::Tensor& s, int64_t group, const char* op,
                                          const char* name, int64_t* N, int64_t* K) {
  check_cpu(q, op, name);
  check_cpu(s, op, name);
  TORCH_CHECK(group == 0 || group == 32 || group == 64 || group == 128, op, ": ", name, ": group ", group,
              " (0 for int8; 32, 64 or 128 for int4)");
  TORCH_CHECK(s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16, op, ": ", name,
              "'s scales are ", s.scalar_type(), " (float32 or bfloat16)");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && s.is_contiguous() && q.size(0) > 0 && q.size(1) > 0, op, ": ",
              name, ": a quantized weight is a contiguous [N, K] (int8) or [N, K / 2] (int4) matrix, got ",
              q.sizes(), " with scales ", s.sizes());
  const int64_t n = q.size(0);
  if (group == 0) {
    TORCH_CHECK(q.scalar_type() == at::kChar, op, ": ", name, ": int8 codes must be int8, got ", q.scalar_type());
    TORCH_CHECK(s.dim() == 1 && s.size(0) == n, op, ": ", name, ": int8 scales must be [", n, "], got ", s.sizes());
    *K = q.size(1);
  } else {
    const int64_t k = 2 * q.size(1);
    TORCH_CHECK(q.scalar_type() == at::kByte, op, ": ", name, ": int4 codes must be packed uint8, got ",
                q.scalar_type());
    TORCH_CHECK(k % 64 == 0 && k % group == 0, op, ": ", name, ": int4 takes K a multiple of 64 and of the group ",
                group, ", got K ", k);
    TORCH_CHECK(s.dim() == 3 && s.size(0) == n && s.size(1) == k / group && s.size(2) == 2, op, ": ", name,
                ": int4 scales must be [", n, ", ", k / group, ", 2], got ", s.sizes());
    *K = k;
  }
  *N = n;
  const bool bf16 = s.scalar_type() == at::kBFloat16;
  return QuantMat{q.data_ptr(), s.data_ptr(), group == 0 ? 8 : 4, group, bf16, bf16};
}

namespace {

// x [..., K] one row (every other size 1) times the quantized weight -> [N] in x's dtype.
at::Tensor gemv_q(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  constexpr const char* op = "gemv_q";
  int64_t N = 0, K = 0;
  const QuantMat m = static_decode_kernels::quant_mat(qweight, scales, group, op, "the weight", &N, &K);
  static_decode_kernels::check_cpu(x, op, "x");
  TORCH_CHECK(static_decode_kernels::kernel_float(x.scalar_type()) || x.scalar_type() == at::kDouble, op,
              ": x's dtype ", x.scalar_type(), " is not float32/bfloat16/float16/float64");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && x.numel() == K, op, ": x ", x.sizes(), " is not one row of the ",
              K, " values the weight's columns take");
  const auto xf = x.reshape({K}).to(at::kFloat).contiguous();
  // The bfloat16 path rounds the row to bfloat16: exact for a bfloat16 row (a bfloat16 model's); any other row
  // takes the float32 path, whatever the scales' dtype.
  QuantMat mm = m;
  mm.bf16_row = x.scalar_type() == at::kBFloat16;
  QuantRow row;
  static_decode_kernels::prepare_row(xf.data_ptr<float>(), K, group, static_decode_kernels::int4_bf16_path(mm), row,
                                     static_decode_kernels::int8_dot_path(mm));
  auto yf = at::empty({N}, x.options().dtype(at::kFloat));
  float* yp = yf.data_ptr<float>();
  const int64_t block = static_decode_kernels::quant_block(m);
  at::parallel_for(0, (N + block - 1) / block, 4, [&](int64_t b, int64_t e) {
    static_decode_kernels::quant_rows(mm, row, b * block, std::min(N, e * block), yp);
  });
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

at::Tensor gemv_q_meta(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales, int64_t group) {
  return at::empty({qweight.size(0)}, x.options());
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 float32 values into out[0..16) in T, each rounded once: bfloat16 with AVX512-BF16's conversion (to nearest
// even, as c10::BFloat16; it reads a denormal float32 as zero, which no product of a code and a normal scale is).
template <typename T>
inline void store16(T* out, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(out, v);
  } else {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
#else
    alignas(64) float f[16];
    _mm512_store_ps(f, v);
    at::vec::convert(f, out, 16);
#endif
  }
}
#endif

// Row n of the weight in T, each value computed in float32 and rounded once: q * s (int8), fma(q - 8, s, z) (int4;
// exact before the rounding). One pass from the codes to the output: 16 codes a vector widened from bytes; the
// byte-by-byte unpack into a float32 row and a second rounding pass over it took ~2x as long.
template <typename T>
void dequant_row(const QuantMat& m, int64_t n, int64_t K, float* f, T* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (m.bits == 8) {
    const int8_t* q = static_cast<const int8_t*>(m.q) + n * K;
    const __m512 s = _mm512_set1_ps(scale_at(m, n));
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
      store16(out + k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s));
    }
    for (; k < K; ++k) out[k] = static_cast<T>(static_cast<float>(q[k]) * scale_at(m, n));
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(m.q) + n * K / 2;
  const int64_t G = K / m.group;
  const __m256i low = _mm256_set1_epi8(15);
  for (int64_t c = 0; c < K / 64; ++c) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
    const __m256i halves[2] = {_mm256_and_si256(w, low), _mm256_and_si256(_mm256_srli_epi16(w, 4), low)};
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 2; ++j) {  // a 16-column run never straddles a group (groups are multiples of 32)
        const int64_t col = 64 * c + 32 * h + 16 * j, g = col / m.group;
        const __m128i b = j ? _mm256_extracti128_si256(halves[h], 1) : _mm256_castsi256_si128(halves[h]);
        const __m512 v = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), _mm512_set1_ps(8.f));
        const float s = scale_at(m, (n * G + g) * 2), z = scale_at(m, (n * G + g) * 2 + 1);
        store16(out + col, _mm512_fmadd_ps(v, _mm512_set1_ps(s), _mm512_set1_ps(z)));
      }
    }
  }
#else
  if (m.bits == 8) {
    const int8_t* q = static_cast<const int8_t*>(m.q) + n * K;
    const float s = scale_at(m, n);
    for (int64_t k = 0; k < K; ++k) f[k] = static_cast<float>(q[k]) * s;
  } else {
    const uint8_t* q = static_cast<const uint8_t*>(m.q) + n * K / 2;
    const int64_t G = K / m.group;
    for (int64_t c = 0; c < K / 64; ++c) unpack_chunk(q + 32 * c, f + 64 * c);
    for (int64_t g = 0; g < G; ++g) {
      const float s = scale_at(m, (n * G + g) * 2), z = scale_at(m, (n * G + g) * 2 + 1);
      float* p = f + g * m.group;
      for (int64_t j = 0; j < m.group; ++j) p[j] = std::fma(p[j] - 8.f, s, z);
    }
  }
  if constexpr (std::is_same_v<T, float>) std::memcpy(out, f, K * sizeof(float));
  else at::vec::convert(f, out, K);
#endif
}

}  // namespace

void static_decode_kernels::dequant_rows_into(const QuantMat& m, int64_t K, int64_t n0, int64_t n1,
                                              at::ScalarType dtype, void* out) {
  std::vector<float> f(K);  // the portable path's row in float32
  for (int64_t n = n0; n < n1; ++n) {
    if (dtype == at::kFloat) dequant_row<float>(m, n, K, f.data(), static_cast<float*>(out) + (n - n0) * K);
    else dequant_row<at::BFloat16>(m, n, K, f.data(), static_cast<at::BFloat16*>(out) + (n - n0) * K);
  }
}

namespace {

// The weight [N, K] in `dtype` (float32 or bfloat16): (q - 8) * s + z or q * s computed in float32 and rounded once,
// the values the one-row products multiply by. For chunks of several rows, which multiply through the float GEMM:
// one pass over the codes, where the same in torch ops (unpack, convert, multiply, add) took several passes and
// their temporaries, ~0.4 s a 256-token chunk of SmolLM2 int4 on one core.
at::Tensor dequant_q(const at::Tensor& qweight, const at::Tensor& scales, int64_t group, at::ScalarType dtype) {
  int64_t N = 0, K = 0;
  const QuantMat m = static_decode_kernels::quant_mat(qweight, scales, group, "dequant_q", "the weight", &N, &K);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequant_q: dtype ", dtype, " (float32 or bfloat16)");
  auto out = at::empty({N, K}, qweight.options().dtype(dtype));
  auto* base = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    static_decode_kernels::dequant_rows_into(m, K, b, e, dtype, base + b * K * out.element_size());
  });
  return out;
}

at::Tensor dequant_q_meta(const at::Tensor& qweight, const at::Tensor& scales, int64_t group, at::ScalarType dtype) {
  const int64_t K = group == 0 ? qweight.size(1) : 2 * qweight.size(1);
  return at::empty({qweight.size(0), K}, qweight.options().dtype(dtype));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(static_decode_cpu, m) {
  m.def("gemv_q(Tensor x, Tensor qweight, Tensor scales, int group) -> Tensor");
  m.def("dequant_q(Tensor qweight, Tensor scales, int group, ScalarType dtype) -> Tensor");
}
TORCH_LIBRARY_IMPL(static_decode_cpu, CPU, m) {
  m.impl("gemv_q", &gemv_q);
  m.impl("dequant_q", &dequant_q);
}
TORCH_LIBRARY_IMPL(static_decode_cpu, Meta, m) {
  m.impl("gemv_q", &gemv_q_meta);
  m.impl("dequant_q", &dequant_q_meta);
}
