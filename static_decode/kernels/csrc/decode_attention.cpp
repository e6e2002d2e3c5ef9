// Decode attention on the CPU: the few query rows of a decode step (or a short verify chunk) against the KV cache,
// reading K and V once, in place, at memory bandwidth. Built on first use by static_decode/cpu_kernel.py.
//
// Why a kernel of our own: SDPA's CPU flash kernel computes each key block as two small GEMMs, [M, d] x [d, Sb] and
// [M, Sb] x [Sb, d], with M = G*T query rows per KV head: 3 rows for SmolLM2-135M, too few for a GEMM micro-kernel
// to keep up with memory; inductor's own reductions either reread K per query row or sum V along a strided axis.
// Here each block of key and value rows is read from memory once into L1 and used by every query row of its KV head
// (rule 2: no KV repeat), scores of a block of keys stay in L1, the softmax is online (running max and sum per row), and the key axis is
// split into independent work items (flash-decoding) so a batch-1 step of a model with 3 KV heads still feeds
// every thread. Partial results are combined by their running maxima and sums.
// On AVX-512 (attention_avx512.h) the scores of 16 keys are reduced together (sum16), bfloat16 queries over a
// bfloat16 cache are scored by AVX512-BF16 dot products straight from the cache's rows, and V's rows are widened in
// registers and accumulated for a group of query rows at once (profiles/RESULTS.md, "Decode attention kernel").
// On AVX2 (attention_avx2.h) the scores of 8 keys are reduced together (sum8) and K's and V's rows are widened in
// registers from the cache's own memory (profiles/RESULTS.md, "AVX2 kernels").
//
// Masking (rule 3): row m = g*T + t is slot t of its row; it sees keys 0..lens[b] - n_new[b] + t, a prefix, and none
// when t >= n_new[b] (a padded slot returns exact zeros). Keys past the longest visible prefix are never read.
// A sliding window of W keys (window > 0; 0: none) makes it the band pos - W < j <= pos: a row's work items then
// cover only keys from its slot 0's oldest visible key on, so keys before every slot's window are never read and a
// windowed layer's cost stops growing at W; the few keys of the band's first block before a row's own start are
// masked after scoring. Off, the band's start is 0 and nothing else changes.
#include <torch/library.h>

#include "attention_avx2.h"
#include "attention_avx512.h"
#include "decode_common.h"
#include "checks.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using static_decode_kernels::KVRows;
using static_decode_kernels::attention::kBlock;
using static_decode_kernels::attention::accumulate_rows;
using static_decode_kernels::attention::group_rows;
using static_decode_kernels::attention::NextRows;
using static_decode_kernels::attention::combine;
using static_decode_kernels::attention::plan_splits;
using static_decode_kernels::attention::window_start;
using static_decode_kernels::attention::kNegInf;
using static_decode_kernels::attention::lane_max;
using static_decode_kernels::attention::lane_sum;
using static_decode_kernels::attention::Vec;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
using namespace static_decode_kernels::attention;  // the AVX-512 / AVX2 score and value-row paths
#endif
constexpr int64_t kMaxRows = static_decode_kernels::kMaxRows;
constexpr int kAllLanes = (1 << Vec::size()) - 1;  // zero_mask() of a vector with no NaN lane

// n rows of d values from src (row stride `stride` elements) as float32 rows of stride d: the cache's own memory
// when it already is (float32, rows adjacent), else converted into `scratch` (bfloat16 / float16 caches).
template <typename T>
inline const float* float_rows(const T* src, int64_t stride, int64_t n, int64_t d, float* scratch) {
  using BVec = at::vec::Vectorized<T>;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t x = 0; x < d; x += BVec::size()) {
      const int64_t count = std::min<int64_t>(BVec::size(), d - x);  // a head_dim of one float vector: half a load
      auto [lo, hi] = at::vec::convert_to_float<T>(BVec::loadu(src + j * stride + x, count));
      lo.store(scratch + j * d + x, std::min<int64_t>(count, Vec::size()));
      if (count > Vec::size()) hi.store(scratch + j * d + x + Vec::size(), count - Vec::size());
    }
  }
  return scratch;
}
template <>
inline const float* float_rows<float>(const float* src, int64_t stride, int64_t n, int64_t d, float* scratch) {
  if (stride == d) return src;
  for (int64_t j = 0; j < n; ++j) std::copy(src + j * stride, src + j * stride + d, scratch + j * d);
  return scratch;
}

