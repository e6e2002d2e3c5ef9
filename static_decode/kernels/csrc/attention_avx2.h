// The AVX2 paths of the decode attention kernel (decode_attention.cpp), AVX2's counterparts of attention_avx512.h:
// key scores 8 at a time with one transposing reduction, and cache rows (keys and values) widened to float32 in
// registers where the portable path converts them into scratch first. Included by decode_attention.cpp only.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>

namespace static_decode_kernels::attention {

// 8 values of a cache row as float32 (bfloat16: the high half of a float; float16: F16C).
template <typename T>
inline __m256 row8(const T* p);
template <>
inline __m256 row8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 row8<at::BFloat16>(const at::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
template <>
inline __m256 row8<at::Half>(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// r[j] = the sum of a[j]'s 8 lanes, for 8 vectors at once: six horizontal adds, two lane swaps and one add, against
// 8 horizontal reductions of ~6 dependent steps each.
inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: a0..a3 / a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[m * kBlock + j] = scale * q[m] . k[j] for the visible keys (j0 + j < limit[m]), -inf for the others, k the
// block's first key row (rows ks elements apart, read in place): each query row's dot products with 8 keys at a
// time, reduced together.
template <typename T, int NX>
inline void scores8(const float* q, int64_t M, const T* k, int64_t ks, int64_t n, int64_t j0, const int64_t* limit,
                    float scale, float* s, int64_t block, float neg_inf) {
  constexpr int64_t d = NX * 8;
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t m = 0; m < M; ++m) {
    const float* qm = q + m * d;
    const int64_t visible = std::clamp<int64_t>(limit[m] - j0, 0, n);
    float* sm = s + m * block;
    for (int64_t jb = 0; jb < visible; jb += 8) {
      const int64_t cnt = std::min<int64_t>(8, visible - jb);
      __m256 a[8];
      for (int j = 0; j < 8; ++j) {
        a[j] = _mm256_setzero_ps();
        if (j >= cnt) continue;  // keys past the visible ones are never read
        const T* kr = k + (jb + j) * ks;
        for (int x = 0; x < NX; ++x) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qm + 8 * x), row8<T>(kr + 8 * x), a[j]);
      }
      const __m256 r = _mm256_mul_ps(sum8(a), sc);
      if (cnt == 8) {
        _mm256_storeu_ps(sm + jb, r);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, r);
        std::copy(t, t + cnt, sm + jb);
      }
    }
    std::fill(sm + visible, sm + n, neg_inf);
  }
}

}  // namespace static_decode_kernels::attention

#endif
