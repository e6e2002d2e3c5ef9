"""The quantized products on CUDA (static_decode.model.quant's formats), written for compiled decode steps.

Dequantizing to a float weight before the GEMM reads more bytes than the float model, so a one-row product must read
the codes as stored: int8 (`int8_matmul`) and int4 "reduce" (`int4_row`) are elementwise products and a row sum that
inductor compiles into one reduction over the stored bytes; int4 "tinygemm" is torch's `_weight_int4pack_mm` over
operands prepared once. Several rows take the GEMM. `use_int4_kernel` picks the int4 product (DEFAULT_INT4_KERNEL).
How each works: docs/internals.md#quant-cuda.

Everything here takes plain tensors (static_decode.model.quant calls it with a QuantWeight's buffers), so it runs and is
tested on CPU tensors too, eagerly and compiled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT4_KERNELS = ("reduce", "tinygemm")  # the one-row int4 products (module docstring)
DEFAULT_INT4_KERNEL = "reduce"  # until a device run measures tinygemm faster (profiles/gpu_check)
TINYGEMM_ROWS = 16  # rows tinygemm serves: its M tile (more rows take the dequantized weight and the GEMM)
CHUNK = 64  # columns per packed chunk (static_decode.model.quant.INT4_CHUNK): byte j holds columns j and j + 32


def check_int4_kernel(kernel: str) -> str:
    """`kernel` if it names an int4 product, else a ValueError naming it."""
    if kernel not in INT4_KERNELS:
        raise ValueError(f"int4 kernel must be one of {', '.join(INT4_KERNELS)}, got {kernel!r}")
    return kernel


# ---- int8 --------------------------------------------------------------------------------------------------------
def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] times the int8 weight's transpose (qweight int8 [N, K], scales [N]: w = q * s) -> [M, N] in x's
    dtype. One row: a float32 reduction over each row of codes, scaled once; several rows: gpt-fast's form."""
    if x.shape[0] == 1:
        acc = (qweight.float() * x.float()).sum(dim=-1)  # [N]: one row of codes read once, float32 accumulation
        return (acc * scales.float()).to(x.dtype)[None]  # [1, N]
    return F.linear(x, qweight.to(x.dtype)) * scales  # [M, N]


