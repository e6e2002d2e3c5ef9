// The AVX-512 paths of the decode attention kernel (decode_attention.cpp): key scores 16 at a time with one
// transposing reduction, AVX512-BF16 dot products straight from a bfloat16 cache's rows, and value rows widened in
// registers. Included by decode_attention.cpp only; built by static_decode/cpu_kernel.py.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace static_decode_kernels::attention {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 64;  // keys scored and softmaxed together: M x 64 scores stay in L1
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The sum and the largest of a vector's lanes. at::vec's portable Vectorized (the DEFAULT build) declares
// reduce_add/reduce_max through a `reduce` that does not compile, so that build reads the lanes out; the ISA builds
// take at::vec's own.
inline float lane_sum(const Vec& v) {
#if defined(CPU_CAPABILITY_DEFAULT)
  float x[Vec::size()];
  v.store(x);
  float s = 0.f;
  for (int i = 0; i < Vec::size(); ++i) s += x[i];
  return s;
#else
  return v.reduce_add();
#endif
}

inline float lane_max(const Vec& v) {
#if defined(CPU_CAPABILITY_DEFAULT)
  float x[Vec::size()];
  v.store(x);
  float m = x[0];
  for (int i = 1; i < Vec::size(); ++i) m = std::max(m, x[i]);
  return m;
#else
  return v.reduce_max();
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// r[j] = the sum of a[j]'s 16 lanes, for 16 vectors at once: a transposing tree of 15 adds and 30 shuffles, against
// 16 horizontal reductions of ~8 dependent steps each (they were ~30% of the kernel's time with one per key).
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a2i, a2i+1, a2i, a2i+1] each a sum of two of its lanes
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a4i .. a4i+3], each that lane's sum
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The 16 dot products of one query row with 16 keys, reduced together: dot(j) is key j's vector of partial sums.
// cnt == 16 unless kTail (the block's last, partial group: keys past cnt are never read).
template <bool kTail, typename Dot>
inline __m512 dots16(int64_t cnt, Dot dot) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = kTail && j >= cnt ? _mm512_setzero_ps() : dot(j);
  return sum16(a);
}

// The loop both score paths share: for each query row, its visible keys in 16-key groups (full groups without
// per-key checks, then the partial one with a masked store), -inf for the block's keys it does not see.
// dots_for(m) gives row m's `dots(jb, cnt, tail)`: the 16 scores from key jb, tail a std::bool_constant.
template <typename DotsFor>
inline void score_groups(int64_t M, int64_t n, int64_t j0, const int64_t* limit, float scale, float* s,
                         DotsFor dots_for) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t m = 0; m < M; ++m) {
    const auto dots = dots_for(m);
    const int64_t visible = std::clamp<int64_t>(limit[m] - j0, 0, n);
    int64_t jb = 0;
    for (; jb + 16 <= visible; jb += 16)
      _mm512_storeu_ps(s + m * kBlock + jb, _mm512_mul_ps(dots(jb, 16, std::false_type{}), sc));
    if (jb < visible) {
      const int64_t cnt = visible - jb;
      _mm512_mask_storeu_ps(s + m * kBlock + jb, static_cast<__mmask16>((1u << cnt) - 1),
                            _mm512_mul_ps(dots(jb, cnt, std::true_type{}), sc));
    }
    std::fill(s + m * kBlock + visible, s + m * kBlock + n, kNegInf);
  }
}

// scores() for AVX-512: float32 queries and key rows (the cache's, or widened into scratch), FMAs per 16 columns.
template <int NX>
inline void scores16(const float* q, int64_t M, const float* kb, int64_t n, int64_t j0, const int64_t* limit,
                     float scale, float* s) {
  constexpr int64_t d = NX * 16;
  score_groups(M, n, j0, limit, scale, s, [&](int64_t m) {
    std::array<__m512, NX> qm;
    for (int x = 0; x < NX; ++x) qm[x] = _mm512_loadu_ps(q + m * d + x * 16);
    return [=](int64_t jb, int64_t cnt, auto tail) {
      return dots16<decltype(tail)::value>(cnt, [&](int j) {
        const float* kr = kb + (jb + j) * d;
        __m512 a = _mm512_setzero_ps();
        for (int x = 0; x < NX; ++x) a = _mm512_fmadd_ps(qm[x], _mm512_loadu_ps(kr + x * 16), a);
        return a;
      });
    };
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// scores16 for bfloat16 queries over bfloat16 key rows (k: the block's first, rows ks apart; the cache's own, or an
// int8 cache's codes converted, exactly): AVX512-BF16's dot product takes 32 query x key products a
// step straight from the cache's rows (no widening to float32, no scratch copy). The products are exact in float32;
// only the order of the float32 sums differs from the float32 path.
template <int NX>
inline void scores16_bf16(const float* q, int64_t M, const at::BFloat16* k, int64_t ks, int64_t n, int64_t j0,
                          const int64_t* limit, float scale, float* s) {
  constexpr int NB = NX / 2;  // 32 bfloat16 values a vector
  constexpr int64_t d = NX * 16;
  score_groups(M, n, j0, limit, scale, s, [&](int64_t m) {
    std::array<__m512bh, NB> qm;  // the query row back in bfloat16: exact, it was bfloat16 before the float32 copy
    for (int x = 0; x < NB; ++x)
      qm[x] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + m * d + x * 32 + 16), _mm512_loadu_ps(q + m * d + x * 32));
    const at::BFloat16* kj = k;  // the block's first key row
    return [=](int64_t jb, int64_t cnt, auto tail) {
      return dots16<decltype(tail)::value>(cnt, [&](int j) {
        __m512 a = _mm512_setzero_ps();
        for (int x = 0; x < NB; ++x)
          a = _mm512_dpbf16_ps(a, qm[x], (__m512bh)_mm512_loadu_si512(kj + (jb + j) * ks + x * 32));
        return a;
      });
    };
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// 16 values of a cache row as float32, widened in registers (bfloat16: the high half of a float; float16: F16C).
template <typename T>
inline Vec row16(const T* p);
template <>
inline Vec row16<float>(const float* p) { return Vec(_mm512_loadu_ps(p)); }
template <>
inline Vec row16<at::BFloat16>(const at::BFloat16* p) {
  return Vec(_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)));
}
template <>
inline Vec row16<at::Half>(const at::Half* p) {
  return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#endif

}  // namespace static_decode_kernels::attention
