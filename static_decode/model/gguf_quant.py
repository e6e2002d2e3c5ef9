"""Projections and embeddings held as GGUF's quantized blocks, the file's own bytes (Q4_K, Q5_K, Q6_K, Q8_0 and the
legacy Q4_0/Q4_1/Q5_0/Q5_1): what a Q4_K_M file holds stays at its size, and each product reads those bytes.

One row on the CPU goes through our kernel (`gemv_gguf`: the row quantized to int8 codes once, as llama.cpp
quantizes activations, and every block multiplied in integers), several rows through the weight dequantized a block
of rows at a time (`linear_gguf`); every dequantized value equals gguf's `dequantize` of its block (exactly in
float32; rounded once in bfloat16). Without the kernels, and on CUDA, the same values come from tensor code
(static_decode.model.gguf_dequant), which a compiled one-row step fuses into its reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from static_decode.kernels import cpu_kernel
from static_decode.model.gguf_dequant import BLOCK_TYPES, BlockType, dequantize_blocks

DTYPES = (torch.float32, torch.bfloat16)  # model dtypes the products take


class BlockWeight(nn.Module):
    """A [N, K] weight as GGUF blocks: `blocks` uint8 [N, K / weights * bytes], row n the blocks of weight row n.
    `dtype` is the activations' (the model's); `scheme` the block type (its `name` is what the model reports)."""

    blocks: torch.Tensor

    def __init__(self, blocks: torch.Tensor, kind: str, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        if kind not in BLOCK_TYPES:
            raise ValueError(f"GGUF type {kind!r} is not held as blocks; these are: {', '.join(BLOCK_TYPES)}")
        t = BLOCK_TYPES[kind]
        if dtype not in DTYPES:
            raise ValueError(f"GGUF blocks multiply a float32 or bfloat16 model, got {dtype}")
        if in_features % t.weights or blocks.dim() != 2 or blocks.shape[1] != in_features // t.weights * t.bytes:
            raise ValueError(f"{kind} blocks {tuple(blocks.shape)} do not hold rows of {in_features} weights "
                             f"({t.weights} weights in {t.bytes} bytes a block)")
        if blocks.dtype != torch.uint8:
            raise ValueError(f"{kind} blocks must be uint8 bytes, got {blocks.dtype}")
        self.scheme: BlockType = t
        self.out_features, self.in_features, self._dtype = blocks.shape[0], in_features, dtype
        self.register_buffer("blocks", blocks.contiguous())

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def _kernel(self) -> bool:
        return self.device.type == "cpu" and cpu_kernel.available()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (the model's dtype) times the weight's transpose -> [..., N] in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        number = self.scheme.number
        if self._kernel() and x2.shape[0] == 1:
            out = torch.ops.static_decode_cpu.gemv_gguf(x2, self.blocks, number)  # [1, N]
        elif self._kernel() and x.dtype in DTYPES:
            out = torch.ops.static_decode_cpu.linear_gguf(x2, self.blocks, number)  # [M, N]
        elif x2.shape[0] == 1:  # CUDA (or no kernels): one reduction over the blocks, fused when compiled
            out = row_product(x2, self.blocks, self.scheme.name)  # [1, N]
        else:
            out = F.linear(x2, self.dequantize(x.dtype))  # [M, N]
        return out.reshape(*lead, self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in `dtype`: gguf's float32 values (float64: the same values), rounded once to a
        narrower dtype."""
        if dtype in DTYPES and self._kernel():
            return torch.ops.static_decode_cpu.dequant_gguf(self.blocks, self.scheme.number, dtype)
        return dequantize_blocks(self.blocks, self.scheme.name).to(dtype)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `index` [...] of the weight -> [..., K] in `dtype` (an embedding's lookup: only those rows'
        blocks are read)."""
        picked = self.blocks[index.reshape(-1)]  # [T, row bytes]
        return dequantize_blocks(picked, self.scheme.name).to(dtype).reshape(*index.shape, self.in_features)

    def extra_repr(self) -> str:
        return f"{self.scheme.name}, out={self.out_features}, in={self.in_features}"


def row_product(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """One row x [1, K] times the weight of `blocks` (type `kind`) -> [1, N] in x's dtype, as tensor code: the
    dequantized float32 values times the row, summed in float32 (a compiled step fuses it into one reduction)."""
    return (dequantize_blocks(blocks, kind) * x.float()).sum(-1, keepdim=True).t().to(x.dtype)  # [1, N]


class BlockLinear(nn.Module):
    """An nn.Linear whose `weight` is a BlockWeight (`bias` in the model's dtype), as quant.QuantLinear."""

    def __init__(self, weight: BlockWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.in_features, weight.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight.matmul(x)
        return out if self.bias is None else out + self.bias


class BlockEmbedding(nn.Module):
    """An nn.Embedding whose table is a BlockWeight: a lookup dequantizes the rows it reads; a tied head multiplies
    the blocks (`weight`), so the table is held once, at the file's bytes."""

    def __init__(self, weight: BlockWeight) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(tokens, self.weight.dtype)  # [..., D]


def block_types(model: nn.Module) -> set[str]:
    """The block types a model's weights are held in (empty for none)."""
    return {m.scheme.name for m in model.modules() if isinstance(m, BlockWeight)}


@dataclass(frozen=True)
class Blocks:
    """What `model.quantization` says of a model holding GGUF blocks: their types (no scheme of ours: `bits` 0)."""

    types: tuple[str, ...]
    bits: int = 0
    group: int = 0

    @property
    def name(self) -> str:
        return "gguf " + "/".join(self.types)

    @property
    def spec(self) -> str:
        """--quantize's name of a one-type model ("q4_k"), what a saved checkpoint's entry holds."""
        return "/".join(t.lower() for t in self.types)