// s[m * kBlock + j] = scale * q[m] . k[j] for the visible keys (j0 + j < limit[m]), -inf for the others. Row-major
// over the queries: a query row stays in registers while the block's key rows (in L1) stream past it.
template <int NX>
inline void scores(const float* q, int64_t M, const float* kb, int64_t n, int64_t j0, const int64_t* limit,
                   float scale, float* s) {
  for (int64_t m = 0; m < M; ++m) {
    Vec qm[NX];
    for (int x = 0; x < NX; ++x) qm[x] = Vec::loadu(q + m * NX * Vec::size() + x * Vec::size());
    const int64_t visible = std::clamp<int64_t>(limit[m] - j0, 0, n);
    for (int64_t j = 0; j < visible; ++j) {
      const float* kr = kb + j * NX * Vec::size();
      Vec a = qm[0] * Vec::loadu(kr);
      for (int x = 1; x < NX; ++x) a = at::vec::fmadd(qm[x], Vec::loadu(kr + x * Vec::size()), a);
      s[m * kBlock + j] = lane_sum(a) * scale;
    }
    std::fill(s + m * kBlock + visible, s + m * kBlock + n, kNegInf);
  }
}

// A row's first 128 bytes toward L2 (prefetcht2 on x86): enough for the hardware prefetcher to take up the page
// they start (profiles/RESULTS.md, "Decode attention's page heads"). Prefetching more of each row, or rows further
// ahead, made the loop slower.
template <typename T>
inline void prefetch_head(const T* row) {
  __builtin_prefetch(row, 0, 1);
  __builtin_prefetch(reinterpret_cast<const char*>(row) + 64, 0, 1);
}

// One work item: keys [s0, s1) of KV head (b, h) for its M query rows; leaves the unnormalised output acc [M, d],
// the running max mx [M] and sum l [M] (l == 0: no visible key in this split).
// first: each row's oldest visible key (a sliding window), or nullptr (every key from 0).
// The value pass of each block runs 16 keys at a time, each step followed by the scores of 16 keys of the next
// block: key and value rows are then read side by side at the arithmetic's pace, where a block's keys read in one
// burst after the previous block's value pass left the cold loop waiting on memory (profiles/RESULTS.md, "Decode
// attention's arithmetic and memory"). The arithmetic and its order are those of one block at a time.
template <typename T, int NX>
void split_item(const float* q, bool bf16_q, int64_t M, const T* k, int64_t ks, const T* v, int64_t vs, int64_t s0,
                int64_t s1, const int64_t* limit, const int64_t* first, float scale, float* acc, float* mx, float* l) {
  constexpr int64_t d = NX * Vec::size();
  constexpr int64_t kStep = 16;  // keys a value step, and keys of the next block scored after it
#if !defined(CPU_CAPABILITY_AVX2)
  alignas(64) float kbuf[kStep * d];  // key rows widened to float32 where they are scored by FMAs
#endif
  alignas(64) float sbuf[2][kMaxRows * kBlock];  // this block's scores (then weights) and the next block's scores
  std::fill(acc, acc + M * d, 0.f);
  std::fill(mx, mx + M, kNegInf);
  std::fill(l, l + M, 0.f);
  constexpr int R = group_rows<NX>;
  float alpha[kMaxRows];
  float ones[kMaxRows];
  std::fill(ones, ones + M, 1.f);
  int64_t active[kMaxRows];
  // s[m * kBlock + j] for keys [j0, j0 + n) of a block, where s points at key j0's column (a step of a block).
  const auto score = [&](int64_t j0, int64_t n, float* s) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16> && NX % 2 == 0) {
      if (bf16_q) {  // AVX512-BF16 dot products straight from the cache's rows
        scores16_bf16<NX>(q, M, k + j0 * ks, ks, n, j0, limit, scale, s);
        return;
      }
    }
#endif
#if defined(CPU_CAPABILITY_AVX2)
    scores8<T, NX>(q, M, k + j0 * ks, ks, n, j0, limit, scale, s, kBlock, kNegInf);  // the cache's rows in place
#else
    const float* kb = float_rows<T>(k + j0 * ks, ks, n, d, kbuf);
