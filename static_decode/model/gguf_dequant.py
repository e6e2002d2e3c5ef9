"""GGUF's quantized blocks dequantized with torch operations, on any device: each value computed in float32 as
`gguf.quants.dequantize` computes it (the product rounded, then the offset added), so the two agree bit for bit.

What the CPU kernels read natively (csrc/gguf_blocks.h has the layouts, with the same arithmetic) is written here a
second time as tensor code: the reference the kernels are tested against on every machine, and what a CUDA step
compiles (inductor fuses a one-row product's dequantization into its reduction, so no float copy of the weight is
written). Layouts: docs/internals.md#gguf-blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockType:
    """A GGUF block type: ggml's type number, weights and bytes a block."""

    name: str
    number: int
    weights: int
    bytes: int


BLOCK_TYPES = {t.name: t for t in (
    BlockType("Q4_0", 2, 32, 18), BlockType("Q4_1", 3, 32, 20), BlockType("Q5_0", 6, 32, 22),
    BlockType("Q5_1", 7, 32, 24), BlockType("Q8_0", 8, 32, 34), BlockType("Q4_K", 12, 256, 144),
    BlockType("Q5_K", 13, 256, 176), BlockType("Q6_K", 14, 256, 210),
)}


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block b [..., bytes] as float32 [..., 1]."""
    return b[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes a block [..., 16] -> its 32 codes [..., 32]: weight j the low nibble of byte j, j + 16 the high."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """Bits 0..count-1 of little-endian bytes packed [..., count / 8] -> [..., count] (0 or 1, uint8)."""
    i = torch.arange(count, device=packed.device)
    return (packed[..., i // 8] >> (i % 8).to(torch.uint8)) & 1


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> (sc, mn) [..., 8] as float32: 6 bits each."""
    s = s.reshape(*s.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def dequantize_blocks(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """blocks uint8 [N, K / weights * bytes] (the file's bytes, row by row) of type `kind` -> float32 [N, K]."""
    t = BLOCK_TYPES[kind]
    N = blocks.shape[0]
    b = blocks.reshape(N, -1, t.bytes)  # [N, blocks, bytes]
    if kind == "Q8_0":
        return (b[..., 2:].contiguous().view(torch.int8).float() * _half(b, 0)).reshape(N, -1)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        codes = _nibbles(b[..., -16:])  # [N, blocks, 32]
        if kind in ("Q5_0", "Q5_1"):
            codes = codes | (_bits(b[..., -20:-16], 32) << 4)
        d = _half(b, 0)
        if kind in ("Q4_0", "Q5_0"):
            return (d * (codes.float() - (8 if kind == "Q4_0" else 16))).reshape(N, -1)
        return (d * codes.float() + _half(b, 2)).reshape(N, -1)
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(b[..., 4:16])  # [N, blocks, 8]
        qs = b[..., -128:].reshape(N, -1, 4, 1, 32)
        codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(N, -1, 8, 32)  # sub 2p low nibbles, 2p + 1 high
        if kind == "Q5_K":
            shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(8, 1)
            codes = codes | (((b[..., 16:48].unsqueeze(-2) >> shifts) & 1) << 4)  # sub j: bit j of qh
        scale = (_half(b, 0) * sc).unsqueeze(-1)  # [N, blocks, 8, 1]
        offset = (_half(b, 2) * mn).unsqueeze(-1)
        return (scale * codes.float() - offset).reshape(N, -1)
    if kind == "Q6_K":
        ql = b[..., :128].reshape(N, -1, 2, 1, 64)
        low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(N, -1, 8, 32)  # half h, nibble, 32-byte run
        shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).view(4, 1)
        high = ((b[..., 128:192].reshape(N, -1, 2, 1, 32) >> shifts) & 3).reshape(N, -1, 8, 32)
        q = (low | (high << 4)).float() - 32  # [N, blocks, 8, 32]
        scale = _half(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()  # [N, blocks, 16]
        return (scale.view(N, -1, 16, 1) * q.reshape(N, -1, 16, 16)).reshape(N, -1)
    raise ValueError(f"GGUF type {kind!r} has no block layout here; these do: {', '.join(BLOCK_TYPES)}")
