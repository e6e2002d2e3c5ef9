"""Shared test helper: random GGUF blocks of every type the kernels read, every byte random except the float16 scale
fields (finite, of a realistic size, so that the values and their products are finite): each layout's codes, 6-bit
scales and high bits take every pattern."""

from __future__ import annotations

import numpy as np
import torch

from static_decode.model.gguf_dequant import BLOCK_TYPES

HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of each block's float16 fields


def random_blocks(kind: str, n: int, k: int, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    """uint8 [n, k / weights * bytes]: n rows of k weights as random `kind` blocks."""
    t = BLOCK_TYPES[kind]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // t.weights, t.bytes), dtype=np.uint8)
    for at in HALF_FIELDS[kind]:
        halves = (rng.standard_normal((n, k // t.weights)) * scale).astype(np.float16)
        b[:, :, at:at + 2] = halves.view(np.uint8).reshape(n, -1, 2)
    return torch.from_numpy(b.reshape(n, -1))


def gguf_dequantized(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """gguf's own dequantization (gguf.quants.dequantize) of blocks [n, row bytes] -> float32 [n, k]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    out = dequantize(blocks.numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(blocks.shape[0], -1)
