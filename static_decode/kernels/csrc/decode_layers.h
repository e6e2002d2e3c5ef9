// What decode_layers.cpp and its argument checks (decode_layers_checks.cpp) share: the order of a layer's tensors
// and the check itself. Built together by static_decode/cpu_kernel.py.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include "kernels.h"

#include <cstdint>
#include <vector>

namespace static_decode_kernels::layers {

constexpr int64_t kPerLayer = 9;  // weights per layer, in this order:
enum { kInNorm, kQ, kK, kV, kO, kPostNorm, kGate, kUp, kDown };
// A quantized model's layers also pass the scales of their 7 projections (decode_layers_q), in this order:
constexpr int64_t kQuantPerLayer = 7;
constexpr int kQuantIndex[kPerLayer] = {-1, 0, 1, 2, 3, -1, 4, 5, 6};  // weight index -> its scales' index

// The layers' cache: K/V [L, 1, Hkv, max_len + 1, d] in a float dtype, or an int8 cache's codes with its scales
// k_scale/v_scale [L, 1, Hkv, max_len + 1] float32 (static_decode/core/kv_quant.py); the scales null otherwise.
struct Cache {
  at::Tensor& k;
  at::Tensor& v;
  const at::Tensor* k_scale = nullptr;
  const at::Tensor* v_scale = nullptr;
};

// Everything the layers index with, checked before the cache is written (rule 6); a quantized model's QuantMats
// (group >= 0: 0 for int8 weights, the int4 group otherwise; -1: float weights, no scales; `types` not empty: GGUF
// blocks, kQuantPerLayer types a layer, group -1 and no scales).
std::vector<QuantMat> check_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                   const Cache& cache, const at::Tensor& lens, const at::Tensor& n_new,
                                   const at::Tensor& lens_after, int64_t read_len, at::TensorList weights,
                                   at::TensorList scales, int64_t group, at::IntArrayRef windows,
                                   at::IntArrayRef types = {});

}  // namespace static_decode_kernels::layers