# ---- int4: inductor's reduction -----------------------------------------------------------------------------------
def int4_row(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """x [1, K] times the int4 weight's transpose -> [1, N] in x's dtype: packed uint8 [N, K / 2] (chunks of 64
    columns, byte j = column j | column j + 32 << 4), scales [N, K / group, 2] the pairs (s, z) of
    w = (q - 8) * s + z. One reduction over each row's bytes, float32 throughout."""
    N, half = packed.shape
    C = half // (CHUNK // 2)  # chunks of 64 columns per row
    b = packed.view(N, C, CHUNK // 2)  # [N, C, 32]
    xc = x.float().view(C, 2, CHUNK // 2)  # [C, 2, 32]: each chunk's low-nibble columns, then its high ones
    sz = _per_half(scales, group).float()  # [N, C, 2, 2]: (s, z) of each chunk's low and high half
    s_lo, z_lo = sz[:, :, 0, 0, None], sz[:, :, 0, 1, None]  # [N, C, 1] each
    s_hi, z_hi = sz[:, :, 1, 0, None], sz[:, :, 1, 1, None]
    w_lo = ((b & 15).float() - 8) * s_lo + z_lo  # [N, C, 32]: columns j of each chunk
    w_hi = ((b >> 4).float() - 8) * s_hi + z_hi  # [N, C, 32]: columns j + 32
    acc = (w_lo * xc[:, 0] + w_hi * xc[:, 1]).sum(dim=(1, 2))  # [N]: one pass over the K / 2 bytes of a row
    return acc.to(x.dtype)[None]  # [1, N]


def _per_half(scales: torch.Tensor, group: int) -> torch.Tensor:
    """scales [N, K / group, 2] -> [N, C, 2, 2]: the pair of each 32-column half of each 64-column chunk (a group
    of 32 is one half, 64 one chunk, 128 two chunks)."""
    N, G, _ = scales.shape
    halves = G * group // (CHUNK // 2)  # 2 * C
    per = group // (CHUNK // 2)  # halves per group: 1, 2 or 4
    out = scales[:, :, None, :].expand(N, G, per, 2).reshape(N, halves, 2)  # [N, 2C, 2]
    return out.view(N, halves // 2, 2, 2)


def int4_dequantized(packed: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The int4 weight [N, K] in `dtype`, from the same expressions as `int4_row` (for references)."""
    N, half = packed.shape
    C = half // (CHUNK // 2)
    b = packed.view(N, C, 1, CHUNK // 2)  # [N, C, 1, 32]
    codes = torch.cat([b & 15, b >> 4], dim=2).to(dtype)  # [N, C, 2, 32]
    sz = _per_half(scales, group).to(dtype)  # [N, C, 2, 2]
    return ((codes - 8) * sz[..., 0, None] + sz[..., 1, None]).reshape(N, 2 * half)  # [N, K]


# ---- int4: tinygemm ----------------------------------------------------------------------------------------------
def tinygemm_refusal(device: torch.device, dtype: torch.dtype, N: int, K: int) -> str | None:
    """Why tinygemm cannot take an [N, K] int4 weight of a `dtype` model on `device` (None when it can)."""
    if device.type == "cuda" and dtype != torch.bfloat16:
        return f"the int4 kernel 'tinygemm' takes a bfloat16 model on CUDA, not {dtype}; use 'reduce'"
    if device.type not in ("cuda", "cpu"):
        return f"the int4 kernel 'tinygemm' runs on CUDA (or torch's CPU counterpart), not on {device}"
    if N % 8:
        return f"the int4 kernel 'tinygemm' takes weights of a multiple of 8 rows, got {N}; use 'reduce'"
    if K % CHUNK:
        return f"the int4 kernel 'tinygemm' takes weights of a multiple of {CHUNK} inputs, got {K}"
    return None


def inner_k_tiles(K: int) -> int:
    """tinygemm's k-tiles per packed word group: 8 (16-byte loads) where K allows, else 4 (K a multiple of 64)."""
    return 8 if K % 128 == 0 else 4


def tinygemm_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> the uint8 [N, K / 2] `aten._convert_weight_to_int4pack` takes on CUDA: byte i holds
    column 2i in its high nibble and column 2i + 1 in its low one (torch's int4mm.cu)."""
    q = codes.to(torch.uint8)
    return (q[:, 0::2] << 4) | q[:, 1::2]  # [N, K / 2]


def tinygemm_scales(scales: torch.Tensor) -> torch.Tensor:
    """The pairs (s, z) [N, K / group, 2] -> tinygemm's scales_and_zeros [K / group, N, 2] (contiguous)."""
    return scales.transpose(0, 1).contiguous()


def tinygemm_operands(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the packed weight, scales_and_zeros) `tinygemm_matmul` reads, on the codes' device: CUDA's tinygemm layout
    (int32 [N / 8, K / (16 * tiles), 32, tiles / 2]) or torch's CPU one (uint8 [N, K / 2])."""
    K = codes.shape[1]
    if codes.device.type == "cuda":
        packed = torch.ops.aten._convert_weight_to_int4pack(tinygemm_bytes(codes).contiguous(), inner_k_tiles(K))
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), inner_k_tiles(K))
    return packed, tinygemm_scales(scales)


def tinygemm_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                    group: int) -> torch.Tensor:
    """x [M, K] times the int4 weight `tinygemm_operands` prepared -> [M, N] in x's dtype."""
    x = x.contiguous()
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_and_zeros)  # [M, N]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)  # [M, N]
