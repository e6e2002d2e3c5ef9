// What the decode attention kernels share (decode_attention.cpp over float caches, decode_attention_int8.cpp over
// int8 ones): how the key axis is split into work items, the window's first key, and the combine of the items'
// partial softmax results. Built by static_decode/cpu_kernel.py.
#pragma once

#include "attention_avx512.h"

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

namespace static_decode_kernels::attention {

constexpr int64_t kSplit = 512;  // keys per work item at most (the flash-decoding split)
constexpr int64_t kMaxD = 256;  // the largest head_dim with code (checks.h's kHeadDims)

// The oldest key the query at `pos` sees through a window of `window` keys (pos - window < j), at least 0.
inline int64_t window_start(int64_t pos, int64_t window) { return std::max<int64_t>(0, pos - window + 1); }

// The next block's key and value rows of a work item, fetched into L1 one key at a time while the current block's
// values are summed (`(*this)(j)` once per key j of that loop): spread over the arithmetic, the loads arrive in time,
// where the hardware prefetcher alone left the value pass waiting on memory (profiles/RESULTS.md). Keys past the
// item's end are never touched.
struct NextRows {
  const char* k = nullptr;  // the next block's first key row (bytes)
  const char* v = nullptr;  // and value row
  int64_t k_stride = 0, v_stride = 0;  // bytes between rows
  int64_t rows = 0;  // rows of the next block inside the item (0: none, or not this caller's to fetch)
  int64_t row_bytes = 0;  // bytes of one row (head_dim x element size)

