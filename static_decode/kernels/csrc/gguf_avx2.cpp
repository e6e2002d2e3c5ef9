// The AVX2 products with GGUF blocks (gguf_blocks.h's layouts): a sub of 32 weights widened to 32 unsigned byte codes
// in one register, multiplied by the row's 32 int8 codes into 8 int32 sums of 4 (lanes 0-3 the first 16 weights,
// 4-7 the second, so a Q6_K sub's two scales apply lane-wise), scaled in float32. The byte product is AVX512-VNNI's
// vpdpbusd where the build has it (on 256-bit registers, AVX512-VL), else AVX2's vpmaddubsw + vpmaddwd: the codes are
// at most 63 (Q8_0 goes in as |q| with its sign on the row's code), so the pairs' 16-bit sums cannot saturate. Offsets
// (Q4_0's -8, Q6_K's -32, Q4_K's mins) are one float a sub (two for Q6_K's halves), times the row's sum of the sub,
// gathered 8 subs at a time into one vector product. Four accumulators in turn: one chained FMA a sub was the bound.
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

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
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

inline __m256i row_codes(const Row& x, int64_t k) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a.data() + k));
}

// The 8 float lanes of a sub's int32 sums times its scale (one, or s_lo on lanes 0-3 and s_hi on 4-7) and the row's d.
inline __m256 scaled(__m256i sums, __m256 scale, float d) {
  return _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, _mm256_set1_ps(d)));
}

inline float hsum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// One row of the 32-weight types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1).
template <int64_t kType>
float row32(const uint8_t* w, const Row& x) {
  constexpr bool five = kType == Q5_0 || kType == Q5_1, affine = kType == Q4_1 || kType == Q5_1;
  constexpr int64_t bytes = kType == Q8_0 ? 34 : kType == Q4_0 ? 18 : kType == Q4_1 ? 20 : kType == Q5_0 ? 22 : 24;
  constexpr int64_t qs = (affine ? 4 : 2) + (five ? 4 : 0);
  constexpr float shift = kType == Q4_0 ? -8.f : kType == Q5_0 ? -16.f : 0.f;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 off = _mm256_setzero_ps();
  alignas(32) float c[8];
  const int64_t subs = x.K / 32;
  int64_t b = 0;
  const auto one = [&](int64_t i, int slot) {
    const uint8_t* blk = w + i * bytes;
    const float d = f16(blk);
    const __m256i a = row_codes(x, 32 * i);
    __m256i p;
    if constexpr (kType == Q8_0) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      p = dot_u8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(a, q));
    } else {
      __m256i u = nibbles16(blk + qs);
      if constexpr (five) u = _mm256_or_si256(u, fifth_bits(blk + qs - 4));
      p = dot_u8(u, a);
    }
    acc[slot & 3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * x.d[i]), acc[slot & 3]);
    return affine ? f16(blk + 2) : shift * d;  // the sub's offset a weight
  };
  for (; b + 8 <= subs; b += 8) {
    for (int j = 0; j < 8; ++j) c[j] = one(b + j, j);
    if constexpr (kType != Q8_0) off = _mm256_fmadd_ps(_mm256_load_ps(c), _mm256_loadu_ps(x.sum32.data() + b), off);
  }
  float tail = 0.f;
  for (; b < subs; ++b) {
    const float cb = one(b, static_cast<int>(b));
    if constexpr (kType != Q8_0) tail += cb * x.sum32[b];
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) + hsum(off) + tail;
}

// One row of Q4_K / Q5_K: per super-block the 8 subs' scales and mins unpacked once.
template <bool kFive>
float row_k4(const uint8_t* w, const Row& x) {
  constexpr int64_t bytes = kFive ? 176 : 144;
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 off = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < x.K; k0 += 256, w += bytes) {
    uint64_t scb, mnb;
    scales_mins_k4(w + 4, &scb, &mnb);
    const __m256 m8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(mnb))));
    off = _mm256_fnmadd_ps(_mm256_mul_ps(m8, _mm256_set1_ps(f16(w + 2))), _mm256_loadu_ps(x.sum32.data() + k0 / 32),
                           off);
    // each sub's scale times the row's d, broadcast per sub below
    const __m256 sd = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(scb)))),
                      _mm256_set1_ps(f16(w))),
        _mm256_loadu_ps(x.d.data() + k0 / 32));
    const uint8_t* qs = w + (kFive ? 48 : 16);
    const __m256i qh = kFive ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)) : __m256i{};
    for (int p = 0; p < 4; ++p) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      __m256i u[2] = {low4(q), high4(q)};
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * p + h;
        if constexpr (kFive)
          u[h] = _mm256_or_si256(
              u[h], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1)), 4));
        const int64_t k = k0 + 32 * j;
        const __m256 scale = _mm256_permutevar8x32_ps(sd, _mm256_set1_epi32(j));
        acc[h + 2 * (p & 1)] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8(u[h], row_codes(x, k))), scale,
                                               acc[h + 2 * (p & 1)]);
      }
    }
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) + hsum(off);
}

// One row of Q6_K: per half of 128 weights, four subs from two 32-byte runs of low nibbles and one of high pairs.
float row_q6k(const uint8_t* w, const Row& x) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 off = _mm256_setzero_ps();
  const __m256i three = _mm256_set1_epi8(3);
  alignas(32) float s[16];
  for (int64_t k0 = 0; k0 < x.K; k0 += 256, w += 210) {
    const float d = f16(w + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
    for (int i = 0; i < 16; ++i) s[i] = d * static_cast<float>(sc[i]);
    // the offsets: -32 * s per half of 16 weights, times the row's sums of those halves
    off = _mm256_fmadd_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(x.sum.data() + k0 / 16), off);
    off = _mm256_fmadd_ps(_mm256_loadu_ps(s + 8), _mm256_loadu_ps(x.sum.data() + k0 / 16 + 8), off);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
      const __m256i bottom[4] = {low4(ql0), low4(ql1), high4(ql0), high4(ql1)};
      for (int t = 0; t < 4; ++t) {
        const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), three);
        const __m256i u = _mm256_or_si256(bottom[t], _mm256_slli_epi16(top, 4));
        const int64_t k = k0 + 128 * h + 32 * t;
        const int i = 8 * h + 2 * t;
        const __m256 scale = _mm256_set_m128(_mm_set1_ps(s[i + 1]), _mm_set1_ps(s[i]));
        acc[t] = _mm256_add_ps(acc[t], scaled(dot_u8(u, row_codes(x, k)), scale, x.d[k / 32]));
      }
    }
  }
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) - 32.f * hsum(off);
}

float row_dot(int64_t type, const uint8_t* w, const Row& x) {
  switch (type) {
    case Q8_0: return row32<Q8_0>(w, x);
    case Q4_0: return row32<Q4_0>(w, x);
    case Q4_1: return row32<Q4_1>(w, x);
    case Q5_0: return row32<Q5_0>(w, x);
    case Q5_1: return row32<Q5_1>(w, x);
    case Q4_K: return row_k4<false>(w, x);
    case Q5_K: return row_k4<true>(w, x);
    case Q6_K: return row_q6k(w, x);
    default: return 0.f;
  }
}

}  // namespace

void rows_avx2(int64_t type, const uint8_t* W, int64_t row_bytes, const Row& x, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n) y[n] = row_dot(type, W + n * row_bytes, x);
}

}  // namespace gguf
}  // namespace static_decode_kernels
#endif
