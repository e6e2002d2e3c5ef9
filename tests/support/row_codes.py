"""The row as int8 weights (and int4 ones with bfloat16 scales) multiply a bfloat16 row on a CPU with the int8 dot
product, stated here apart from the kernel and from `cpu_kernel.row_codes8`: one block of 32 values at a time,
d = max|x| / 127 in float32, each code x / d in float32 rounded half to even, the value code * d; a block with a
NaN or an infinity keeps its values (the products it enters are not finite)."""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32


def row_codes(x: torch.Tensor) -> torch.Tensor:
    """x [K] (any float dtype) -> [K] float64."""
    xs = x.reshape(-1).float().numpy()
    out = xs.astype(np.float64)
    for b in range(0, len(xs), BLOCK):
        v = xs[b:b + BLOCK]
        if not np.isfinite(v).all():
            continue
        d = np.float32(np.abs(v).max()) / np.float32(127)
        out[b:b + BLOCK] = 0.0 if d == 0 else np.round(v / d).astype(np.float64) * np.float64(d)
    return torch.from_numpy(out)
