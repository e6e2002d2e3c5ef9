// Decode attention over an int8 KV cache (static_decode/core/kv_quant.py): K and V stored as int8 codes with one
// float32 scale per token and KV head (value = code * scale). The same work items, online softmax and combine as
// decode_attention.cpp (decode_common.h); what differs is how a block of keys is read:
//
// - K: a block's code rows are widened to float32 (in registers on AVX-512, 16 codes a load) and scored against the
//   float32 queries, and each key's score is then multiplied by its scale: q . (c_j * s_j) = (q . c_j) * s_j, so
//   no dequantized copy of the cache exists anywhere, only one block's widened rows in L1. With bfloat16 queries
//   on a CPU with AVX512-BF16 the rows are converted to bfloat16 instead (exact for codes) and scored by its dot
//   products, as a bfloat16 cache is: half the scratch and half the multiply instructions.
// - V: each softmax weight is multiplied by its value row's scale after the row sums are taken (the sums are of the
//   weights themselves), and each code row is widened in registers once for all the KV head's query rows.
//
// Masking and the window are decode_attention.cpp's: keys past a row's visible prefix and before its window's
// first key are never read; a padded slot returns exact zeros. Built on first use by static_decode/cpu_kernel.py.
#include <torch/library.h>

#include "attention_avx2.h"
#include "attention_avx512.h"
#include "checks.h"
#include "decode_common.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

using namespace static_decode_kernels::attention;
constexpr int64_t kMaxRows = static_decode_kernels::kMaxRows;
constexpr int kAllLanes = (1 << Vec::size()) - 1;  // zero_mask() of a vector with no NaN lane

// The x-th float vector of an int8 code row, widened (AVX-512 and AVX2: sign-extended to int32 in registers,
// converted).
inline Vec codes_vec(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float f[Vec::size()];
  for (int i = 0; i < Vec::size(); ++i) f[i] = static_cast<float>(p[i]);
  return Vec::loadu(f);
#endif
}

// n code rows of d (row stride `stride`) widened into scratch rows of d floats (unscaled: the scales go on scores).
inline const float* widen_rows(const int8_t* src, int64_t stride, int64_t n, int64_t d, float* scratch) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t x = 0; x < d; x += Vec::size()) codes_vec(src + j * stride + x).store(scratch + j * d + x);
  return scratch;
}

