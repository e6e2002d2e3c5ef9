// The AVX-512 (VNNI) products with GGUF's K-quant blocks (gguf_blocks.h): two subs of 32 weights a 512-bit register,
// one vpdpbusd for 64 code products into 16 int32 lanes (4 a quarter of 16 weights), each lane's scale (the sub's or
// the half's, times the row's d) picked from a vector of a super-block's 8 or 16 scales by one permute. About half
// the instructions a weight of the 256-bit loop (gguf_avx2.cpp), which the 32-weight types keep: their blocks are
// bound by per-block work (unaligned 18-34 byte blocks, a float16 scale each), and two a 512-bit register measured
// no faster.
#include "gguf_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#include <immintrin.h>

namespace static_decode_kernels {
namespace gguf {
namespace {

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

// Q4_K / Q5_K: pair p of a super-block is subs 2p (low nibbles of 32 bytes) and 2p + 1 (high nibbles).
template <bool kFive>
float row_k4(const uint8_t* w, const Row& x) {
  constexpr int64_t bytes = kFive ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  // pair p's lanes take sub 2p's scale (0-7) and sub 2p + 1's (8-15)
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i pick[4] = {halves, _mm512_add_epi32(halves, _mm512_set1_epi32(2)),
                           _mm512_add_epi32(halves, _mm512_set1_epi32(4)),
                           _mm512_add_epi32(halves, _mm512_set1_epi32(6))};
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m256 off = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < x.K; k0 += 256, w += bytes) {
    uint64_t sc, mn;
    scales_mins_k4(w + 4, &sc, &mn);
    const __m256 s8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(sc))));
    const __m256 m8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mn))));
    const __m256 sd = _mm256_mul_ps(_mm256_mul_ps(s8, _mm256_set1_ps(f16(w))), _mm256_loadu_ps(x.d.data() + k0 / 32));
    off = _mm256_fnmadd_ps(_mm256_mul_ps(m8, _mm256_set1_ps(f16(w + 2))), _mm256_loadu_ps(x.sum32.data() + k0 / 32),
                           off);
    const __m512 scales = _mm512_castps256_ps512(sd);
    const uint8_t* qs = w + (kFive ? 48 : 16);
    const __m256i qh = kFive ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)) : __m256i{};
    for (int p = 0; p < 4; ++p) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (kFive) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4));
      }
      const __m512i a = _mm512_loadu_si512(x.a.data() + k0 + 64 * p);
      const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), join(lo, hi), a);
      acc[p & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_permutexvar_ps(pick[p], scales), acc[p & 1]);
    }
  }
  const __m256 o = _mm256_add_ps(off, _mm256_permute2f128_ps(off, off, 1));
  const __m128 o4 = _mm256_castps256_ps128(o);
  const __m128 o2 = _mm_add_ps(o4, _mm_movehl_ps(o4, o4));
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + _mm_cvtss_f32(_mm_add_ss(o2, _mm_movehdup_ps(o2)));
}

// Q6_K: per half h, subs 4h + t (t = 0, 1 and 2, 3 a register), each of two 16-weight scales.
float row_q6k(const uint8_t* w, const Row& x) {
  const __m256i m4 = _mm256_set1_epi8(15), three = _mm256_set1_epi8(3);
  // lane l of a pair (t, t + 1) takes scale 2t + l / 4: its quarter of 16 weights
  const __m512i quarter = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  __m512 off = _mm512_setzero_ps();
  const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // a 16's sub of 32
  for (int64_t k0 = 0; k0 < x.K; k0 += 256, w += 210) {
    const __m512 s = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)))),
        _mm512_set1_ps(f16(w + 208)));
    off = _mm512_fmadd_ps(s, _mm512_loadu_ps(x.sum.data() + k0 / 16), off);  // times -32 below
    const __m512 rd = _mm512_permutexvar_ps(twice, _mm512_castps256_ps512(_mm256_loadu_ps(x.d.data() + k0 / 32)));
    const __m512 scales = _mm512_mul_ps(s, rd);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
      const __m256i bottom[4] = {_mm256_and_si256(ql0, m4), _mm256_and_si256(ql1, m4),
                                 _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                 _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4)};
      for (int t = 0; t < 4; t += 2) {
        const __m256i u0 = _mm256_or_si256(
            bottom[t], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), three), 4));
        const __m256i u1 = _mm256_or_si256(
            bottom[t + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t + 2), three), 4));
        const __m512i a = _mm512_loadu_si512(x.a.data() + k0 + 128 * h + 32 * t);
        const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), join(u0, u1), a);
        const __m512i pick = _mm512_add_epi32(quarter, _mm512_set1_epi32(8 * h + 2 * t));
        acc[t >> 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_permutexvar_ps(pick, scales), acc[t >> 1]);
      }
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) - 32.f * _mm512_reduce_add_ps(off);
}

}  // namespace

bool rows_avx512(int64_t type, const uint8_t* W, int64_t row_bytes, const Row& x, int64_t n0, int64_t n1, float* y) {
  switch (type) {
    case Q4_K:
      for (int64_t n = n0; n < n1; ++n) y[n] = row_k4<false>(W + n * row_bytes, x);
      return true;
    case Q5_K:
      for (int64_t n = n0; n < n1; ++n) y[n] = row_k4<true>(W + n * row_bytes, x);
      return true;
    case Q6_K:
      for (int64_t n = n0; n < n1; ++n) y[n] = row_q6k(W + n * row_bytes, x);
      return true;
    default: return false;
  }
}

}  // namespace gguf
}  // namespace static_decode_kernels
#endif
