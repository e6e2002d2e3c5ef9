// The one-row products' inner loops for CPUs with AVX2 and FMA but neither AVX512-BF16 nor AVX512-VNNI (AMD Zen 2 and
// 3, Intel Core without AVX-512, AVX-512 CPUs before Cooper Lake): bfloat16 weights, and int8 / int4 weights times
// a bfloat16 row's int8 codes. gemv_bf16.cpp, gemv_quant.cpp and decode_layers.cpp dispatch here (kernels.h, `avx2`)
// where the build has no better instruction. Built with the other kernels by static_decode/cpu_kernel.py.
//
// * bfloat16: AVX2 has no bfloat16 dot product, so 16 weights are widened in registers by one shift (the even
//   ones: a bfloat16 is the upper half of its float32) and one AND (the odd ones), and the row's 16 values the same
//   way once per step for all the rows; two FMAs per 16 weights into an even and an odd accumulator.
// * int8 and int4 times the row's int8 codes (the VNNI path's row: blocks of kRowBlock8 values, d = max|x| / 127,
//   codes rounded to nearest even; cpu_kernel.row_codes8 states it): vpmaddubsw multiplies unsigned by signed bytes
//   and adds pairs into int16, vpmaddwd adds those pairs into int32, 8 lanes per 32 codes. int4 codes (0..15) are
//   unsigned already; an int8 weight goes in as |w| with its sign moved onto the row's code (vpsignb), so no pair
//   sum overflows int16 (2 * 128 * 127 < 32768). Each block's 8 lanes are scaled by the row block's d (and an int4
//   group's s); int4's offset (z - 8 s) per group times the row's sum per group (a8grp) comes in once per row.
#include "kernels.h"

#if STATIC_DECODE_AVX2

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace static_decode_kernels::avx2 {
namespace {

// Rows per step and prefetch distance: a block of R rows is one contiguous run of bytes read as R streams; each step
// prefetches the lines it consumes a fixed distance further on (as the AVX-512 loops do: short rows leave the hardware
// prefetcher too little of each stream to learn). Measured on SmolLM2's shapes with the AVX2 build on a Zen 4
// (profiles/RESULTS.md, "AVX2 kernels"): bfloat16 2 rows of 32 columns a step, 16 KB ahead (4 rows of 16: 12% slower
// on two threads; no prefetch: 40%); the quantized loops 4 rows, 8 KB ahead (2 or 3 rows, 4 or 16 KB: within the
// noise).
constexpr int kRowsBf16 = 2;
constexpr int kStepsBf16 = 2;  // 16-column vectors a row per step
constexpr int64_t kAheadBf16 = 16384;
constexpr int kRowsQ = 4;
constexpr int64_t kAhead = 8192;
constexpr int64_t B8 = kRowBlock8;  // 32 codes a block: one 256-bit vector
static_assert(B8 == 32, "a row block is one vector of codes");

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

inline int32_t hsum_epi32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

inline void prefetch_step(const char* at, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(at + b, _MM_HINT_T0);
}

// ---- bfloat16 -----------------------------------------------------------------------------------------------------
// Rows [n, n1) R at a time, U vectors of 16 columns per row and step, each vector into an even and an odd accumulator.
template <int R, int U>
void bf16_block(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n, int64_t n1, float* y, int64_t ahead_b) {
  constexpr int64_t S = 16 * U;  // columns a step
  const int64_t body = K / S * S;
  const __m256i odd = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (; n + R <= n1; n += R) {
    const uint16_t* w = W + n * K;
    const char* ahead = reinterpret_cast<const char*>(w) + ahead_b;
    __m256 ae[R][U], ao[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) ae[r][u] = ao[r][u] = _mm256_setzero_ps();
    for (int64_t k = 0; k < body; k += S) {
      prefetch_step(ahead + k * 2 * R, 2 * S * R);
      for (int u = 0; u < U; ++u) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k + 16 * u));
        const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16));
        const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(xv, odd));
        for (int r = 0; r < R; ++r) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * K + k + 16 * u));
          ae[r][u] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), xe, ae[r][u]);
          ao[r][u] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(wv, odd)), xo, ao[r][u]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_add_ps(ae[r][0], ao[r][0]);
      for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, _mm256_add_ps(ae[r][u], ao[r][u]));
      float s = hsum(a);
      for (int64_t k = body; k < K; ++k) s += bf16_to_float(w[r * K + k]) * bf16_to_float(x[k]);
      y[n + r] = s;
    }
  }
  if constexpr (R > 1) bf16_block<1, U>(W, x, K, n, n1, y, ahead_b);
}

// ---- int8 and int4 times the row's codes --------------------------------------------------------------------------
// The 8 int32 sums of pairs of pairs of w * a (w unsigned, a signed bytes).
inline __m256i dot_u8s8(__m256i w, __m256i a) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
}

