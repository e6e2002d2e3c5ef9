// GGUF's quantized blocks (llama.cpp's ggml types), read in place: each type's layout written once, here, as the
// scalar decoding of one run of 32 weights, which the dequantization and the portable products use and the ISA
// loops (gguf_avx2.cpp) mirror with vectors. static_decode/model/gguf_quant.py holds the weights as the file's bytes.
//
// Every type's 32-weight run ("sub") decodes to integer codes q and, for each half of 16, a scale s and an offset c,
// with the weight w = s * q + c computed in float32 exactly as gguf.quants.dequantize computes it (the product
// rounded, then the offset added where the type has one):
//   Q8_0  34 bytes / 32:  d (f16), 32 int8 q                         w = d * q
//   Q4_0  18 bytes / 32:  d, 16 bytes of nibbles                     w = d * (u - 8)
//   Q4_1  20 bytes / 32:  d, m (f16), nibbles                        w = d * u + m
//   Q5_0  22 bytes / 32:  d, qh (32 fifth bits), nibbles             w = d * (u - 16)
//   Q5_1  24 bytes / 32:  d, m, qh, nibbles                          w = d * u + m
//   Q4_K 144 bytes / 256: d, dmin, 12 bytes of 6-bit (sc, mn) x 8, 128 bytes of nibbles
//                                                                    w = (d * sc) * u - (dmin * mn)
//   Q5_K 176 bytes / 256: d, dmin, scales as Q4_K, 32 bytes of fifth bits, nibbles      (as Q4_K)
//   Q6_K 210 bytes / 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 sc, d
//                                                                    w = (d * sc) * (u - 32), sc per 16
// The nibbles of a 32-weight block: byte j holds weight j (low) and j + 16 (high). Q4_K/Q5_K: bytes 32p + j hold
// weight j of sub 2p (low) and of sub 2p + 1 (high). Q6_K: per half h of 128 weights, sub 4h + t's weight l is
// ql[64h + l + 32 (t & 1)] >> 4 (t >> 1) | ((qh[32h + l] >> 2t) & 3) << 4.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace static_decode_kernels {
namespace gguf {

// ggml's type numbers (gguf.GGMLQuantizationType), which the Python side passes.
enum Type : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Layout {
  int64_t weights;  // per block
  int64_t bytes;    // per block
};

struct TypeInfo {
  int64_t type;
  const char* name;
  Layout layout;
};
inline constexpr TypeInfo kTypes[] = {
    {Q4_0, "Q4_0", {32, 18}},   {Q4_1, "Q4_1", {32, 20}},   {Q5_0, "Q5_0", {32, 22}},   {Q5_1, "Q5_1", {32, 24}},
    {Q8_0, "Q8_0", {32, 34}},   {Q4_K, "Q4_K", {256, 144}}, {Q5_K, "Q5_K", {256, 176}}, {Q6_K, "Q6_K", {256, 210}}};

// The layout of `type`; weights 0 for a type this file does not know.
inline Layout layout(int64_t type) {
  for (const TypeInfo& t : kTypes)
    if (t.type == type) return t.layout;
  return {0, 0};
}

inline const char* type_name(int64_t type) {
  for (const TypeInfo& t : kTypes)
    if (t.type == type) return t.name;
  return "an unknown type";
}

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K / Q5_K: sub j's 6-bit scale and min from the 12 packed bytes.
inline void scale_min_k4(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K / Q5_K: the 8 subs' 6-bit scales (*sc) and mins (*mn) from the 12 packed bytes at once, one byte each, sub j
// in byte j (scale_min_k4's arithmetic on four bytes a word).
inline void scales_mins_k4(const uint8_t* s, uint64_t* sc, uint64_t* mn) {
  uint32_t w0, w1, w2;
  std::memcpy(&w0, s, 4);
  std::memcpy(&w1, s + 4, 4);
  std::memcpy(&w2, s + 8, 4);
  const uint64_t sc_lo = w0 & 0x3f3f3f3fu, sc_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
  const uint64_t mn_lo = w1 & 0x3f3f3f3fu, mn_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
  *sc = sc_lo | (sc_hi << 32);
  *mn = mn_lo | (mn_hi << 32);
}

// One sub of 32 weights: w[i] = s[i / 16] * q[i] (+ c[i / 16] where `offset`).
struct Sub {
  int16_t q[32];
  float s[2];
  float c[2];
  bool offset;
};

// Sub `j` (0 .. weights / 32 - 1) of the block at `b`.
inline void decode_sub(int64_t type, const uint8_t* b, int j, Sub& out) {
  out.offset = false;
  out.c[0] = out.c[1] = 0.f;
  switch (type) {
    case Q8_0: {
      out.s[0] = out.s[1] = half(b);
      for (int i = 0; i < 32; ++i) out.q[i] = static_cast<int8_t>(b[2 + i]);
      return;
    }
    case Q4_0:
    case Q4_1: {
      const uint8_t* qs = b + (type == Q4_0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) {
        out.q[i] = qs[i] & 15;
        out.q[i + 16] = qs[i] >> 4;
      }
      out.s[0] = out.s[1] = half(b);
      if (type == Q4_0) {
        for (int i = 0; i < 32; ++i) out.q[i] -= 8;
      } else {
        out.offset = true;
        out.c[0] = out.c[1] = half(b + 2);
      }
      return;
    }
    case Q5_0:
    case Q5_1: {
      const uint8_t* h = b + (type == Q5_0 ? 2 : 4);
      uint32_t qh;
      std::memcpy(&qh, h, 4);
      const uint8_t* qs = h + 4;
      for (int i = 0; i < 16; ++i) {
        out.q[i] = (qs[i] & 15) | (((qh >> i) & 1) << 4);
        out.q[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      }
      out.s[0] = out.s[1] = half(b);
      if (type == Q5_0) {
        for (int i = 0; i < 32; ++i) out.q[i] -= 16;
      } else {
        out.offset = true;
        out.c[0] = out.c[1] = half(b + 2);
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      int sc, mn;
      scale_min_k4(b + 4, j, &sc, &mn);
      out.s[0] = out.s[1] = half(b) * static_cast<float>(sc);  // exact: 11 x 6 significant bits
      out.c[0] = out.c[1] = -(half(b + 2) * static_cast<float>(mn));
      out.offset = true;
      const uint8_t* qs = b + (type == Q4_K ? 16 : 48) + 32 * (j / 2);
      const int shift = 4 * (j & 1);
      for (int i = 0; i < 32; ++i) out.q[i] = (qs[i] >> shift) & 15;
      if (type == Q5_K)
        for (int i = 0; i < 32; ++i) out.q[i] |= ((b[16 + i] >> j) & 1) << 4;
      return;
    }
    case Q6_K: {
      const int h = j / 4, t = j % 4;
      const uint8_t* ql = b + 64 * h + 32 * (t & 1);
      const uint8_t* qh = b + 128 + 32 * h;
      const int shift = 4 * (t >> 1);
      for (int i = 0; i < 32; ++i) out.q[i] = (((ql[i] >> shift) & 15) | (((qh[i] >> (2 * t)) & 3) << 4)) - 32;
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192 + 8 * h + 2 * t);
      const float d = half(b + 208);
      out.s[0] = d * static_cast<float>(sc[0]);  // exact: 11 x 8 significant bits
      out.s[1] = d * static_cast<float>(sc[1]);
      return;
    }
    default: return;
  }
}

// The row a product multiplies, quantized once per call as llama.cpp quantizes activations (its Q8_0 blocks): per 32
// values d = max|x| / 127 and codes x / d rounded to nearest even (0 where d is 0; d NaN where the block holds a NaN
// or an infinity, so that every sum it enters is NaN); per 16 values d * (sum of the codes), which the offsets take.
struct Row {
  int64_t K = 0;
  std::vector<int8_t> a;    // [K]
  std::vector<float> d;     // [K / 32]
  std::vector<float> sum;   // [K / 16]
  std::vector<float> sum32; // [K / 32]: the two halves' sums added
};
void quantize_row(const float* x, int64_t K, Row& row);

// Rows [n0, n1) of W (blocks of `type`, `row_bytes` a row) times the row into y (float32 sums).
void rows_portable(int64_t type, const uint8_t* W, int64_t row_bytes, const Row& x, int64_t n0, int64_t n1, float* y);
#if defined(__AVX2__)
void rows_avx2(int64_t type, const uint8_t* W, int64_t row_bytes, const Row& x, int64_t n0, int64_t n1, float* y);
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__)
#define STATIC_DECODE_GGUF_AVX512 1
// The K-quants' 512-bit loops (gguf_avx512.cpp); false for a type they leave to AVX2's.
bool rows_avx512(int64_t type, const uint8_t* W, int64_t row_bytes, const Row& x, int64_t n0, int64_t n1, float* y);
#else
#define STATIC_DECODE_GGUF_AVX512 0
#endif
// The build's loop: AVX-512's for the K-quants where the build has VNNI, AVX2's (with VNNI's byte products where the
// build has them), else the portable one.
inline void rows(int64_t type, const uint8_t* W, int64_t row_bytes, const Row& x, int64_t n0, int64_t n1, float* y) {
#if STATIC_DECODE_GGUF_AVX512
  if (rows_avx512(type, W, row_bytes, x, n0, n1, y)) return;
#endif
#if defined(__AVX2__)
  rows_avx2(type, W, row_bytes, x, n0, n1, y);
#else
  rows_portable(type, W, row_bytes, x, n0, n1, y);
#endif
}

}  // namespace gguf
}  // namespace static_decode_kernels
