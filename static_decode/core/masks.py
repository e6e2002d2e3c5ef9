"""The offset causal mask of a chunk, built from the device lengths (rule 3), in every form the attention
formulations take: slot t of row b sits at position lens[b] - n_new[b] + t and sees keys 0..that position, or only
pos - W < j <= pos through a sliding window W; slots t >= n_new[b] see nothing (their output is exactly zero).
`step_mask` builds a step's forms once for every layer of that window (`StepMask`); `FRESH` marks a fresh chunk,
which takes SDPA's causal kernel and no mask at all.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from static_decode.core import split_attention


def check_window(window: int | None) -> int | None:
    """A layer's sliding window: None (full causal attention) or an int >= 1, refused otherwise naming it."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1 (keys a query sees), got {window!r}")
    return window


def chunk_mask(
    lens: torch.Tensor, n_new: torch.Tensor, slots: int, keys: int, window: int | None = None
) -> torch.Tensor:
    """[B, T, S] bool: may slot t of row b see key s. lens counts the chunk; n_new its real tokens; `window`:
    a sliding window of that many keys (None: every key up to the slot's position)."""
    return _visible_and_real(lens, n_new, slots, keys, check_window(window))[0]


def _visible_and_real(
    lens: torch.Tensor, n_new: torch.Tensor, slots: int, keys: int, window: int | None = None, first_key: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(slots, device=lens.device)  # [T]
    pos = (lens - n_new)[:, None] + t  # [B, T] absolute position of each slot
    real = t < n_new[:, None]  # [B, T]
    return _visible(pos, real, torch.arange(keys, device=lens.device) + first_key, window), real


def _visible(pos: torch.Tensor, real: torch.Tensor, s: torch.Tensor, window: int | None) -> torch.Tensor:
    """[B, T, S] may the slot at pos [B, T] (real [B, T]) see key s ([S], or [B, S] per row)."""
    s = s[None, None, :] if s.dim() == 1 else s[:, None, :]  # [1 or B, 1, S]
    seen = (s <= pos[:, :, None]) & real[:, :, None]  # [B, T, S]
    if window is not None:  # a Python-level branch: a layer's window is fixed, so each graph sees one path
        seen = seen & (s > pos[:, :, None] - window)  # [B, T, S]: the sliding window's lower bound
    return seen


class StepMask(NamedTuple):
    """A step's mask in every form its layers' attention takes, built once per step (`step_mask`): every layer of
    a step sees the same lengths, so building (and, for SDPA, converting) it per layer repeats the same work 30x.
    Measured on SmolLM2-135M prefill (1,024 tokens, eager): the per-layer build and bool -> float conversion
    was a quarter of the attention time (profiles/RESULTS.md, "Prefill")."""

    visible: torch.Tensor | None  # [B, T, S] bool: may slot t of row b see key s (None when causal)
    real: torch.Tensor | None  # [B, T] bool: slot t of row b holds a real token (else its output is exactly 0)
    bias: torch.Tensor | None  # [B, 1, G*T, S] additive 0 / -inf in the attention dtype (the SDPA-kernel impls)
    # A fresh chunk: every row starts at position 0 and fills all T slots, and S == T. Then SDPA's top-left
    # `is_causal` is exactly rule 3 and its kernels skip the key blocks past the diagonal: half the work of a
    # masked call. Only the host knows a chunk is fresh (its mirror of the lengths), so only an uncompiled long
    # prefill chunk uses it (static_decode.steps.functions.prefill_long); no mask tensor is built. A windowed layer
    # takes it only while the chunk fits in its window (every key of the chunk is then within reach).
    causal: bool = False
    window: int | None = None  # the sliding window these forms include (None: full causal attention)
    # split_key over a windowed read longer than the window's blocks: [B] the first key block each row reads; then
    # visible and bias cover only the blocks first_block[b] .. first_block[b] + nw - 1 (split_attention.window_blocks).
    first_block: torch.Tensor | None = None


FRESH = StepMask(None, None, None, causal=True)


def step_mask(
    lens: torch.Tensor,
    n_new: torch.Tensor,
    slots: int,
    keys: int,
    *,
    groups: int,
    dtype: torch.dtype,
    impl: str,
    window: int | None = None,
) -> StepMask:
    """The mask of a step whose rows hold `lens` tokens after appending `n_new` (device tensors), `slots` query
    slots, `keys` keys read, `groups` query heads per KV head, through a sliding `window` (None: off); `impl`
    decides which forms are built. split_key under a window shorter than the read builds them over the window's
    key blocks only (StepMask.first_block), so neither the mask nor the attention grows with the read."""
    window = check_window(window)
    first = None
    if impl == "split_key" and window is not None:
        Sb, nw = split_attention.window_blocks(keys, slots, window)
        if nw < keys // Sb:
            first = split_attention.first_blocks(lens - n_new, keys, slots, window)  # [B]
            t = torch.arange(slots, device=lens.device)  # [T]
            pos = (lens - n_new)[:, None] + t  # [B, T]
            real = t < n_new[:, None]  # [B, T]
            s = first[:, None] * Sb + torch.arange(nw * Sb, device=lens.device)  # [B, nw*Sb] the keys read
            visible = _visible(pos, real, s, window)  # [B, T, nw*Sb]
            keys = nw * Sb
    if first is None:
        visible, real = _visible_and_real(lens, n_new, slots, keys, window)  # [B, T, S], [B, T]
    bias = None
    if impl in ("sdpa_folded", "split_key"):
        B = visible.shape[0]
        folded = visible[:, None, None].expand(B, 1, groups, slots, keys).reshape(B, 1, groups * slots, keys)
        zero, ninf = (torch.full((), x, dtype=dtype, device=lens.device) for x in (0.0, -math.inf))
        bias = torch.where(folded, zero, ninf)  # [B, 1, G*T, S]
    return StepMask(visible, real, bias, window=window, first_block=first)