template <int R>
void int8_block(const QuantMat& m, const QuantRow& x, int64_t n, float* y) {
  const int64_t K = x.K, body = K / B8;
  const int8_t* Q = static_cast<const int8_t*>(m.q) + n * K;
  const char* ahead = reinterpret_cast<const char*>(Q) + kAhead;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const auto step = [&](int64_t b, auto load) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a8 + B8 * b));
    const __m256 d = _mm256_broadcast_ss(x.ablk + b);
    for (int r = 0; r < R; ++r) {
      const __m256i w = load(Q + r * K + B8 * b);
      const __m256i p = dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));  // |w| * (a * sign w)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[r]);
    }
  };
  for (int64_t b = 0; b < body; ++b) {
    prefetch_step(ahead + b * B8 * R, B8 * R);
    step(b, [](const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); });
  }
  if (body * B8 < K) {  // the last block's codes past K read as zero (the row's codes are zero there too)
    const int64_t tail = K - body * B8;
    step(body, [tail](const int8_t* p) {
      alignas(32) int8_t t[B8] = {};
      std::memcpy(t, p, tail);
      return _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
    });
  }
  for (int r = 0; r < R; ++r) y[n + r] = hsum(acc[r]) * scale_at(m, n + r);
}

// Rows [n, n + R)'s int4 scales (bfloat16 (s, z) pairs [N, G]) as float32 into sbuf [R, G], times each block's d at
// group 32 (the loop then multiplies once a block), and each row's offset sum_g (z_g - 8 s_g) * a8grp[g] into off.
template <int R>
void int4_scales(const QuantMat& m, const QuantRow& x, int64_t n, int64_t G, bool by_block, float* sbuf, float* off) {
  const auto* S = static_cast<const uint32_t*>(m.s);  // s | z << 16 per group
  const __m256i zmask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256 eight = _mm256_set1_ps(8.f);
  prefetch_step(reinterpret_cast<const char*>(S + n * G) + kAhead / 4, R * G * 4);  // the scales' own stream
  for (int r = 0; r < R; ++r) {
    const uint32_t* p = S + (n + r) * G;
    float* s = sbuf + r * G;
    __m256 o = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= G; g += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + g));
      const __m256 sv = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), zv = _mm256_castsi256_ps(_mm256_and_si256(v, zmask));
      _mm256_storeu_ps(s + g, by_block ? _mm256_mul_ps(sv, _mm256_loadu_ps(x.ablk + g)) : sv);
      o = _mm256_fmadd_ps(_mm256_fnmadd_ps(sv, eight, zv), _mm256_loadu_ps(x.a8grp + g), o);
    }
    float t = hsum(o);
    for (; g < G; ++g) {
      const float sg = bf16_to_float(static_cast<uint16_t>(p[g])), zg = bf16_to_float(static_cast<uint16_t>(p[g] >> 16));
      s[g] = by_block ? sg * x.ablk[g] : sg;
      t += (zg - 8.f * sg) * x.a8grp[g];
    }
    off[r] = t;
  }
}

// int4 rows [n, n + R): a 64-column chunk's 32 bytes hold its first 32 columns in the low nibbles and the next 32 in
// the high ones (quant.py's pack_int4), so one AND and one shift give the codes of the row's two blocks of the chunk.
template <int kGroup, int R>
void int4_block(const QuantMat& m, const QuantRow& x, int64_t n, float* sbuf, float* y) {
  const int64_t K = x.K, G = K / kGroup, half = K / 2, C = K / 64;
  const auto* Q = static_cast<const uint8_t*>(m.q) + n * half;
  const __m256i low = _mm256_set1_epi8(0x0F);
  float off[R];
  int4_scales<R>(m, x, n, G, kGroup == B8, sbuf, off);
  const char* ahead = reinterpret_cast<const char*>(Q) + kAhead;
  __m256 acc[R], dacc[R];
  for (int r = 0; r < R; ++r) acc[r] = dacc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    prefetch_step(ahead + c * 32 * R, 32 * R);
    const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a8 + 64 * c));
    const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a8 + 64 * c + 32));
    for (int r = 0; r < R; ++r) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Q + r * half + 32 * c));
      const __m256 p0 = _mm256_cvtepi32_ps(dot_u8s8(_mm256_and_si256(w, low), a0));
      const __m256 p1 = _mm256_cvtepi32_ps(dot_u8s8(_mm256_and_si256(_mm256_srli_epi16(w, 4), low), a1));
      const float* s = sbuf + r * G;
      if constexpr (kGroup == B8) {  // s holds s * d
        acc[r] = _mm256_fmadd_ps(p0, _mm256_broadcast_ss(s + 2 * c), acc[r]);
        acc[r] = _mm256_fmadd_ps(p1, _mm256_broadcast_ss(s + 2 * c + 1), acc[r]);
      } else {
        dacc[r] = _mm256_fmadd_ps(p0, _mm256_broadcast_ss(x.ablk + 2 * c), dacc[r]);
        dacc[r] = _mm256_fmadd_ps(p1, _mm256_broadcast_ss(x.ablk + 2 * c + 1), dacc[r]);
        if ((64 * (c + 1)) % kGroup == 0) {  // the group ends with this chunk
          acc[r] = _mm256_fmadd_ps(dacc[r], _mm256_broadcast_ss(s + 64 * (c + 1) / kGroup - 1), acc[r]);
          dacc[r] = _mm256_setzero_ps();
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) y[n + r] = hsum(acc[r]) + off[r];
}