#if defined(CPU_CAPABILITY_AVX512)
    scores16<NX>(q, M, kb, n, j0, limit, scale, s);
#else
    scores<NX>(q, M, kb, n, j0, limit, scale, s);
#endif
#endif
  };
  const auto score_block = [&](int64_t j0, int64_t n, float* s) {
    for (int64_t g = 0; g < n; g += kStep) score(j0 + g, std::min(kStep, n - g), s + g);
  };
  if (s1 - s0 <= 4 * kBlock) {  // a short item (a short context): its first block's rows toward L2 up front
    for (int64_t j = s0; j < std::min(s1, s0 + kBlock); ++j)
      for (int64_t x = 0; x < d * static_cast<int64_t>(sizeof(T)); x += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k + j * ks) + x, 0, 1);
        __builtin_prefetch(reinterpret_cast<const char*>(v + j * vs) + x, 0, 1);
      }
  }
  int cur = 0;
  if (s0 < s1) score_block(s0, std::min(kBlock, s1 - s0), sbuf[cur]);
  for (int64_t j0 = s0; j0 < s1; j0 += kBlock) {
    const int64_t n = std::min(kBlock, s1 - j0);
    const int64_t nv = (n + Vec::size() - 1) / Vec::size() * Vec::size();
    float* s = sbuf[cur];
    if (first != nullptr) {  // the window's lower bound: keys before a row's first are masked like those past it
      for (int64_t m = 0; m < M; ++m)
        if (first[m] > j0) std::fill(s + m * kBlock, s + m * kBlock + std::min(n, first[m] - j0), kNegInf);
    }
    int64_t na = 0;  // rows with a visible key in this block
    for (int64_t m = 0; m < M; ++m) {
      float* sm = s + m * kBlock;
      std::fill(sm + n, sm + nv, kNegInf);  // whole vectors below
      Vec top(kNegInf);
      for (int64_t j = 0; j < nv; j += Vec::size()) top = at::vec::maximum(top, Vec::loadu(sm + j));
      const float block_max = lane_max(top);
      if (top.isnan().zero_mask() != kAllLanes) {  // a NaN score (query, key or scale): NaN out, as softmax gives
        l[m] = std::numeric_limits<float>::quiet_NaN();  // sticks through later blocks; combine() writes NaN
        continue;
      }
      if (block_max == kNegInf) continue;  // no visible key in this block for this row
      const float new_max = std::max(mx[m], block_max);
      alpha[m] = std::exp(mx[m] - new_max);  // exp(-inf) = 0 on the first visible block
      Vec sum(0.f);
      for (int64_t j = 0; j < nv; j += Vec::size()) {
        const Vec e = (Vec::loadu(sm + j) - Vec(new_max)).exp_u20();  // masked keys: exp(-inf) = 0
        e.store(sm + j);
        sum = sum + e;
      }
      l[m] = l[m] * alpha[m] + lane_sum(sum);
      mx[m] = new_max;
      active[na++] = m;
    }
#if defined(CPU_CAPABILITY_AVX512)
    // The value rows read from the cache itself, each widened once in registers for the whole group: the scratch
    // copy this replaced (stores, then loads) was a fifth of the kernel's time with a bfloat16 cache.
    const T* vj = v + j0 * vs;
    const auto value_at = [&](int64_t g) {
      return [=](int64_t j, int x) { return row16<T>(vj + (g + j) * vs + x * Vec::size()); };
    };
#elif defined(CPU_CAPABILITY_AVX2)
    const T* vj = v + j0 * vs;  // as AVX-512's: the value rows widened in registers, no scratch copy
    const auto value_at = [&](int64_t g) {
      return [=](int64_t j, int x) { return Vec(row8<T>(vj + (g + j) * vs + x * Vec::size())); };
    };
#else
    alignas(64) float vbuf[kBlock * d];  // without AVX-512 the value rows are widened into scratch
    const float* vb = float_rows<T>(v + j0 * vs, vs, n, d, vbuf);
    const auto value_at = [&](int64_t g) {
      return [=](int64_t j, int x) { return Vec::loadu(vb + (g + j) * d + x * Vec::size()); };
    };
#endif
    const int64_t j1 = j0 + kBlock, nn = std::clamp<int64_t>(s1 - j1, 0, kBlock);  // the next block's keys
    for (int64_t g = 0; g < std::max(n, nn); g += kStep) {
      // The first two lines of the next step's value and key rows, into L2: the hardware prefetcher stops at each
      // 4 KB page (16 rows of a 128-wide bfloat16 head) and starts on the next one only after a miss or two there.
      if (j0 + g + kStep < s1) prefetch_head(v + (j0 + g + kStep) * vs);
      if (j1 + g + kStep < s1) prefetch_head(k + (j1 + g + kStep) * ks);
      if (g < n) {  // this block's weights: alpha rescales the rows' sums once, at the first step
        for (int64_t r = 0; r < na; r += R)
          accumulate_rows<NX, R>(active + r, std::min<int64_t>(R, na - r), acc, g == 0 ? alpha : ones, s + g,
                                 std::min(kStep, n - g), value_at(g), NextRows{});
      }
      if (g < nn) score(j1 + g, std::min(kStep, nn - g), sbuf[cur ^ 1] + g);
    }
    cur ^= 1;
  }
}

