"""Shared test driver: feed random chunks to a StaticKVCache and to a plain numpy history side by side."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from static_decode import StaticKVCache


@dataclass
class History:
    """The reference's view of the cache: per-row numpy K/V written slot by slot, no shared code with cache.py."""

    batch: int
    kv_heads: int
    max_len: int
    head_dim: int
    k: np.ndarray = field(init=False)
    v: np.ndarray = field(init=False)
    lens: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        shape = (self.batch, self.kv_heads, self.max_len, self.head_dim)
        self.k, self.v = np.zeros(shape), np.zeros(shape)
        self.lens = np.zeros(self.batch, dtype=np.int64)

    def append(self, k_new: np.ndarray, v_new: np.ndarray, n_new: np.ndarray) -> None:
        for b in range(self.batch):
            for t in range(int(n_new[b])):
                self.k[b, :, self.lens[b] + t] = k_new[b, :, t]
                self.v[b, :, self.lens[b] + t] = v_new[b, :, t]
        self.lens = self.lens + n_new


def random_split(rng: np.random.Generator, total: int, max_chunk: int) -> list[int]:
    """Split `total` tokens into chunks of 1..max_chunk (possibly with zero-token calls mixed in)."""
    out = []
    while total > 0:
        n = int(rng.integers(0, min(max_chunk, total) + 1))
        out.append(n)
        total -= n
    return out


def schedule(rng: np.random.Generator, finals: np.ndarray, max_chunk: int) -> list[tuple[int, np.ndarray]]:
    """Calls (T, n_new[B]) that bring every row to its final length, rows drawn independently.

    Some calls give some rows zero tokens, and a row of final length 0 only ever receives zero.
    """
    splits = [random_split(rng, int(f), max_chunk) for f in finals]
    calls = max((len(s) for s in splits), default=0)
    out = []
    for i in range(max(calls, 1)):
        n = np.array([s[i] if i < len(s) else 0 for s in splits], dtype=np.int64)
        T = int(rng.integers(max(int(n.max(initial=0)), 1), max_chunk + 1))
        out.append((T, n))
    return out


def to_torch(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def new_pair(batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype):
    return StaticKVCache(batch, kv_heads, max_len, head_dim, dtype=dtype), History(
        batch, kv_heads, max_len, head_dim
    )
