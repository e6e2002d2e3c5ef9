"""Rotary position embeddings, including Llama 3's frequency-dependent scaling.

The inverse frequencies are computed in float32 with the same operations, in the same order, as transformers,
so that float32 logits agree to rounding. Positions are device tensors (the cache lengths plus the slot
index), never host ints: cos/sin are computed per step from them, so no table sized by max_len is needed
and a captured step reads no host value.
"""

from __future__ import annotations

import math

import torch

from static_decode.model.config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, Llama 3 scaled when rope.type == "llama3"."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    freq = 1.0 / (rope.theta**exponents)  # [d/2]
    if rope.type == "default":
        return freq
    # Llama 3.1: wavelengths shorter than original/high_freq_factor are kept, longer than
    # original/low_freq_factor are divided by `factor`, and the band between is blended linearly in
    # 1/wavelength.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / freq  # [d/2]
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(
    freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, d/2] for integer positions [B, T], computed in float32 then cast to `dtype`.

    Half width: both halves of a head use the same angles (rotate_half pairing), so `apply` uses them twice.
    """
    angles = positions[..., None].to(torch.float32) * freq  # [B, T, d/2]
    return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]  # [B, 1, T, d/2] each


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, d] by the angles: x * cos + rotate_half(x) * sin (half-split pairing).

    Written half by half into one output (no concatenation): the same elementwise operations, in the same
    dtype and order, as transformers' x * cos + rotate_half(x) * sin, so results agree bit for bit.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [B, H, T, d/2] each
    out = torch.empty_like(x)  # [B, H, T, d]
    out[..., :half] = x1 * cos + (-x2) * sin
    out[..., half:] = x2 * cos + x1 * sin
    return out