// Every work item's partial result: part [B*H, nsplit, M*(d+2)] holds acc [M, d], mx [M], l [M] per item.
template <typename T, int NX>
void attend(const float* qp, bool bf16_q, const KVRows& kv, const int64_t* lens, const int64_t* n_new,
            int64_t window, int64_t B, int64_t H, int64_t M, int64_t slots, int64_t nsplit, int64_t split, float scale,
            float* part) {
  constexpr int64_t d = NX * Vec::size();
  const int64_t S = kv.S;
  const T* kp = static_cast<const T*>(kv.k);
  const T* vp = static_cast<const T*>(kv.v);
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
      // The row's keys start at its slot 0's window (0 without one): the items split [lo, visible).
      const int64_t lo = window > 0 ? window_start(lens[b] - n_new[b], window) : 0;
      float* acc = part + item * M * (d + 2);
      split_item<T, NX>(qp + (b * H + h) * M * d, bf16_q, M, kp + b * kv.kb + h * kv.kh, kv.ks,
                        vp + b * kv.vb + h * kv.vh, kv.vs, lo + c * split,
                        std::min(visible, lo + (c + 1) * split), limit, window > 0 ? first : nullptr, scale, acc,
                        acc + M * d, acc + M * d + M);
    }
  });
}

// attend<T, d / Vec::size()> for the head sizes with code (checks.h, kHeadDims): one instantiation each.
template <typename T, int D>
bool attend_if(int64_t d, const float* qp, bool bf16_q, const KVRows& kv,
               const int64_t* lens, const int64_t* n_new, int64_t window, int64_t B, int64_t H, int64_t M,
               int64_t slots, int64_t nsplit, int64_t split, float scale, float* part) {
  if constexpr (D % Vec::size() == 0) {
    if (d == D) {
      attend<T, D / Vec::size()>(qp, bf16_q, kv, lens, n_new, window, B, H, M, slots, nsplit, split, scale, part);
      return true;
    }
  }
  return false;
}

template <typename T, int... Ds>
bool dispatch_d(std::integer_sequence<int, Ds...>, const float* qp, bool bf16_q, const KVRows& kv,
                const int64_t* lens, const int64_t* n_new, int64_t window, int64_t B, int64_t H,
                int64_t M, int64_t slots, int64_t nsplit, int64_t split, float scale, float* part) {
  return (attend_if<T, Ds>(kv.d, qp, bf16_q, kv, lens, n_new, window, B, H, M, slots, nsplit, split, scale,
                           part) ||
          ...);
}
using HeadDims = std::integer_sequence<int, 8, 16, 32, 48, 64, 80, 96, 128, 256>;  // checks.h's kHeadDims

