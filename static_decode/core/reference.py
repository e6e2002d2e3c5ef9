"""Two independent numpy references for grouped-query attention over a KV cache (float64 recommended).

Inputs: q [B, Hq, T, d] (the chunk just appended, padded past n_new[b]), k, v [B, Hkv, S, d] (keys past lens[b] are
garbage), lens [B] (tokens after the append), n_new [B]; output [B, Hq, T, d]. Slot t of row b sits at position
lens[b] - n_new[b] + t and sees keys 0..that position (with `window` W: i - W < j <= i); slots t >= n_new[b] are
zero. `attention_vectorised` follows the library's rules with array ops; `attention_direct` shares none of that code
(it repeats the KV heads and loops over every real query). They agree to 1e-10; the torch kernels are checked
against both.
"""

from __future__ import annotations

import numpy as np


def _check(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray, n_new: np.ndarray, window: int | None
) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be rank 4, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"Hq={q.shape[1]} is not a multiple of Hkv={k.shape[1]}")
    if np.any(n_new < 0) or np.any(n_new > q.shape[2]) or np.any(n_new > lens) or np.any(lens > k.shape[2]):
        raise ValueError(f"bad lengths: lens={lens}, n_new={n_new}, T={q.shape[2]}, S={k.shape[2]}")


def attention_vectorised(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray, n_new: np.ndarray, window: int | None = None
) -> np.ndarray:
    """Grouped view + offset causal mask (and the window's lower bound), all rows and slots at once."""
    lens, n_new = np.asarray(lens), np.asarray(n_new)
    _check(q, k, v, lens, n_new, window)
    B, Hq, T, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G, T, d)  # [B, Hkv, G, T, d]: query head h reads KV head h // G
    scores = np.einsum("bhgtd,bhsd->bhgts", qg, k) / np.sqrt(d)  # [B, Hkv, G, T, S]
    pos = (lens - n_new)[:, None] + np.arange(T)[None, :]  # [B, T] absolute position of each slot
    real = np.arange(T)[None, :] < n_new[:, None]  # [B, T]
    seen = np.arange(S)[None, None, :] <= pos[:, :, None]  # [B, T, S] (pos < lens, so keys stay valid)
    if window is not None:
        seen &= np.arange(S)[None, None, :] > pos[:, :, None] - window  # [B, T, S]
    mask = (seen & real[:, :, None])[:, None, None]  # [B, 1, 1, T, S]
    scores = np.where(mask, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    p = np.where(mask, np.exp(scores - top), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    p = p / np.where(denom > 0, denom, 1.0)  # fully masked slots: p == 0 -> output 0
    out = np.einsum("bhgts,bhsd->bhgtd", p, v)  # [B, Hkv, G, T, d]
    return out.reshape(B, Hq, T, d)


def attention_direct(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, lens: np.ndarray, n_new: np.ndarray, window: int | None = None
) -> np.ndarray:
    """Repeat KV heads, then one plain softmax per (row, head, real query) over its keys first..position."""
    lens, n_new = np.asarray(lens), np.asarray(n_new)
    _check(q, k, v, lens, n_new, window)
    B, Hq, T, d = q.shape
    G = Hq // k.shape[1]
    k_rep = np.repeat(k, G, axis=1)  # [B, Hq, S, d]: head h holds KV head h // G
    v_rep = np.repeat(v, G, axis=1)
    out = np.zeros(q.shape, dtype=np.result_type(q, k, v))
    for b in range(B):
        for t in range(int(n_new[b])):
            position = int(lens[b]) - int(n_new[b]) + t
            first = 0 if window is None else max(0, position - window + 1)
            for h in range(Hq):
                keys = k_rep[b, h, first : position + 1]  # [position + 1 - first, d]
                logits = keys @ q[b, h, t] / np.sqrt(d)
                weights = np.exp(logits - logits.max())
                weights /= weights.sum()
                out[b, h, t] = weights @ v_rep[b, h, first : position + 1]
    return out
