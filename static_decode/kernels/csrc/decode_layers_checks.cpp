// The argument checks of the fused decode layers (decode_layers.cpp), run before anything is read or written: a bad
// call from Python raises naming the value and leaves the cache as it was (rule 6).
#include "decode_layers.h"

#include "checks.h"

#include <string>
#include <utility>

namespace static_decode_kernels::layers {

namespace {

// The cache: float K/V of one dtype, or int8 codes with float32 scales [L, 1, Hkv, max_len + 1] beside them.
void check_cache(const Cache& c, const char* op) {
  const at::Tensor &k = c.k, &v = c.v;
  check_cpu(k, op, "k");
  check_cpu(v, op, "v");
  TORCH_CHECK(k.dim() == 5 && k.sizes() == v.sizes() && k.size(1) == 1 && k.stride(4) == 1 && v.stride(4) == 1,
              op, ": k and v must be [L, 1, Hkv, S, d] with contiguous rows, got ", k.sizes(), " ", v.sizes());
  TORCH_CHECK(k.size(0) > 0 && k.size(2) > 0, op, ": k ", k.sizes(), " has no layer or no KV head");
  if (c.k_scale == nullptr) {
    TORCH_CHECK(kernel_float(k.scalar_type()) && v.scalar_type() == k.scalar_type(), op, ": K/V dtypes ",
                k.scalar_type(), "/", v.scalar_type(), " (float32/bfloat16/float16; int8 with decode_layers_kv8)");
    return;
  }
  TORCH_CHECK(k.scalar_type() == at::kChar && v.scalar_type() == at::kChar, op, ": an int8 cache's K/V are ",
              k.scalar_type(), "/", v.scalar_type(), " (int8 codes wanted)");
  for (const auto& [t, name] : {std::pair{c.k_scale, "k_scale"}, {c.v_scale, "v_scale"}}) {
    check_cpu(*t, op, name);
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 4 && t->size(0) == k.size(0) && t->size(1) == 1 &&
                    t->size(2) == k.size(2) && t->size(3) == k.size(3) && t->stride(3) == 1,
                op, ": ", name, " ", t->scalar_type(), " ", t->sizes(), " strides ", t->strides(),
                " must be float32 [L, 1, Hkv, S] of the codes ", k.sizes(), " with the key axis contiguous");
  }
}

}  // namespace