// The attention of float32 queries qf [B, H, M, d] over `kv` (checked by the caller) into out [B, H, M, d] (O):
// the items' partial results in `scratch`, grown to fit and reused by the next call. bf16_q: the queries are
// bfloat16 values (scored by AVX512-BF16 dot products over a bfloat16 cache: exact products).
template <typename O>
void attend_into(const float* qf, bool bf16_q, const KVRows& kv, const int64_t* lp, const int64_t* np, int64_t B,
                 int64_t H, int64_t M, int64_t slots, double scale, int64_t window, std::vector<float>& scratch, O* out) {
  const int64_t S = kv.S, d = kv.d;
  const auto [nsplit, split] = plan_splits(lp, np, window, B, H, slots, S, at::get_num_threads());
  const auto need = static_cast<size_t>(B * H * nsplit * M * (d + 2));
  if (scratch.size() < need) scratch.resize(need);
  float* part = scratch.data();
  const float sc = static_cast<float>(scale);
  bool done = false;
  switch (kv.dtype) {
    case at::kFloat:
      done = dispatch_d<float>(HeadDims{}, qf, bf16_q, kv, lp, np, window, B, H, M, slots, nsplit, split, sc, part);
      break;
    case at::kBFloat16:
      done = dispatch_d<at::BFloat16>(HeadDims{}, qf, bf16_q, kv, lp, np, window, B, H, M, slots, nsplit, split, sc,
                                      part);
      break;
    case at::kHalf:
      done = dispatch_d<at::Half>(HeadDims{}, qf, bf16_q, kv, lp, np, window, B, H, M, slots, nsplit, split, sc,
                                  part);
      break;
    default: break;
  }
  TORCH_CHECK(done, "decode_attention: no code for K/V ", kv.dtype, " head_dim ", d);  // checked before
  combine<O>(part, B * H, M, d, nsplit, out);
}

// The attention of q [B, H, M, d] over `kv` (checked by the caller) -> [B, H, M, d] in q's dtype.
at::Tensor attend_rows(const at::Tensor& q, const KVRows& kv, const at::Tensor& lens, const at::Tensor& n_new,
                       int64_t slots, double scale, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), M = q.size(2);
  auto lc = lens.contiguous();
  auto nc = n_new.contiguous();
  auto qc = q.contiguous();
  auto out = at::empty(qc.sizes(), qc.options());
  std::vector<float> qf(qc.numel());  // the queries in float32 (the kernel's math)
  std::vector<float> scratch;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "decode_attention_q", [&] {
    const scalar_t* src = qc.data_ptr<scalar_t>();
    for (int64_t i = 0; i < qc.numel(); ++i) qf[i] = static_cast<float>(src[i]);
    attend_into<scalar_t>(qf.data(), qc.scalar_type() == at::kBFloat16, kv, lc.data_ptr<int64_t>(),
                          nc.data_ptr<int64_t>(), B, H, M, slots, scale, window, scratch, out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                            const at::Tensor& n_new, int64_t slots, double scale, int64_t window) {
  static_decode_kernels::check_decode_attention(q, k, v, lens, n_new, slots, window);  // before anything is read
  const KVRows kv{k.data_ptr(), v.data_ptr(), k.scalar_type(), k.size(2), k.size(3),
                  k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)};
  return attend_rows(q, kv, lens, n_new, slots, scale, window);
}

// Shapes only, for tracing (torch.compile's fake tensors).
at::Tensor decode_attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& lens, const at::Tensor& n_new, int64_t slots, double scale,
                                 int64_t window) {
  return at::empty_like(q);
}

}  // namespace

at::Tensor static_decode_kernels::decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& lens, const at::Tensor& n_new, int64_t slots,
                                                   double scale, int64_t window) {
  return ::decode_attention(q, k, v, lens, n_new, slots, scale, window);
}

template <typename O>
void static_decode_kernels::decode_attention_into(const float* q, bool bf16_q, const KVRows& kv, const int64_t* lens,
                                                  const int64_t* n_new, int64_t B, int64_t H, int64_t M, int64_t slots,
                                                  double scale, int64_t window, std::vector<float>& scratch, O* out) {
  attend_into<O>(q, bf16_q, kv, lens, n_new, B, H, M, slots, scale, window, scratch, out);
}
template void static_decode_kernels::decode_attention_into<float>(const float*, bool, const KVRows&, const int64_t*,
                                                                  const int64_t*, int64_t, int64_t, int64_t, int64_t,
                                                                  double, int64_t, std::vector<float>&, float*);
template void static_decode_kernels::decode_attention_into<at::BFloat16>(
    const float*, bool, const KVRows&, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, double,
    int64_t, std::vector<float>&, at::BFloat16*);

TORCH_LIBRARY(static_decode_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor lens, Tensor n_new, int slots, float scale, "
        "int window=0) -> Tensor");
}
TORCH_LIBRARY_IMPL(static_decode_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
TORCH_LIBRARY_IMPL(static_decode_cpu, Meta, m) { m.impl("decode_attention", &decode_attention_meta); }
