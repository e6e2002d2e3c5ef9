"""numpy references of the device samplers (OpenAI's logit_bias and count penalties, llama.cpp's repetition
penalty, vLLM's order of min-p, top-k and top-p), shared by the sampler tests."""

from __future__ import annotations

import numpy as np


def ref_bias(logits: np.ndarray, bias: dict[int, float]) -> np.ndarray:
    out = logits.astype(np.float32).copy()
    for t, b in bias.items():
        out[t] += np.float32(b)
    return out


def ref_counts(logits: np.ndarray, counts: np.ndarray, presence: float, frequency: float) -> np.ndarray:
    """OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    c = counts.astype(np.float32)
    return logits.astype(np.float32) - np.float32(presence) * (c > 0) - np.float32(frequency) * c


def ref_repeat(logits: np.ndarray, seen: set[int], p: float) -> np.ndarray:
    out = logits.copy()
    for t in seen:
        out[t] = out[t] / p if out[t] > 0 else out[t] * p
    return out


def ref_kept(logits: np.ndarray, temperature: float, min_p: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """vLLM's order on one row (float64): probabilities at the temperature, min-p against the top one's, top-k,
    then top-p over the renormalised rest (the smallest prefix reaching it). The kept tokens as a bool mask."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    order = np.argsort(-z, kind="stable")
    if top_k > 0:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    before = np.cumsum(q[order]) - q[order]
    if top_p < 1:
        keep[order[before >= top_p]] = False
    return keep


def ref_probs(logits: np.ndarray, temperature: float, min_p: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    keep = ref_kept(logits, temperature, min_p, top_k, top_p)
    z = logits.astype(np.float64) / temperature
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    return p / p.sum()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
