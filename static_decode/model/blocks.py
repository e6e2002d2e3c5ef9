"""The decoder blocks of a Llama-family model over the static KV cache, and the loop that runs them.

RMSNorm, rotary GQA attention through the core (`cache.write`, `cache.layer_view`, `grouped_attention`), the
SwiGLU MLP, and `step_attention` / `run_blocks`: one step's formulation and masks, resolved once and shared by every
layer (one mask per distinct sliding window among the layers: a layer's window is its own, `Attention.window`).
Module names mirror transformers' decoder layers, so a checkpoint maps by name. Gemma's pieces are switches
of the same modules (LlamaConfig: (1 + weight) norms, the four norms a layer, gelu-tanh, the score scale, softcapped
scores through the formulations that take it, a second rotary table for the sliding layers). Under tensor
parallelism (`tp`) a block holds only its rank's slice of the attention and MLP weights and adds the partial sums
of o_proj and down_proj with one all-reduce each.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from static_decode.core import kv_quant
from static_decode.core.attention import AUTO, SOFTCAP_IMPLS, grouped_attention, resolve_impl
from static_decode.core.cache import LayerSpan, StaticKVCache
from static_decode.core.masks import FRESH, StepMask, check_window, step_mask
from static_decode.model import projection, rope
from static_decode.model.config import LlamaConfig
from static_decode.model.joining import checkpoint_layout
from static_decode.model.parallel import TensorParallel


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as transformers does); `plus_one`
    (Gemma): x / rms(x) * (1 + weight), all in float32, cast back last (transformers' Gemma2RMSNorm)."""

    def __init__(
        self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str | None, plus_one: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def row_parallel(linear: nn.Linear, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A row-parallel projection: this rank's partial product, summed over the ranks, then the bias (once)."""
    if not tp.enabled:
        return projection.linear(x, linear.weight, linear.bias)
    out = tp.all_reduce(projection.linear(x, linear.weight))
    return out if linear.bias is None else out + linear.bias


class Attention(nn.Module):
    """Rotary GQA self-attention whose K/V live in the static cache (this rank's heads under `tp`); `fused`: q, k
    and v are one `qkv_proj` (see static_decode.model.joining; always for a checkpoint stored joined, Phi3's, whose
    name it keeps); `window`: this layer's sliding window (None: every earlier key; LlamaConfig.layer_window);
    `rope_slot`: which of the step's rotary tables it takes (None: the one; LlamaConfig.layer_rope)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None,
        tp: TensorParallel,
        fused: bool = True,
        window: int | None = None,
        rope_slot: int | None = None,
    ) -> None:
        super().__init__()
        self.window = check_window(window)
        self.rope_slot, self.softcap = rope_slot, cfg.attn_softcap
        # transformers scales the scores by query_scale; the formulations by head_dim ** -0.5: q takes the ratio.
        self.q_scale = 1.0 if cfg.query_scale is None else cfg.query_scale * math.sqrt(cfg.head_dim)
        fused = fused or cfg.joined_checkpoint
        # Local heads: whole GQA groups per rank (tp.check refused a world size that would split one).
        d, hq, hkv = cfg.head_dim, cfg.num_heads // tp.world, cfg.num_kv_heads // tp.world
        kw = {"dtype": dtype, "device": device}
        self.sizes = (hq * d, hkv * d, hkv * d)  # rows of q, k and v in the joined weight
        self.fused = fused
        if fused:  # column-parallel: this rank's q, k and v rows, one after the other (see static_decode.model.joining)
            self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.qkv_bias, **kw)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=cfg.qkv_bias, **kw)  # column-parallel
            self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias, **kw)  # column-parallel
            self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias, **kw)  # column-parallel
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias, **kw)  # row-parallel
        # Qwen3: one [d] weight shared by every head, so under tp each rank keeps the whole (replicated) weight
        # for the heads it owns; None otherwise (a Python-level branch: each compiled step sees one path).
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, **kw, plus_one=cfg.norm_plus_one) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, **kw, plus_one=cfg.norm_plus_one) if cfg.qk_norm else None
        self.heads, self.kv_heads, self.head_dim, self.tp = hq, hkv, d, tp
        if fused and not cfg.joined_checkpoint:
            checkpoint_layout(self, {"qkv_proj": (("q_proj", "k_proj", "v_proj"), self.sizes)})

    def qkv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k and v weights [rows, D]: row blocks (views) of the joined weight when fused."""
        if self.fused:
            return tuple(self.qkv_proj.weight.split(self.sizes))  # type: ignore[return-value]
        return self.q_proj.weight, self.k_proj.weight, self.v_proj.weight

    def qkv_biases(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The q, k and v biases (None without them), as `qkv_weights`."""
        if self.fused:
            bias = self.qkv_proj.bias
            return (None, None, None) if bias is None else tuple(bias.split(self.sizes))  # type: ignore[return-value]
        return self.q_proj.bias, self.k_proj.bias, self.v_proj.bias

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: StaticKVCache | LayerSpan,
        layer: int,
        n_new: torch.Tensor,
        lens_after: torch.Tensor,
        read_len: int,
        impl: str,
        mask: StepMask | None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        if self.fused:  # one product by the joined weight, split into views
            q, k, v = projection.joined(x, self.qkv_proj.weight, self.qkv_proj.bias, self.sizes)
        else:
            q, k, v = projection.qkv(
                x, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight,
                self.q_proj.bias, self.k_proj.bias, self.v_proj.bias,
            )  # [B, T, Hq * d], [B, T, Hkv * d] twice: one kernel call for a decode row where that applies
        q = q.view(B, T, self.heads, self.head_dim)  # [B, T, Hq, d]
        k = k.view(B, T, self.kv_heads, self.head_dim)  # [B, T, Hkv, d]
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3 normalises each head over d before rotating it (rope after the norm, as it was trained).
            q, k = self.q_norm(q), self.k_norm(k)  # [B, T, Hq, d], [B, T, Hkv, d]
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, Hq, T, d], [B, Hkv, T, d]
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, d]
        if self.rope_slot is not None:  # Gemma 3: [2, B, 1, T, r/2], the full layers' table then the sliding ones'
            cos, sin = cos[self.rope_slot], sin[self.rope_slot]  # [B, 1, T, r/2]
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale  # [B, Hq, T, d]
        # At the old lengths, padded slots to the spare row; K/V rounded once, here, to the cache's dtype (the model's,
        # or Llama.kv_dtype's), or quantized to an int8 cache's codes and scales (core/kv_quant.py).
        cache.write(layer, k, v, n_new)
        k_all, v_all = cache.layer_view(layer, read_len)  # [B, Hkv, read_len, d] views
        scales = cache.layer_scales(layer, read_len)  # an int8 cache's [B, Hkv, read_len] views; None otherwise
        out = grouped_attention(
            q, k_all, v_all, lens_after, n_new, impl=impl, mask=mask, window=self.window, softcap=self.softcap,
            scales=scales,
        )  # [B, Hq, T, d]
        out = out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)  # [B, T, Hq_local * d]
        return row_parallel(self.o_proj, out, self.tp)  # [B, T, D], summed over the ranks


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (this rank's slice of the inner width under `tp`), gelu-tanh in silu's
    place for Gemma (`hidden_act`); `fused`: gate and up are one `gate_up_proj` (see static_decode.model.joining;
    always for a checkpoint stored joined, Phi3's, whose name it keeps)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None,
        tp: TensorParallel,
        fused: bool = True,
    ) -> None:
        super().__init__()
        kw = {"bias": cfg.mlp_bias, "dtype": dtype, "device": device}
        inner = cfg.intermediate_size // tp.world
        fused = fused or cfg.joined_checkpoint
        self.fused, self.inner, self.gelu = fused, inner, cfg.hidden_act == "gelu_pytorch_tanh"
        if fused:  # column-parallel: this rank's gate rows, then its up rows (see static_decode.model.joining)
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inner, **kw)
        else:
            self.gate_proj = nn.Linear(cfg.hidden_size, inner, **kw)  # column-parallel
            self.up_proj = nn.Linear(cfg.hidden_size, inner, **kw)  # column-parallel
        self.down_proj = nn.Linear(inner, cfg.hidden_size, **kw)  # row-parallel
        self.tp = tp
        if fused and not cfg.joined_checkpoint:
            checkpoint_layout(self, {"gate_up_proj": (("gate_proj", "up_proj"), (inner, inner))})

    def glu_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up weights [inner, D]: row blocks (views) of the joined weight when fused."""
        if self.fused:
            return tuple(self.gate_up_proj.weight.split(self.inner))  # type: ignore[return-value]
        return self.gate_proj.weight, self.up_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:  # Gemma's GeGLU: gelu_tanh(gate(x)) * up(x)
            if self.fused:
                g, u = projection.joined(x, self.gate_up_proj.weight, self.gate_up_proj.bias, (self.inner,) * 2)
            else:
                g, u = projection.linear(x, self.gate_proj.weight, self.gate_proj.bias), projection.linear(
                    x, self.up_proj.weight, self.up_proj.bias)
            h = F.gelu(g, approximate="tanh") * u  # [B, T, inner]
        elif self.fused:
            h = projection.glu_joined(x, self.gate_up_proj.weight, self.gate_up_proj.bias)  # [B, T, inner]
        else:
            g, u = self.gate_proj, self.up_proj
            h = projection.glu(x, g.weight, u.weight, g.bias, u.bias)  # [B, T, inner]: silu(gate(x)) * up(x)
        return row_parallel(self.down_proj, h, self.tp)


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)); `window`: its attention's sliding window.
    With `sandwich_norms` (Gemma 2/3): x + post_attention_norm(attn(input_norm(x))), then
    + post_feedforward_norm(mlp(pre_feedforward_norm(x)))."""

    def __init__(
        self,
        cfg: LlamaConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None,
        tp: TensorParallel,
        fused: bool = True,
        window: int | None = None,
        rope_slot: int | None = None,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device, "plus_one": cfg.norm_plus_one}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(
            cfg, dtype=dtype, device=device, tp=tp, fused=fused, window=window, rope_slot=rope_slot
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, dtype=dtype, device=device, tp=tp, fused=fused)


# A step's masks by sliding window (None: the full causal layers), one for each window its layers have.
StepMasks = Mapping[int | None, StepMask | None]


def layer_windows(blocks: Iterable[Block]) -> tuple[int | None, ...]:
    """The distinct sliding windows of `blocks`, in order of first appearance (None: full causal attention)."""
    return tuple(dict.fromkeys(block.self_attn.window for block in blocks))


def softcapped(blocks: Iterable[Block]) -> bool:
    """Whether any of `blocks` softcaps its attention scores (Gemma 2): the step then needs a formulation that
    takes it (step_attention)."""
    return any(block.self_attn.softcap is not None for block in blocks)


def step_attention(
    impl: str,
    groups: int,
    kv_heads: int,
    lens_after: torch.Tensor,
    n_new: torch.Tensor,
    T: int,
    read_len: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    *,
    fresh: bool = False,
    skip: Sequence[str] = (),
    windows: Iterable[int | None] = (None,),
    softcap: bool = False,
) -> tuple[str, StepMasks]:
    """The formulation one step's attention runs (`attention.resolve_impl`: "auto" by device, batch, KV heads and
    query rows) and its masks, one per sliding window in `windows` (the layers' `layer_windows`), each built once
    and shared by the layers of that window: FRESH for a fresh chunk (causal SDPA, no mask) that fits in the
    window, None where there is nothing to mask (flex and decode_kernel evaluate their own inside the kernel; no
    keys or no slots), else `masks.step_mask` in the cache's dtype `kv_dtype`. `skip`: formulations resolved
    past. `softcap` (some layer softcaps its scores: `softcapped`): "auto" is "matmul", a formulation that cannot
    softcap (attention.SOFTCAP_IMPLS) is refused naming it, and a fresh chunk gets its mask (no causal SDPA)."""
    if softcap:
        if impl == AUTO:
            impl = "matmul"
        elif impl not in SOFTCAP_IMPLS:
            raise ValueError(
                f"attention formulation {impl!r} cannot softcap the scores (this model's attn_logit_softcapping); "
                f"use one of {', '.join(SOFTCAP_IMPLS)} or 'auto'"
            )
        fresh = False
    impl = resolve_impl(
        impl, lens_after.shape[0], kv_heads, groups * T, lens_after.device, head_dim,
        kv_quant.attention_dtype(kv_dtype), groups=groups, skip=skip,
    )
    masks: dict[int | None, StepMask | None] = {}
    for window in dict.fromkeys(windows):
        if fresh and (window is None or window >= T):
            masks[window] = FRESH
        elif impl in ("flex", "decode_kernel") or read_len <= 0 or T <= 0:
            masks[window] = None
        else:
            # The SDPA formulations run in the cache's dtype (grouped_attention casts the queries to it; an int8
            # cache's: float32, kv_quant.attention_dtype), so their additive mask is built in it.
            masks[window] = step_mask(
                lens_after, n_new, T, read_len, groups=groups, dtype=kv_quant.attention_dtype(kv_dtype), impl=impl,
                window=window,
            )
    return impl, masks


def run_blocks(
    blocks: Sequence[Block],
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: StaticKVCache | LayerSpan,
    n_new: torch.Tensor,
    lens_after: torch.Tensor,
    read_len: int,
    impl: str,
    masks: StepMasks,
) -> torch.Tensor:
    """x [B, T, D] through `blocks` in order; block j writes and reads layer j of `kv` (the whole cache for the
    whole model, a `LayerSpan` for a region of it) through the mask of its window (`step_attention` built `masks`
    for the blocks' `layer_windows`). The unit capture.regions compiles apart."""
    for j, block in enumerate(blocks):
        h = block.input_layernorm(x)
        if block.self_attn.window not in masks:
            raise ValueError(f"no step mask for window {block.self_attn.window!r}: built for {tuple(masks)}")
        mask = masks[block.self_attn.window]
        a = block.self_attn(h, cos, sin, kv, j, n_new, lens_after, read_len, impl, mask)  # [B, T, D]
        if block.sandwich:  # Gemma: the outputs normed before they join the residual
            x = x + block.post_attention_layernorm(a)
            x = x + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(x)))
        else:
            x = x + a
            x = x + block.mlp(block.post_attention_layernorm(x))
    return x


class LayerRunner(Protocol):
    """Runs every block of a compiled step in place of `run_blocks` over the whole model (capture.regions: the
    layers split into regions, each compiled apart and called as one opaque op). Same contract as the loop:
    writes each layer's K/V at the old lengths, does not advance them, returns x after the last block."""

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: StaticKVCache,
        n_new: torch.Tensor,
        lens_after: torch.Tensor,
        read_len: int,
        fresh: bool,
    ) -> torch.Tensor: ...
