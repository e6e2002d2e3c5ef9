"""Float weights quantized into GGUF blocks (Q8_0, Q4_K, Q5_K, Q6_K), for a model with no GGUF file: the same
formats, bytes and products as a file llama.cpp wrote (static_decode.model.gguf_quant holds and multiplies them).

Each block's parameters are chosen here, in tensor code: Q8_0 as gguf's own quantizer does (d = max|w| / 127); Q4_K /
Q5_K by a search over shrunk ranges of each sub of 32 (as our int4's, least squared error), then the subs' scales
and mins rounded to 6 bits of the super-block's float16 d and dmin and the codes taken again for the rounded
scales; Q6_K symmetric per 16 (s = max|w| / 31), its scales rounded to int8 steps of the super-block's d. The
search is not llama.cpp's (make_qkx2_quants); the layouts are its (csrc/gguf_blocks.h), so the file and the values
are what gguf's dequantize reads.
"""

from __future__ import annotations

import torch

from static_decode.model.gguf_dequant import BLOCK_TYPES

QUANTIZABLE = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")
SHRINK = tuple(1.0 - 0.02 * i for i in range(11))  # the range search's factors (static_decode.model.quant's)


def _f16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 -> (its float16 value as float32, its two bytes [..., 2] uint8)."""
    h = x.to(torch.float16)
    return h.float(), h.contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _q8_0(g: torch.Tensor) -> torch.Tensor:
    """g [N, B, 32] -> blocks [N, B, 34]."""
    d = g.abs().amax(-1, keepdim=True) / 127  # [N, B, 1]
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(g * inv).clamp(-127, 127).to(torch.int8)
    _, db = _f16(d.squeeze(-1))
    return torch.cat([db, q.view(torch.uint8)], dim=-1)


def _range_search(g: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub g [..., 32]: the scale s and min m (w ~ s * q - m, q in 0..top) of least squared error over shrunk
    ranges lo..hi with lo <= 0 (the format's offset is -m, m >= 0)."""
    lo0 = g.amin(-1, keepdim=True).clamp(max=0)
    hi0 = g.amax(-1, keepdim=True)
    best = best_s = best_m = None
    for shrink in SHRINK:
        lo, hi = lo0 * shrink, hi0 * shrink
        s = ((hi - lo) / top).clamp(min=1e-12)
        q = torch.round((g - lo) / s).clamp(0, top)
        err = (q * s + lo - g).pow(2).sum(-1, keepdim=True)
        if best is None:
            best, best_s, best_m = err, s, -lo
            continue
        better = err < best
        best = torch.where(better, err, best)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, -lo, best_m)
    return best_s.squeeze(-1), best_m.squeeze(-1)


def _k4(g: torch.Tensor, five: bool) -> torch.Tensor:
    """g [N, B, 8, 32] -> Q4_K blocks [N, B, 144] (Q5_K: [N, B, 176])."""
    top = 31 if five else 15
    s, m = _range_search(g, top)  # [N, B, 8]
    d, db = _f16(s.amax(-1) / 63)  # [N, B]
    dmin, dminb = _f16(m.amax(-1) / 63)
    sc = torch.where(d[..., None] > 0, torch.round(s / d[..., None]), torch.zeros_like(s)).clamp(0, 63)
    mn = torch.where(dmin[..., None] > 0, torch.round(m / dmin[..., None]), torch.zeros_like(m)).clamp(0, 63)
    scale = (d[..., None] * sc)[..., None]  # [N, B, 8, 1]: the rounded scales, as dequantize computes them
    offset = (dmin[..., None] * mn)[..., None]
    q = torch.where(scale > 0, torch.round((g + offset) / scale), torch.zeros_like(g)).clamp(0, top).to(torch.uint8)
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    packed = torch.cat([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], dim=-1)  # [N, B, 12]
    low = q & 15
    qs = (low[..., 0::2, :] | (low[..., 1::2, :] << 4)).flatten(-2)  # [N, B, 128]: sub 2p low, 2p + 1 high
    parts = [db, dminb, packed]
    if five:
        bits = (q >> 4) & 1  # [N, B, 8, 32]
        shifts = torch.arange(8, device=g.device, dtype=torch.uint8).view(8, 1)
        parts.append((bits << shifts).sum(-2, dtype=torch.uint8))  # qh [N, B, 32]: bit j from sub j
    return torch.cat([*parts, qs], dim=-1)


def _q6_k(g: torch.Tensor) -> torch.Tensor:
    """g [N, B, 256] -> Q6_K blocks [N, B, 210]."""
    g16 = g.unflatten(-1, (16, 16))  # [N, B, 16, 16]
    s = g16.abs().amax(-1) / 31  # [N, B, 16]
    d, db = _f16(s.amax(-1) / 127)  # [N, B]
    sc = torch.where(d[..., None] > 0, torch.round(s / d[..., None]), torch.zeros_like(s)).clamp(-128, 127)
    scale = (d[..., None] * sc)[..., None]  # [N, B, 16, 1]
    q = torch.where(scale != 0, torch.round(g16 / scale), torch.zeros_like(g16)).clamp(-32, 31) + 32
    q = q.to(torch.uint8).reshape(*g.shape[:-1], 2, 4, 32)  # [N, B, half, t, 32]: sub 4h + t
    low, high = q & 15, q >> 4
    ql = torch.cat([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], dim=-1)
    shifts = torch.tensor([0, 2, 4, 6], device=g.device, dtype=torch.uint8).view(4, 1)
    qh = (high << shifts).sum(-2, dtype=torch.uint8)  # [N, B, 2, 32]
    return torch.cat([ql.flatten(-2), qh.flatten(-2), sc.to(torch.int8).view(torch.uint8), db], dim=-1)


def quant_refusal(K: int, kind: str) -> str | None:
    """Why a weight with K inputs cannot take `kind`'s blocks (None when it can)."""
    t = BLOCK_TYPES[kind]
    if K % t.weights == 0:
        return None
    return f"{kind} takes a weight whose {K} inputs are a multiple of {t.weights}; use q8_0 (blocks of 32)"


def quantize_blocks(w: torch.Tensor, kind: str) -> torch.Tensor:
    """w [N, K] (any float dtype) -> uint8 [N, K / weights * bytes], the blocks of `kind` (QUANTIZABLE)."""
    if kind not in QUANTIZABLE:
        raise ValueError(f"GGUF type {kind!r} is not one this quantizes; these are: {', '.join(QUANTIZABLE)}")
    N, K = w.shape
    if why := quant_refusal(K, kind):
        raise ValueError(why)
    t = BLOCK_TYPES[kind]
    g = w.float().reshape(N, K // t.weights, t.weights)  # [N, B, weights]
    if kind == "Q8_0":
        out = _q8_0(g)
    elif kind == "Q6_K":
        out = _q6_k(g)
    else:
        out = _k4(g.unflatten(-1, (8, 32)), five=kind == "Q5_K")
    return out.reshape(N, -1).contiguous()
