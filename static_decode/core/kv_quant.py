"""The int8 KV cache (`Llama.kv_dtype = "int8"`): K and V as int8 codes, one float32 scale per token and KV head.

Symmetric absmax over a row's head_dim values: scale = max |x| / 127, code = round(x / scale) in -127..127 (an
all-zero row: scale 0, codes 0), value = code * scale. Per token and KV head a cache holds d + 4 bytes for each of
K and V against 2d for bfloat16: 0.53x at head_dim 64, 0.52x at 128. The codes live in the cache's K/V buffers
([layers, B, Hkv, max_len + 1, d] int8) and the scales beside them ([layers, B, Hkv, max_len + 1] float32), both
allocated once and written in place with the rows (`write_int8`, called by core/cache.py's write).

How it is read: the CPU decode kernel takes the codes and scales in place (kernels/cpu_kernel.decode_attention_int8);
every other formulation takes `dequantize` of the read-length view it reads (a float32 copy of at most read_len rows
per layer and step) and computes as over a float32 cache.
"""

from __future__ import annotations

import torch

INT8 = torch.int8  # the codes' dtype (KV_DTYPES' "int8")
SCALE_DTYPE = torch.float32  # the scales' dtype: exact for any absmax a float32 or 16-bit model produces
SCALE_BYTES = 4
QMAX = 127  # symmetric: -127..127 (-128 never written)


def is_int8(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` is an int8 (quantized) cache."""
    return dtype == INT8


def attention_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention over a cache of `kv_dtype` computes in outside the CPU kernel: float32 for an int8 cache
    (what `dequantize` gives), the cache's own dtype otherwise."""
    return torch.float32 if is_int8(kv_dtype) else kv_dtype


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] (any float dtype) -> (codes [..., d] int8, scales [...] float32), computed in float32."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / QMAX  # [...]
    safe = torch.where(scale > 0, scale, torch.ones((), dtype=scale.dtype, device=scale.device))
    codes = torch.round(xf / safe[..., None]).clamp_(-QMAX, QMAX).to(INT8)  # [..., d]
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., S, d] int8 and scales [..., S] -> code * scale [..., S, d] in float32 (then `dtype`): a copy."""
    return (codes.to(torch.float32) * scales[..., None].to(torch.float32)).to(dtype)


def write_int8(
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    index: tuple[torch.Tensor, ...],
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Quantize a chunk's K/V ([B, Hkv, T, d]) and write codes and scales at `index` (core/cache.py's write_slots:
    (layer, b, h, position), broadcasting to [B, Hkv, T]) of the code buffers k, v [layers, B, Hkv, max_len + 1, d]
    and the scale buffers [layers, B, Hkv, max_len + 1], in place (index_put_ on the whole buffers, as the float
    write, so inductor reinplaces it)."""
    for codes_buf, scale_buf, new in ((k, k_scale, k_new), (v, v_scale, v_new)):
        codes, scales = quantize(new)  # [B, Hkv, T, d], [B, Hkv, T]
        codes_buf.index_put_(index, codes)
        scale_buf.index_put_(index, scales)
