// The AVX2 products with GGUF blocks (gguf_blocks.h's layouts): a sub of 32 weights widened to 32 unsigned byte codes
// in one register, multiplied by the row's 32 int8 codes into 8 int32 sums of 4 (lanes 0-3 the first 16 weights,
// 4-7 the second, so a Q6_K sub's two scales apply lane-wise), scaled in float32. The byte product is AVX512-VNNI's
// vpdpbusd where the build has it (on 256-bit registers, AVX512-VL), else AVX2's vpmaddubsw + vpmaddwd: the codes are
// at most 63 (Q8_0 goes in as |q| with its sign on the row's code), so the pairs' 16-bit sums cannot saturate. Offsets
// (Q4_0's -8, Q6_K's -32, Q4_K's mins) are folded into one scalar per half, times the row's sum of that half.
#include "gguf_blocks.h"

#if defined(__AVX2__)
#include <immintrin.h>

namespace static_decode_kernels {
namespace gguf {
namespace {

inline __m256i dot_u8(__m256i u, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
#endif
}

inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline __m256i high4(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }

// 16 bytes of nibbles -> the 32 codes of a 32-weight block (weight j low nibble of byte j, j + 16 its high one).
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

// 32 bits -> 32 bytes, 16 where the bit is set (the fifth bit of a Q5 code), else 0.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(v)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// One sub: acc += (codes . row codes) * s * d lane-wise (s_lo on lanes 0-3, s_hi on 4-7).
inline void sub(__m256i u, const Row& x, int64_t k, float s_lo, float s_hi, __m256& acc) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a.data() + k));
  const float d = x.d[k / 32];
  const __m256 scale = _mm256_set_m128(_mm_set1_ps(s_hi * d), _mm_set1_ps(s_lo * d));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8(u, a)), scale, acc);
}

inline float half_sums(const Row& x, int64_t k) { return x.sum[k / 16] + x.sum[k / 16 + 1]; }

float row_dot(int64_t type, const uint8_t* w, const Row& x) {
  __m256 acc = _mm256_setzero_ps();
  float off = 0.f;
  const int64_t K = x.K;
  switch (type) {
    case Q8_0:
      for (int64_t k = 0; k < K; k += 32, w += 34) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a.data() + k));
        const __m256 scale = _mm256_set1_ps(half(w) * x.d[k / 32]);
        const __m256i p = dot_u8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc);
      }
      break;
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
      const Layout L = layout(type);
      const bool five = type == Q5_0 || type == Q5_1, affine = type == Q4_1 || type == Q5_1;
      const int64_t qs = (affine ? 4 : 2) + (five ? 4 : 0);
      for (int64_t k = 0; k < K; k += 32, w += L.bytes) {
        __m256i u = nibbles16(w + qs);
        if (five) u = _mm256_or_si256(u, fifth_bits(w + qs - 4));
        const float d = half(w);
        sub(u, x, k, d, d, acc);
        off += (affine ? half(w + 2) : (five ? -16.f : -8.f) * d) * half_sums(x, k);
      }
      break;
    }
    case Q4_K:
    case Q5_K: {
      const bool five = type == Q5_K;
      const int64_t bytes = five ? 176 : 144;
      for (int64_t k0 = 0; k0 < K; k0 += 256, w += bytes) {
        const float d = half(w), dmin = half(w + 2);
        const uint8_t* qs = w + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)) : __m256i{};
        for (int p = 0; p < 4; ++p) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
          for (int half_ = 0; half_ < 2; ++half_) {
            const int j = 2 * p + half_;
            __m256i u = half_ ? high4(q) : low4(q);
            if (five)
              u = _mm256_or_si256(u, _mm256_slli_epi16(
                  _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1)), 4));
            int sc, mn;
            scale_min_k4(w + 4, j, &sc, &mn);
            const int64_t k = k0 + 32 * j;
            const float s = d * static_cast<float>(sc);
            sub(u, x, k, s, s, acc);
            off -= dmin * static_cast<float>(mn) * half_sums(x, k);
          }
        }
      }
      break;
    }
    case Q6_K:
      for (int64_t k0 = 0; k0 < K; k0 += 256, w += 210) {
        const float d = half(w + 208);
        const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
        for (int h = 0; h < 2; ++h) {
          const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h));
          const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h + 32));
          const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
          const __m256i three = _mm256_set1_epi8(3);
          const __m256i top[4] = {
              _mm256_and_si256(qh, three), _mm256_and_si256(_mm256_srli_epi16(qh, 2), three),
              _mm256_and_si256(_mm256_srli_epi16(qh, 4), three), _mm256_and_si256(_mm256_srli_epi16(qh, 6), three)};
          const __m256i bottom[4] = {low4(ql0), low4(ql1), high4(ql0), high4(ql1)};
          for (int t = 0; t < 4; ++t) {
            const __m256i u = _mm256_or_si256(bottom[t], _mm256_slli_epi16(top[t], 4));
            const int64_t k = k0 + 128 * h + 32 * t;
            const float s_lo = d * static_cast<float>(sc[8 * h + 2 * t]);
            const float s_hi = d * static_cast<float>(sc[8 * h + 2 * t + 1]);
            sub(u, x, k, s_lo, s_hi, acc);
            off -= 32.f * (s_lo * x.sum[k / 16] + s_hi * x.sum[k / 16 + 1]);
          }
        }
      }
      break;
    default: break;
  }
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) + off;
}

}  // namespace

void rows_avx2(int64_t type, const uint8_t* W, int64_t row_bytes, const Row& x, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n) y[n] = row_dot(type, W + n * row_bytes, x);
}

}  // namespace gguf
}  // namespace static_decode_kernels
#endif