template <int kGroup>
void int4_rows_g(const QuantMat& m, const QuantRow& x, int64_t n0, int64_t n1, float* y) {
  std::vector<float> sbuf(kRowsQ * (x.K / kGroup));
  int64_t n = n0;
  for (; n + kRowsQ <= n1; n += kRowsQ) int4_block<kGroup, kRowsQ>(m, x, n, sbuf.data(), y);
  for (; n < n1; ++n) int4_block<kGroup, 1>(m, x, n, sbuf.data(), y);
}

}  // namespace

void bf16_rows(const uint16_t* W, const uint16_t* x, int64_t K, int64_t n0, int64_t n1, float* y) {
  bf16_block<kRowsBf16, kStepsBf16>(W, x, K, n0, n1, y, kAheadBf16);
}

void int8_rows(const QuantMat& m, const QuantRow& x, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + kRowsQ <= n1; n += kRowsQ) int8_block<kRowsQ>(m, x, n, y);
  for (; n < n1; ++n) int8_block<1>(m, x, n, y);
}

void int4_rows(const QuantMat& m, const QuantRow& x, int64_t n0, int64_t n1, float* y) {
  switch (m.group) {
    case 32: return int4_rows_g<32>(m, x, n0, n1, y);
    case 64: return int4_rows_g<64>(m, x, n0, n1, y);
    default: return int4_rows_g<128>(m, x, n0, n1, y);  // quant_mat admits 32, 64 and 128 only
  }
}

void row_size(int64_t K, int64_t group, QuantRow& row) {
  const int64_t blocks = (K + 63) / 64 * 2;  // whole 64-code chunks, as the int4 loop reads them
  row.q8.assign(B8 * blocks, 0);
  row.blkd.assign(blocks, 0.f);
  row.grp8.assign(group > 0 ? K / group : 0, 0.f);
  row.a8 = row.q8.data();
  row.ablk = row.blkd.data();
  row.a8grp = group > 0 ? row.grp8.data() : nullptr;
}

void round_bf16(const float* x, int64_t k0, int64_t k1, bool bf16, QuantRow& row) {
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), qnan = _mm256_set1_epi32(0x7FC0);
  uint16_t* rb = row.b.data();
  float* rf = row.f.data();
  int64_t k = k0;
  for (; k + 8 <= k1; k += 8) {  // c10::BFloat16's rounding: to nearest even on the bits, NaN to 0x7FC0
    const __m256 v = _mm256_loadu_ps(x + k);
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // 8 uint16 in the low half
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rb + k), _mm256_castsi256_si128(packed));
    _mm256_storeu_ps(rf + k, bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(r, 16)) : v);
  }
  for (; k < k1; ++k) {
    const c10::BFloat16 r(x[k]);
    rb[k] = r.x;
    rf[k] = bf16 ? static_cast<float>(r) : x[k];
  }
}

void quantize_row(const float* x, int64_t k0, int64_t k1, int64_t group, QuantRow& row) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity()), lim = _mm256_set1_ps(127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs' lanes back in column order
  int8_t* q8 = row.q8.data();
  float* blkd = row.blkd.data();
  for (int64_t b = k0 / B8; b * B8 < k1; ++b) {
    const int64_t kb = b * B8, len = std::min(B8, k1 - kb);
    alignas(32) float t[B8] = {};  // the block, zero past k1 (only the row's last block is partial)
    const float* src = x + kb;
    if (len < B8) {
      std::memcpy(t, src, len * sizeof(float));
      src = t;
    }
    __m256 v[4], amax = _mm256_setzero_ps();
    int bad = 0;
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(src + 8 * i);
      const __m256 a = _mm256_and_ps(v[i], absmask);
      bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // an infinity or a NaN
      amax = _mm256_max_ps(amax, a);
    }
    const float d = bad ? std::numeric_limits<float>::quiet_NaN() : hmax(amax) / 127.f;
    __m256i q[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    if (!bad && d > 0.f) {
      const __m256 dv = _mm256_set1_ps(d);
      // cvtps rounds by MXCSR: to nearest even unless someone changed it (nothing in torch does)
      for (int i = 0; i < 4; ++i)
        q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_div_ps(v[i], dv), -lim), lim));
    }
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q8 + kb), _mm256_permutevar8x32_epi32(p, order));
    blkd[b] = d;
    if (group > 0) {  // K is whole groups here (quant_mat checks it)
      const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      row.grp8[kb / group] += d * static_cast<float>(hsum_epi32(sum));
    }
  }
}

}  // namespace static_decode_kernels::avx2

#endif
