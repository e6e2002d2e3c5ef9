// The portable products with GGUF blocks (gguf_blocks.h): each sub of 32 weights decoded by the layout's scalar code
// and multiplied by the row's int8 codes in integers, a half of 16 at a time. What a CPU without AVX2 runs, and the
// loop the vector ones (gguf_avx2.cpp) are tested against.
#include "gguf_blocks.h"

#include <cmath>

namespace static_decode_kernels {
namespace gguf {

void quantize_row(const float* x, int64_t K, Row& row) {
  row.K = K;
  row.a.assign(K, 0);
  row.d.assign(K / 32, 0.f);
  row.sum.assign(K / 16, 0.f);
  row.sum32.assign(K / 32, 0.f);
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* v = x + 32 * b;
    float amax = 0.f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      finite = finite && std::isfinite(v[i]);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float d = finite ? amax / 127.f : std::nanf("");
    row.d[b] = d;
    int sums[2] = {0, 0};
    if (d > 0.f) {
      for (int i = 0; i < 32; ++i) {
        const int code = static_cast<int>(std::nearbyint(v[i] / d));  // the default rounding: to nearest even
        row.a[32 * b + i] = static_cast<int8_t>(code);
        sums[i / 16] += code;
      }
    }
    row.sum[2 * b] = d * static_cast<float>(sums[0]);
    row.sum[2 * b + 1] = d * static_cast<float>(sums[1]);
    row.sum32[b] = row.sum[2 * b] + row.sum[2 * b + 1];
  }
}

void rows_portable(int64_t type, const uint8_t* W, int64_t row_bytes, const Row& x, int64_t n0, int64_t n1,
                   float* y) {
  const Layout L = layout(type);
  const int subs = static_cast<int>(L.weights / 32);
  const int64_t blocks = x.K / L.weights;
  Sub sub;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = W + n * row_bytes;
    float acc = 0.f;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      for (int j = 0; j < subs; ++j) {
        decode_sub(type, w + blk * L.bytes, j, sub);
        const int64_t k = blk * L.weights + 32 * j;  // the sub's first column
        const int8_t* a = x.a.data() + k;
        for (int h = 0; h < 2; ++h) {
          int32_t p = 0;
          for (int i = 16 * h; i < 16 * h + 16; ++i) p += static_cast<int32_t>(sub.q[i]) * a[i];
          acc += sub.s[h] * (x.d[k / 32] * static_cast<float>(p)) + sub.c[h] * x.sum[k / 16 + h];
        }
      }
    }
    y[n] = acc;
  }
}

}  // namespace gguf
}  // namespace static_decode_kernels