// s[m * kBlock + j] = scale * q[m] . c[j] for the visible keys (j0 + j < limit[m]), -inf for the others.
template <int NX>
inline void code_scores(const float* q, int64_t M, const float* kb, int64_t n, int64_t j0, const int64_t* limit,
                        float scale, float* s) {
#if defined(CPU_CAPABILITY_AVX512)
  scores16<NX>(q, M, kb, n, j0, limit, scale, s);
#elif defined(CPU_CAPABILITY_AVX2)
  scores8<float, NX>(q, M, kb, NX * 8, n, j0, limit, scale, s, kBlock, kNegInf);
#else
  for (int64_t m = 0; m < M; ++m) {
    const int64_t visible = std::clamp<int64_t>(limit[m] - j0, 0, n);
    for (int64_t j = 0; j < visible; ++j) {
      Vec a(0.f);
      for (int x = 0; x < NX; ++x)
        a = at::vec::fmadd(Vec::loadu(q + (m * NX + x) * Vec::size()), Vec::loadu(kb + (j * NX + x) * Vec::size()), a);
      s[m * kBlock + j] = lane_sum(a) * scale;
    }
    std::fill(s + m * kBlock + visible, s + m * kBlock + n, kNegInf);
  }
#endif
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// n code rows (row stride `stride`) as bfloat16 rows of d into scratch: exact (|code| <= 127 < 2^8), half the
// scratch of float32 rows, and scored by AVX512-BF16 dot products, 32 products an instruction.
template <int NX>
inline const at::BFloat16* bf16_rows(const int8_t* src, int64_t stride, int64_t n, at::BFloat16* scratch) {
  constexpr int64_t d = NX * 16;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t x = 0; x < d; x += 32) {
      const __m512 lo = codes_vec(src + j * stride + x), hi = codes_vec(src + j * stride + x + 16);
      _mm512_storeu_si512(scratch + j * d + x, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  return scratch;
}
#endif

// One work item (decode_attention.cpp's split_item over int8 codes): keys [s0, s1) of one KV head; ksc / vsc the
// keys' and values' scales (contiguous along the keys). Leaves acc [M, d], mx [M], l [M].
template <int NX>
void item_int8(const float* q, bool bf16_q, int64_t M, const int8_t* k, int64_t ks, const float* ksc, const int8_t* v,
               int64_t vs, const float* vsc, int64_t s0, int64_t s1, const int64_t* limit, const int64_t* first,
               float scale, float* acc, float* mx, float* l) {
  constexpr int64_t d = NX * Vec::size();
  alignas(64) float kbuf[kBlock * d];
  alignas(64) float s[kMaxRows * kBlock];
  std::fill(acc, acc + M * d, 0.f);
  std::fill(mx, mx + M, kNegInf);
  std::fill(l, l + M, 0.f);
  for (int64_t j0 = s0; j0 < s1; j0 += kBlock) {
    const int64_t n = std::min(kBlock, s1 - j0);
    const int64_t nv = (n + Vec::size() - 1) / Vec::size() * Vec::size();
    bool scored = false;  // bfloat16 queries: by AVX512-BF16 dot products over the codes converted once
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    if constexpr (NX % 2 == 0) {
      if (bf16_q) {
        auto* kb16 = reinterpret_cast<at::BFloat16*>(kbuf);  // kBlock * d bfloat16 values: half of kbuf
        scores16_bf16<NX>(q, M, bf16_rows<NX>(k + j0 * ks, ks, n, kb16), d, n, j0, limit, scale, s);
        scored = true;
      }
    }
#endif
    if (!scored) code_scores<NX>(q, M, widen_rows(k + j0 * ks, ks, n, d, kbuf), n, j0, limit, scale, s);
    for (int64_t m = 0; m < M; ++m) {
      float* sm = s + m * kBlock;
      const int64_t visible = std::clamp<int64_t>(limit[m] - j0, 0, n);
      for (int64_t j = 0; j < visible; ++j) sm[j] *= ksc[j0 + j];  // the key's scale, on its score
      if (first != nullptr && first[m] > j0) std::fill(sm, sm + std::min(n, first[m] - j0), kNegInf);
      std::fill(sm + n, sm + nv, kNegInf);
    }
    float alpha[kMaxRows];
    int64_t active[kMaxRows];
    int64_t na = 0;  // rows with a visible key in this block
    for (int64_t m = 0; m < M; ++m) {
      float* sm = s + m * kBlock;
      Vec top(kNegInf);
      for (int64_t j = 0; j < nv; j += Vec::size()) top = at::vec::maximum(top, Vec::loadu(sm + j));
      const float block_max = lane_max(top);
      if (top.isnan().zero_mask() != kAllLanes) {  // a NaN score: NaN out, as softmax gives (combine writes it)
        l[m] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      if (block_max == kNegInf) continue;  // no visible key in this block for this row
      const float new_max = std::max(mx[m], block_max);
      alpha[m] = std::exp(mx[m] - new_max);
      Vec sum(0.f);
      for (int64_t j = 0; j < nv; j += Vec::size()) {
        const Vec e = (Vec::loadu(sm + j) - Vec(new_max)).exp_u20();
        sum = sum + e;
        const int64_t c = std::min<int64_t>(Vec::size(), n - j);  // j < n: no scale past the item is read
        const Vec sv = c == Vec::size() ? Vec::loadu(vsc + j0 + j) : Vec::loadu(vsc + j0 + j, c);
        (e * sv).store(sm + j);  // the value's scale on its weight, after the sum
      }
      l[m] = l[m] * alpha[m] + lane_sum(sum);
      mx[m] = new_max;
      active[na++] = m;
    }
    // acc = alpha * acc + sum_j (p_j * vscale_j) * codes_j, every active row at once: each code row widened once.
    const int8_t* vj = v + j0 * vs;
    const auto value = [&](int64_t j, int x) { return codes_vec(vj + j * vs + x * Vec::size()); };
    const NextRows next = next_rows(k, ks, v, vs, j0, s1, d);
    constexpr int R = group_rows<NX>;
    for (int64_t g = 0; g < na; g += R)  // the first group's pass fetches the next block
      accumulate_rows<NX, R>(active + g, std::min<int64_t>(R, na - g), acc, alpha, s, n, value,
                             g == 0 ? next : NextRows{});
  }
}

template <int NX>
void attend_int8(const float* qp, bool bf16_q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kscale,
                 const at::Tensor& vscale, const int64_t* lens, const int64_t* n_new, int64_t window, int64_t B,
                 int64_t H, int64_t M, int64_t slots, int64_t nsplit, int64_t split, float scale, float* part) {
  constexpr int64_t d = NX * Vec::size();
  const int64_t S = k.size(2);
  const int8_t* kp = k.data_ptr<int8_t>();
  const int8_t* vp = v.data_ptr<int8_t>();
  const float* kscp = kscale.data_ptr<float>();
  const float* vscp = vscale.data_ptr<float>();
  at::parallel_for(0, B * H * nsplit, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item % nsplit, h = (item / nsplit) % H, b = item / nsplit / H;
      int64_t limit[kMaxRows];
      int64_t first[kMaxRows];
      int64_t visible = 0;
      for (int64_t m = 0; m < M; ++m) {
        const int64_t t = m % slots;
        limit[m] = t < n_new[b] ? std::clamp<int64_t>(lens[b] - n_new[b] + t + 1, 0, S) : 0;
        visible = std::max(visible, limit[m]);
        if (window > 0) first[m] = window_start(lens[b] - n_new[b] + t, window);
      }
      const int64_t lo = window > 0 ? window_start(lens[b] - n_new[b], window) : 0;
      float* acc = part + item * M * (d + 2);
      item_int8<NX>(qp + (b * H + h) * M * d, bf16_q, M, kp + b * k.stride(0) + h * k.stride(1), k.stride(2),
                    kscp + b * kscale.stride(0) + h * kscale.stride(1), vp + b * v.stride(0) + h * v.stride(1),
                    v.stride(2), vscp + b * vscale.stride(0) + h * vscale.stride(1), lo + c * split,
                    std::min(visible, lo + (c + 1) * split), limit, window > 0 ? first : nullptr, scale, acc,
                    acc + M * d, acc + M * d + M);
    }
  });
}

template <int... Ds>
bool dispatch_int8(std::integer_sequence<int, Ds...>, int64_t d, const float* qp, bool bf16_q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& ks, const at::Tensor& vs, const int64_t* lens,
                   const int64_t* n_new, int64_t window, int64_t B, int64_t H, int64_t M, int64_t slots,
                   int64_t nsplit, int64_t split, float scale, float* part) {
  const auto one = [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    if constexpr (D % Vec::size() == 0) {
      if (d == D) {
        attend_int8<D / Vec::size()>(qp, bf16_q, k, v, ks, vs, lens, n_new, window, B, H, M, slots, nsplit, split,
                                     scale, part);
        return true;
      }
    }
    return false;
  };
  return (one(std::integral_constant<int, Ds>{}) || ...);
}
using HeadDims = std::integer_sequence<int, 8, 16, 32, 48, 64, 80, 96, 128, 256>;  // checks.h's kHeadDims

at::Tensor decode_attention_int8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& lens,
                                 const at::Tensor& n_new, int64_t slots, double scale, int64_t window) {
  constexpr const char* op = "decode_attention_int8";
  static_decode_kernels::check_decode_attention(q, k, v, lens, n_new, slots, window, true);  // before any read
  static_decode_kernels::check_kv_scales(k_scale, k, op, "k_scale");
  static_decode_kernels::check_kv_scales(v_scale, v, op, "v_scale");
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2), S = k.size(2), d = q.size(3);
  auto lc = lens.contiguous();
  auto nc = n_new.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t* np = nc.data_ptr<int64_t>();
  const auto [nsplit, split] = plan_splits(lp, np, window, B, H, slots, S, at::get_num_threads());
  auto qc = q.contiguous();
  auto out = at::empty(qc.sizes(), qc.options());
  std::vector<float> buf(qc.numel() + B * H * nsplit * M * (d + 2));
  float* qf = buf.data();
  float* part = qf + qc.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "decode_attention_int8_q", [&] {
    const scalar_t* src = qc.data_ptr<scalar_t>();
    for (int64_t i = 0; i < qc.numel(); ++i) qf[i] = static_cast<float>(src[i]);
  });
  const bool bf16_q = qc.scalar_type() == at::kBFloat16;  // its float32 copy goes back to bfloat16 exactly
  const bool done = dispatch_int8(HeadDims{}, d, qf, bf16_q, k, v, k_scale, v_scale, lp, np, window, B, H, M, slots,
                                  nsplit, split, static_cast<float>(scale), part);
  TORCH_CHECK(done, op, ": no code for head_dim ", d);  // checked above
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "decode_attention_int8_out", [&] {
    combine<scalar_t>(part, B * H, M, d, nsplit, out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor decode_attention_int8_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& lens,
                                      const at::Tensor& n_new, int64_t slots, double scale, int64_t window) {
  return at::empty_like(q);
}

}  // namespace

at::Tensor static_decode_kernels::decode_attention_int8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& k_scale, const at::Tensor& v_scale,
                                                        const at::Tensor& lens, const at::Tensor& n_new, int64_t slots,
                                                        double scale, int64_t window) {
  return ::decode_attention_int8(q, k, v, k_scale, v_scale, lens, n_new, slots, scale, window);
}

TORCH_LIBRARY_FRAGMENT(static_decode_cpu, m) {
  m.def("decode_attention_int8(Tensor q, Tensor k, Tensor v, Tensor k_scale, Tensor v_scale, Tensor lens, "
        "Tensor n_new, int slots, float scale, int window=0) -> Tensor");
}
TORCH_LIBRARY_IMPL(static_decode_cpu, CPU, m) { m.impl("decode_attention_int8", &decode_attention_int8); }
TORCH_LIBRARY_IMPL(static_decode_cpu, Meta, m) { m.impl("decode_attention_int8", &decode_attention_int8_meta); }
