"""Rotary position embeddings: every rope type transformers' `modeling_rope_utils` computes for these families.

Frequencies are computed in float32 with transformers' operations in its order (float32 logits agree to rounding);
positions are device tensors, so no table sized by max_len is needed and a captured step reads no host value.
"dynamic" and "longrope" pick their table by each row's own length after the step, a `torch.where` over tables of
one shape (no read-back, no recompile as a row passes the original context). Details: docs/internals.md#rope.
"""

from __future__ import annotations

import math

import torch

from static_decode.model.rope_config import RopeConfig


def _exponents(rot: int, device: torch.device | str | None) -> torch.Tensor:
    """[rot/2] float32: 2i / rot, as transformers spells it."""
    return torch.arange(0, rot, 2, dtype=torch.int64, device=device).to(torch.float32) / rot


def inv_freq(rope: RopeConfig, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[rot_dim / 2] float32 inverse frequencies: the whole table for the static types, the table within the
    original context for "dynamic" (the unscaled one) and "longrope" (its short factors)."""
    rot = rope.rotary_dim(head_dim)
    if rope.type == "yarn":
        return _yarn(rope, rot, device)
    if rope.type == "longrope":
        return _longrope(rope, rot, rope.short_factor, device)
    theta = rope.theta
    if rope.type == "dynamic":
        # transformers' table at max_position_embeddings: the base grown by (factor * 1 - (factor - 1)) ** ...,
        # computed in Python floats (so 1.0 up to rounding).
        old = rope.original_max_position_embeddings
        theta = theta * ((rope.factor * old / old) - (rope.factor - 1)) ** (rot / (rot - 2))
    freq = 1.0 / (theta ** _exponents(rot, device))  # [r/2]
    if rope.type == "linear":
        return freq / rope.factor
    if rope.type == "llama3":
        return _llama3(rope, freq)
    if rope.freq_factors:  # a GGUF's rope_freqs: llama.cpp divides each frequency by its factor
        return freq / torch.tensor(rope.freq_factors, dtype=torch.float32, device=freq.device)
    return freq


def long_inv_freq(rope: RopeConfig, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[rot_dim / 2] float32: longrope's table past the original context (its long factors)."""
    if rope.type != "longrope":
        raise ValueError(f"only longrope has a long table, this rope is {rope.type!r}")
    return _longrope(rope, rope.rotary_dim(head_dim), rope.long_factor, device)


def attention_factor(rope: RopeConfig) -> float:
    """The factor cos and sin are multiplied by (yarn, longrope; 1.0 otherwise), derived as transformers does
    when config.json does not give it."""
    if rope.type not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    factor = rope.factor
    if rope.type == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position_embeddings))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:  # transformers tests truthiness: a zero counts as absent
        return float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
    return mscale(factor)


def step_freq(
    rope: RopeConfig, head_dim: int, freq: torch.Tensor, long_freq: torch.Tensor | None, seq_len: torch.Tensor
) -> torch.Tensor:
    """The inverse frequencies a step rotates by: `freq` [r/2] for the static types; [B, 1, r/2] for "dynamic"
    and "longrope", each row's chosen by its length after the step, seq_len [B] (int64, on the device)."""
    old = rope.original_max_position_embeddings
    past = (seq_len > old)[:, None, None]  # [B, 1, 1]: the row has passed the original context
    if rope.type == "longrope":
        if long_freq is None:
            raise ValueError("a longrope step needs its long table (rope.long_inv_freq)")
        return torch.where(past, long_freq, freq)  # [B, 1, r/2]
    if rope.type != "dynamic":
        return freq
    rot = rope.rotary_dim(head_dim)
    # transformers' dynamic update, in float32 tensors as it computes it: the length at least max_position_...,
    # then base = theta * ((factor * len / old) - (factor - 1)) ** (rot / (rot - 2)).
    length = torch.clamp(seq_len, min=old)  # [B] int64
    base = rope.theta * ((rope.factor * length / old) - (rope.factor - 1)) ** (rot / (rot - 2))  # [B] float32
    grown = 1.0 / (base[:, None, None] ** _exponents(rot, seq_len.device))  # [B, 1, r/2]
    return torch.where(past, grown, freq)  # [B, 1, r/2]


def cos_sin(
    freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, r/2] for integer positions [B, T] and frequencies [r/2] (or [B, 1, r/2], one table
    per row), computed in float32, multiplied by `scale` (the attention factor), then cast to `dtype`.

    Half width: both halves of the rotated dims use the same angles (rotate_half pairing), so `apply` uses them
    twice.
    """
    angles = positions[..., None].to(torch.float32) * freq  # [B, T, r/2]
    cos, sin = angles.cos(), angles.sin()  # [B, T, r/2] each
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # [B, 1, T, r/2] each


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first r = 2 * cos.shape[-1] dims of x [B, H, T, d] by the angles, x * cos + rotate_half(x) * sin
    (half-split pairing within those r dims); dims r.. pass through unchanged (partial rotary).

    Written half by half into one output (no concatenation): the same elementwise operations, in the same
    dtype and order, as transformers' x * cos + rotate_half(x) * sin, so results agree bit for bit.
    """
    half = cos.shape[-1]
    rot = 2 * half
    x1, x2 = x[..., :half], x[..., half:rot]  # [B, H, T, r/2] each
    out = torch.empty_like(x)  # [B, H, T, d]
    out[..., :half] = x1 * cos + (-x2) * sin
    out[..., half:rot] = x2 * cos + x1 * sin
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]  # [B, H, T, d - r]: not rotated
    return out


def _llama3(rope: RopeConfig, freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: wavelengths shorter than original/high_freq_factor are kept, longer than original/low_freq_factor
    are divided by `factor`, and the band between is blended linearly in 1/wavelength."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / freq  # [r/2]
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, rot: int, device: torch.device | str | None) -> torch.Tensor:
    """YaRN: dims that turn more than beta_fast times over the original context keep their frequency
    (extrapolation), those under beta_slow turns are divided by `factor` (interpolation), a linear ramp between."""
    base, old = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the context
        return (rot * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** _exponents(rot, device)  # [r/2]
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(rot // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # [r/2]: 1 where the frequency is kept, 0 where divided
    return interpolation * (1 - keep) + extrapolation * keep


def _longrope(
    rope: RopeConfig, rot: int, factors: tuple[float, ...], device: torch.device | str | None
) -> torch.Tensor:
    """LongRoPE: each frequency divided by its own factor."""
    ext = torch.tensor(factors, dtype=torch.float32, device=device)  # [r/2]
    return 1.0 / (ext * rope.theta ** _exponents(rot, device))