// Devices, dtypes, shapes, strides, no zero size, every layer's weights the shapes of the first's (the buffers are
// sized by it), the head size the attention has code for, and the lengths: n_new 0 or 1, lens_after = lens + n_new
// <= read_len <= max_len (the write at lens stays inside the cache's rows, the attention inside the read); the
// windows: none or one per layer, each >= 0.
std::vector<QuantMat> check_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                   const Cache& cache, const at::Tensor& lens, const at::Tensor& n_new,
                                   const at::Tensor& lens_after, int64_t read_len, at::TensorList weights,
                                   at::TensorList scales, int64_t group, at::IntArrayRef windows,
                                   at::IntArrayRef types) {
  constexpr const char* op = "decode_layers";
  const at::Tensor &k = cache.k;
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&cos, "cos"}, {&sin, "sin"}}) check_cpu(*t, op, name);
  TORCH_CHECK(x.dim() == 3 && x.size(0) == 1 && x.size(1) == 1 && x.size(2) > 0 && x.is_contiguous(),
              "decode_layers: x must be one contiguous row [1, 1, D], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "decode_layers: model dtype ",
              x.scalar_type(), " is not supported here (float32, bfloat16)");
  check_cache(cache, op);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * k.size(0), "decode_layers: ", weights.size(),
              " weights for ", k.size(0), " layers (", kPerLayer, " a layer)");
  TORCH_CHECK(read_len >= 1 && read_len <= k.size(3) - 1, "decode_layers: read_len ", read_len, " outside 1..",
              k.size(3) - 1);
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == k.size(0), "decode_layers: ",
              windows.size(), " windows for ", k.size(0), " layers (none, or one a layer)");
  for (size_t l = 0; l < windows.size(); ++l) {
    const std::string name = "windows[" + std::to_string(l) + "]";
    check_window(windows[l], op, name.c_str());
  }
  const int64_t Hkv = k.size(2), d = k.size(4), D = x.size(2), max_len = k.size(3) - 1;
  TORCH_CHECK(head_dim_supported(d), "decode_layers: head_dim ", d, " is not supported");
  TORCH_CHECK(cos.numel() == d / 2 && sin.numel() == d / 2 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "decode_layers: cos/sin must hold head_dim / 2 values in x's dtype, got ", cos.scalar_type(), " ",
              cos.sizes(), " and ", sin.scalar_type(), " ", sin.sizes());
  const int64_t Nq = weights[kQ].dim() == 2 ? weights[kQ].size(0) : 0, Nkv = Hkv * d;
  const int64_t inner = weights[kGate].dim() == 2 ? weights[kGate].size(0) : 0;
  TORCH_CHECK(Nq >= Nkv && Nq % Nkv == 0 && Nq / Nkv <= kMaxRows && inner > 0,
              "decode_layers: q rows ", Nq, " for ", Hkv, " KV heads of ", d, " (1..", kMaxRows,
              " query heads a KV head), gate rows ", inner);
  const int64_t want[kPerLayer][2] = {{D, -1}, {Nq, D}, {Nkv, D}, {Nkv, D}, {D, Nq}, {D, -1}, {inner, D},
                                      {inner, D}, {D, inner}};
  const bool quantized = group >= 0;
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == (quantized ? kQuantPerLayer * k.size(0) : 0),
              "decode_layers: ", scales.size(), " scales for ", k.size(0), " layers of ",
              quantized ? "quantized" : "float", " weights (", quantized ? kQuantPerLayer : 0, " a layer)");
  const bool blocks = !types.empty();
  TORCH_CHECK(!blocks || (static_cast<int64_t>(types.size()) == kQuantPerLayer * k.size(0) && group == -1),
              "decode_layers: ", types.size(), " GGUF types for ", k.size(0), " layers (", kQuantPerLayer, " a layer)");
  std::vector<QuantMat> mats;
  for (int64_t l = 0; l < k.size(0); ++l) {
    for (int i = 0; i < kPerLayer; ++i) {
      const at::Tensor& t = weights[l * kPerLayer + i];
      check_cpu(t, op, "a weight");
      if (blocks && want[i][1] >= 0) {  // a projection's GGUF blocks: whole blocks of the float weight's rows
        const int64_t type = types[l * kQuantPerLayer + kQuantIndex[i]];
        const gguf::Layout L = gguf::layout(type);
        TORCH_CHECK(L.weights > 0, "decode_layers: layer ", l, " weight ", i, "'s GGUF type ", type,
                    " is not one the kernels read");
        const int64_t bytes = want[i][1] % L.weights == 0 ? want[i][1] / L.weights * L.bytes : -1;
        TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 2 && t.size(0) == want[i][0] && t.size(1) == bytes &&
                        t.is_contiguous(),
                    "decode_layers: layer ", l, " weight ", i, " is ", t.scalar_type(), " ", t.sizes(), "; ",
                    gguf::type_name(type), " blocks of a [", want[i][0], ", ", want[i][1],
                    "] weight are contiguous uint8 [", want[i][0], ", ", bytes, "]");
        mats.push_back(QuantMat{t.data_ptr(), nullptr, 0, 0, false, x.scalar_type() == at::kBFloat16, type,
                                t.size(1)});
        continue;
      }
      if (quantized && want[i][1] >= 0) {  // a projection: its codes and scales, the shape of the float weight's
        int64_t N = 0, K = 0;
        const std::string name = "layer " + std::to_string(l) + " weight " + std::to_string(i);
        mats.push_back(quant_mat(t, scales[l * kQuantPerLayer + kQuantIndex[i]], group, op, name.c_str(), &N, &K));
        TORCH_CHECK(N == want[i][0] && K == want[i][1], "decode_layers: ", name, " is a quantized [", N, ", ", K,
                    "] weight, [", want[i][0], ", ", want[i][1], "] wanted");
        TORCH_CHECK(mats.back().bf16_scales == (x.scalar_type() == at::kBFloat16), "decode_layers: ", name,
                    "'s scales are not in x's dtype ", x.scalar_type());
        continue;
      }
      const bool shape = want[i][1] < 0 ? (t.dim() == 1 && t.size(0) == want[i][0])
                                        : (t.dim() == 2 && t.size(0) == want[i][0] && t.size(1) == want[i][1]);
      TORCH_CHECK(shape && t.is_contiguous() && t.scalar_type() == x.scalar_type(), "decode_layers: layer ", l,
                  " weight ", i, " is ", t.scalar_type(), " ", t.sizes(), " (contiguous, x's dtype, [", want[i][0],
                  want[i][1] < 0 ? "" : ", ", want[i][1] < 0 ? "" : std::to_string(want[i][1]), "] wanted)");
    }
  }
  const int64_t n = lengths(n_new, 1, op, "n_new").data_ptr<int64_t>()[0];
  const int64_t old = lengths(lens, 1, op, "lens").data_ptr<int64_t>()[0];
  const int64_t after = lengths(lens_after, 1, op, "lens_after").data_ptr<int64_t>()[0];
  TORCH_CHECK(n == 0 || n == 1, "decode_layers: n_new ", n, " (one slot: 0 or 1)");
  TORCH_CHECK(old >= 0 && old <= max_len - n, "decode_layers: lens ", old, " outside 0..", max_len - n,
              " (the cache's rows for n_new ", n, ")");
  TORCH_CHECK(after == old + n && after <= read_len, "decode_layers: lens_after ", after, " is not lens + n_new = ",
              old + n, " within read_len ", read_len);
  return mats;
}

}  // namespace static_decode_kernels::layers