  void operator()(int64_t j) const {
    if (j >= rows) return;
    for (int64_t x = 0; x < row_bytes; x += 64) {
      __builtin_prefetch(k + j * k_stride + x, 0, 3);
      __builtin_prefetch(v + j * v_stride + x, 0, 3);
    }
  }
};

// The NextRows of the block after [j0, j0 + kBlock) of an item ending at s1, over rows of `row_bytes`.
template <typename T>
inline NextRows next_rows(const T* k, int64_t ks, const T* v, int64_t vs, int64_t j0, int64_t s1, int64_t row_bytes) {
  const int64_t start = j0 + kBlock;
  const int64_t rows = std::clamp<int64_t>(s1 - start, 0, kBlock);
  if (rows == 0) return {};
  return {reinterpret_cast<const char*>(k + start * ks), reinterpret_cast<const char*>(v + start * vs),
          ks * static_cast<int64_t>(sizeof(T)), vs * static_cast<int64_t>(sizeof(T)), rows, row_bytes};
}

// Query rows accumulate_rows takes together at head_dim NX x 16: R x NX accumulators in registers.
// 24 of AVX-512's 32 vector registers; 12 of AVX2's 16, which 24 accumulators would overflow.
constexpr int kAccVectors = at::vec::Vectorized<float>::size() == 16 ? 24 : 12;
template <int NX>
constexpr int group_rows = NX >= kAccVectors ? 1 : kAccVectors / NX;

// acc[row] = alpha[row] * acc[row] + sum_j p[row][j] * v[j] for the R rows of a group at once (r <= R used): each
// value row is loaded once for the whole group (`value(j, x)`: the x-th float vector of value row j), R x NX
// accumulators held in registers (R * NX <= 24); `next` fetches the next block's rows as it goes.
template <int NX, int R, typename Value>
inline void accumulate_rows(const int64_t* rows, int64_t r, float* acc, const float* alpha, const float* s, int64_t n,
                            Value value, const NextRows& next) {
  constexpr int64_t d = NX * Vec::size();
  Vec a[R][NX];
  for (int i = 0; i < R; ++i) {
    if (i >= r) break;
    for (int x = 0; x < NX; ++x) a[i][x] = Vec::loadu(acc + rows[i] * d + x * Vec::size()) * Vec(alpha[rows[i]]);
  }
  for (int64_t j = 0; j < n; ++j) {
    next(j);
    Vec vr[NX];
    for (int x = 0; x < NX; ++x) vr[x] = value(j, x);
    for (int i = 0; i < R; ++i) {
      if (i >= r) break;
      const Vec p(s[rows[i] * kBlock + j]);
      for (int x = 0; x < NX; ++x) a[i][x] = at::vec::fmadd(p, vr[x], a[i][x]);
    }
  }
  for (int i = 0; i < R; ++i) {
    if (i >= r) break;
    for (int x = 0; x < NX; ++x) a[i][x].store(acc + rows[i] * d + x * Vec::size());
  }
}

// Combine the splits into out (q's dtype O, written here: no float32 copy of q or of the output is allocated):
// out = sum_c e^(mx_c - top) acc_c / sum_c e^(mx_c - top) l_c; no visible key: zeros.
template <typename O>
inline void combine(const float* part, int64_t BH, int64_t M, int64_t d, int64_t nsplit, O* op) {
  float o[kMaxD];
  for (int64_t bh = 0; bh < BH; ++bh) {
    for (int64_t m = 0; m < M; ++m) {
      std::fill(o, o + d, 0.f);
      float top = kNegInf;
      bool nan = false;  // a split met a NaN score (its l is NaN): the row is NaN, as the other formulations give
      for (int64_t c = 0; c < nsplit; ++c) {
        const float* p = part + (bh * nsplit + c) * M * (d + 2);
        const float lc = p[M * d + M + m];
        nan = nan || std::isnan(lc);
        if (lc > 0.f) top = std::max(top, p[M * d + m]);
      }
      float den = 1.f;
      if (nan) {
        std::fill(o, o + d, std::numeric_limits<float>::quiet_NaN());
      } else if (top != kNegInf) {
        den = 0.f;
        for (int64_t c = 0; c < nsplit; ++c) {
          const float* p = part + (bh * nsplit + c) * M * (d + 2);
          const float lc = p[M * d + M + m];
          if (!(lc > 0.f)) continue;
          const float w = std::exp(p[M * d + m] - top);
          den += w * lc;
          for (int64_t x = 0; x < d; ++x) o[x] += w * p[m * d + x];
        }
      }
      O* dst = op + (bh * M + m) * d;
      for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<O>(o[x] / den);
    }
  }
}

// How the key axis is split into work items: (items per KV head, keys per item). The keys split evenly over the
// longest visible span (not the read bucket, which may hold far more keys than any row sees; under a sliding window
// a row's span starts at its slot 0's window, so it is at most window + slots - 1 keys), in items of at most
// kSplit keys, and into more items where that makes the count a multiple of the threads, as long as an item keeps a
// block of keys: 3 KV heads on 2 threads were 3 items (2 on one thread, 1 on the other) or 9 unequal ones; now 6
// or 12 equal ones, so neither thread waits for the other.
inline std::pair<int64_t, int64_t> plan_splits(const int64_t* lens, const int64_t* n_new, int64_t window, int64_t B,
                                        int64_t H, int64_t slots, int64_t S, int64_t threads) {
  int64_t visible = 0;  // the longest span of keys any row's query rows see
  for (int64_t b = 0; b < B; ++b)
    if (n_new[b] > 0)
      visible = std::max(visible, std::clamp<int64_t>(lens[b] - n_new[b] + std::min(slots, n_new[b]), 0, S) -
                                      (window > 0 ? window_start(lens[b] - n_new[b], window) : 0));
  int64_t nsplit = std::max<int64_t>(1, (visible + kSplit - 1) / kSplit);
  while ((B * H * nsplit) % std::max<int64_t>(threads, 1) != 0 && visible / (nsplit + 1) >= kBlock) ++nsplit;
  const int64_t split = std::max<int64_t>(16, ((visible + nsplit - 1) / nsplit + 15) / 16 * 16);  // whole 16-key groups
  return {nsplit, split};
}

}  // namespace static_decode_kernels::attention
