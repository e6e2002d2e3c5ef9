"""The projections of a step (q/k/v/o, gate/up/down, the head), with the one-token decode formulation chosen per
device and dtype here, in one place.

A batch-1 decode step's products are GEMVs bound by reading the weights. One bf16 row on a CPU with AVX512-BF16 or AVX2
takes our kernel (cpu_kernel.gemv_bf16; `qkv` and `glu` join a layer's products of one row into one call each);
elsewhere a compiled one-row step in a 16-bit dtype on the CPU takes a multiply-and-row-sum that inductor streams;
float32, CUDA and several rows keep `F.linear`. Each choice is where it measured faster:
docs/internals.md#projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from static_decode.kernels import cpu_kernel
from static_decode.model.gguf_quant import BlockWeight
from static_decode.model.quant import QuantWeight

STREAMED_DTYPES = (torch.bfloat16, torch.float16)  # CPU dtypes whose one-row product streams faster than F.linear


def streams(weight: torch.Tensor, rows: int) -> bool:
    """Whether a product of `rows` rows by `weight` takes the multiply-and-row-sum form (see the module doc)."""
    return (
        rows == 1
        and weight.device.type == "cpu"
        and weight.dtype in STREAMED_DTYPES
        and torch.compiler.is_compiling()
    )


MATERIALIZE_ROWS = 8192  # products with at least this many weight rows read their row from a buffer (the head)


def materialized(v: torch.Tensor) -> torch.Tensor:
    """`v` [K] as a buffer of its own inside a compiled step (eager: a copy).

    Inductor inlines a pointwise producer into the reduction that reads it: the head's row (the final norm) was
    recomputed once per weight row, 49,152 times for SmolLM2, and its product ran at 12 GB/s instead of 15 (head
    with its norm, bf16, cold weights, 2 threads: 4.8 -> 3.7 ms). An index_copy lowers to a scatter, which inductor
    always writes to a buffer, so the row is computed once. Measured on the whole bf16 decode step (separate
    processes in turns): -8% at context 128, -5% at 1,024 with the head only; with every projection as well, no gain
    (the layers' inputs feed several projections and are buffers already; the extra copies cost what they save)."""
    K = v.shape[-1]
    return torch.zeros_like(v).index_copy(0, torch.arange(K, device=v.device), v)  # [K]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, x [..., K], weight [N, K]; for a single row, our bfloat16 GEMV kernel or the
    streamed form where those are faster."""
    # int8 / int4 weight-only (static_decode.model.quant), GGUF blocks (static_decode.model.gguf_quant): any rows
    if isinstance(weight, (QuantWeight, BlockWeight)):
        out = weight.matmul(x)  # [..., N]
        return out if bias is None else out + bias
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if rows == 1 and cpu_kernel.gemv_ready(weight):  # eager and compiled alike: one op, no product materialised
        out = cpu_kernel.gemv_bf16(x, weight).reshape(*x.shape[:-1], weight.shape[0])  # [..., N]
        return out if bias is None else out + bias
    if not streams(weight, rows):
        return F.linear(x, weight, bias)
    row = x.reshape(K).float()  # [K]
    if weight.shape[0] >= MATERIALIZE_ROWS:
        row = materialized(row)  # computed once, not once per weight row
    out = (weight.float() * row).sum(dim=-1)  # [N] float32 accumulation, each weight row read once
    out = out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])  # [..., N]
    return out if bias is None else out + bias


def _fusable(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether a one-row product by several weights takes one fused kernel call: one row, no bias, and our bf16
    GEMV takes every weight."""
    K = x.shape[-1]
    return (
        K > 0 and x.numel() == K and all(b is None for b in biases)
        and all(isinstance(w, torch.Tensor) and cpu_kernel.gemv_ready(w) for w in weights)
    )


def qkv(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    bq: torch.Tensor | None = None,
    bk: torch.Tensor | None = None,
    bv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three projections of one input (`linear` each); for one bfloat16 row on a CPU with AVX512-BF16 or AVX2, one
    kernel call for all three (cpu_kernel.gemv_bf16_cat3: a dispatch and a fork of the threads instead of three;
    each value is exactly what `linear` gives it)."""
    if not _fusable(x, (wq, wk, wv), (bq, bk, bv)):
        return linear(x, wq, bq), linear(x, wk, bk), linear(x, wv, bv)
    out = cpu_kernel.gemv_bf16_cat3(x, wq, wk, wv)  # [Nq + Nk + Nv]
    q, k, v = out.split([wq.shape[0], wk.shape[0], wv.shape[0]])
    lead = x.shape[:-1]
    return q.view(*lead, -1), k.view(*lead, -1), v.view(*lead, -1)


def glu(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU's inner activation, silu(linear(x, gate)) * linear(x, up); for one bfloat16 row on a CPU with
    AVX512-BF16 or AVX2, one kernel call (cpu_kernel.gemv_bf16_glu: both products and the silu, each product rounded to
    x's dtype first, as the separate calls round it)."""
    if not _fusable(x, (gate, up), (b_gate, b_up)):
        quantized = isinstance(gate, (QuantWeight, BlockWeight))
        return _silu_mul(linear(x, gate, b_gate), linear(x, up, b_up), quantized=quantized)
    return cpu_kernel.gemv_bf16_glu(x, gate, up).view(*x.shape[:-1], gate.shape[0])  # [..., N]


def joined(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    """The products of x [..., K] by the weights stacked in `weight` [sum(rows), K] (q/k/v joined at load,
    static_decode.model.joining): one `linear` (one kernel, one dispatch), split into views [...,
    rows[i]]. Each value is the one its part's own product gives: an output element is one weight row's dot product."""
    return linear(x, weight, bias).split(rows, dim=-1)  # views of one [..., sum(rows)] product


def glu_joined(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for gate and up stacked in `weight` [2 * inner, K] (joined at load): one
    product; for one bfloat16 row on a CPU with AVX512-BF16 or AVX2, `glu`'s kernel over the two row blocks (views)."""
    inner = weight.shape[0] // 2
    if _fusable(x, (weight,), (bias,)):
        gate, up = weight.split(inner)  # [inner, K] each: contiguous row blocks
        return glu(x, gate, up)
    gate, up = linear(x, weight, bias).split(inner, dim=-1)  # [..., inner] views of one product
    return _silu_mul(gate, up, quantized=isinstance(weight, (QuantWeight, BlockWeight)))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor, quantized: bool) -> torch.Tensor:
    """silu(gate) * up. Quantized models compute it in float32 and round once, as the fused decode layers and
    gemv_bf16_glu do (and inductor's fused pointwise kernel): a quantized model's eager one-token steps give the
    fused layers' values bit for bit in bfloat16. Float models keep torch's two roundings (their reference)."""
    if quantized and gate.dtype != torch.float32:
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return F.silu(gate) * up
