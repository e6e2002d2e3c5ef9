"""A Llama-family decoder over the static KV cache.

Embedding, RMSNorm, rotary GQA attention through the core (`cache.write`, `cache.layer_view`,
`grouped_attention`), SwiGLU MLP, final norm, LM head (tied or not). Module names mirror transformers'
LlamaForCausalLM minus its `model.` prefix, so a checkpoint maps by name (`hf_name`). The families that differ
from Llama only in a few switches (static_decode.model.config: Mistral, Qwen2, Qwen3) are this same class: optional
biases on q/k/v, o_proj and the MLP, and Qwen3's per-head RMSNorm on q and k (`q_norm`, `k_norm`, named as
transformers names them) before the rotary embedding.

The step contract (what a captured step runs): `step(tokens [B, T], cache, n_new [B] device, read_len: int)`
writes every layer's K/V at the old lengths, attends with lens_after = cache.lens + n_new over
`cache.layer_view(layer, read_len)`, advances the device lengths once, and returns logits [B, T, V]. Positions
come from cache.lens on the device. It never reads a tensor back to the host. `forward` is the checked host
wrapper around it.

Tensor parallelism (`tp`, static_decode.model.parallel): a rank builds only its slice of the attention and MLP
weights (its KV heads with their query heads, its slice of the MLP's inner width) and adds the partial sums of
o_proj and down_proj with one all-reduce each; everything else, and so the step's logits, is the same on
every rank. At world 1 the code path is exactly the single-process one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import nn

from static_decode.core.attention import (
    CHOICES,
    DEFAULT_IMPL,
    FRESH,
    StepMask,
    grouped_attention,
    resolve_impl,
    step_mask,
)
from static_decode.core.cache import IntsLike, LayerSpan, StaticKVCache
from static_decode.model import projection, rope
from static_decode.model.config import LlamaConfig
from static_decode.model.joining import checkpoint_layout
from static_decode.model.parallel import SINGLE, TensorParallel

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # Llama.kv_dtype


def hf_name(name: str) -> str:
    """The transformers state-dict key of one of our parameters."""
    return name if name.startswith("lm_head.") else f"model.{name}"


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as transformers does)."""

    def __init__(
        self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def row_parallel(linear: nn.Linear, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A row-parallel projection: this rank's partial product, summed over the ranks, then the bias (once)."""
    if not tp.enabled:
        return projection.linear(x, linear.weight, linear.bias)
    out = tp.all_reduce(projection.linear(x, linear.weight))
    return out if linear.bias is None else out + linear.bias


class Attention(nn.Module):
    """Rotary GQA self-attention whose K/V live in the static cache (this rank's heads under `tp`); `fused`: q, k
    and v are one `qkv_proj` (see static_decode.model.joining)."""

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
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, **kw) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, **kw) if cfg.qk_norm else None
        self.heads, self.kv_heads, self.head_dim, self.tp = hq, hkv, d, tp
        if fused:
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
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        kv = cache.k.dtype  # the model's dtype, or the cache's own (Llama.kv_dtype): rounded once, here
        cache.write(layer, k.to(kv), v.to(kv), n_new)  # at the old lengths; padded slots go to the spare row
        k_all, v_all = cache.layer_view(layer, read_len)  # [B, Hkv, read_len, d] views
        out = grouped_attention(q, k_all, v_all, lens_after, n_new, impl=impl, mask=mask)  # [B, Hq, T, d]
        out = out.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)  # [B, T, Hq_local * d]
        return row_parallel(self.o_proj, out, self.tp)  # [B, T, D], summed over the ranks


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (this rank's slice of the inner width under `tp`); `fused`: gate and
    up are one `gate_up_proj` (see static_decode.model.joining)."""

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
        self.fused, self.inner = fused, inner
        if fused:  # column-parallel: this rank's gate rows, then its up rows (see static_decode.model.joining)
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inner, **kw)
        else:
            self.gate_proj = nn.Linear(cfg.hidden_size, inner, **kw)  # column-parallel
            self.up_proj = nn.Linear(cfg.hidden_size, inner, **kw)  # column-parallel
        self.down_proj = nn.Linear(inner, cfg.hidden_size, **kw)  # row-parallel
        self.tp = tp
        if fused:
            checkpoint_layout(self, {"gate_up_proj": (("gate_proj", "up_proj"), (inner, inner))})

    def glu_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up weights [inner, D]: row blocks (views) of the joined weight when fused."""
        if self.fused:
            return tuple(self.gate_up_proj.weight.split(self.inner))  # type: ignore[return-value]
        return self.gate_proj.weight, self.up_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            h = projection.glu_joined(x, self.gate_up_proj.weight, self.gate_up_proj.bias)  # [B, T, inner]
        else:
            g, u = self.gate_proj, self.up_proj
            h = projection.glu(x, g.weight, u.weight, g.bias, u.bias)  # [B, T, inner]: silu(gate(x)) * up(x)
        return row_parallel(self.down_proj, h, self.tp)


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x))."""

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
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(cfg, dtype=dtype, device=device, tp=tp, fused=fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = MLP(cfg, dtype=dtype, device=device, tp=tp, fused=fused)


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
) -> tuple[str, StepMask | None]:
    """The formulation one step's attention runs (`attention.resolve_impl`: "auto" by device, batch, KV heads and
    query rows) and its mask, built once and shared by the layers: FRESH for a fresh chunk (causal SDPA, no mask),
    None where there is nothing to mask (flex and decode_kernel evaluate their own inside the kernel; no keys or
    no slots), else `attention.step_mask` in the cache's dtype `kv_dtype`."""
    impl = resolve_impl(
        impl, lens_after.shape[0], kv_heads, groups * T, lens_after.device, head_dim, kv_dtype, groups=groups
    )
    if fresh:
        return impl, FRESH
    if impl in ("flex", "decode_kernel") or read_len <= 0 or T <= 0:
        return impl, None
    # The SDPA formulations run in the cache's dtype (grouped_attention casts the queries to it), so their additive
    # mask is built in it.
    return impl, step_mask(lens_after, n_new, T, read_len, groups=groups, dtype=kv_dtype, impl=impl)


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
    mask: StepMask | None,
) -> torch.Tensor:
    """x [B, T, D] through `blocks` in order; block j writes and reads layer j of `kv` (the whole cache for the
    whole model, a `LayerSpan` for a region of it). The unit capture.regions compiles apart."""
    for j, block in enumerate(blocks):
        h = block.input_layernorm(x)
        x = x + block.self_attn(h, cos, sin, kv, j, n_new, lens_after, read_len, impl, mask)
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


class Llama(nn.Module):
    """A Llama-family causal LM whose attention reads and writes a `StaticKVCache`.

    `attn_impl` picks the core attention formulation (attention.CHOICES; "auto" resolves per step from the device,
    batch and KV heads: attention.resolve_impl); it is a runtime choice, not part of the checkpoint. `kv_dtype`
    (None: the model's dtype) is the dtype `new_cache` stores K/V in, also a runtime choice: a bfloat16 or float16
    cache for a float32 model halves the bytes a long-context decode step reads (llama.cpp's default is an f16
    cache); K/V are rounded once when written, the CPU kernel widens them back to float32 math, the SDPA
    formulations compute in the cache's dtype. `tp` makes this the rank's shard of a tensor-parallel model
    (static_decode.model.parallel); a world size that does not divide the KV heads (or the MLP width) is refused here.
    `fused_projections` (default): q/k/v and gate/up are one product each over weights joined by rows (see
    static_decode.model.joining); the state dict keeps the checkpoint's names either way.
    """

    inv_freq: torch.Tensor
    # Set by the capture layer around the calls of its compiled steps (capture.regions); read only while tracing.
    layer_runner: LayerRunner | None = None

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        attn_impl: str = DEFAULT_IMPL,
        kv_dtype: torch.dtype | None = None,
        tp: TensorParallel = SINGLE,
        fused_projections: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(fused_projections, bool):
            raise TypeError(f"fused_projections must be a bool, got {fused_projections!r}")
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if attn_impl not in CHOICES:
            raise ValueError(f"attn_impl must be one of {CHOICES}, got {attn_impl!r}")
        if not isinstance(tp, TensorParallel):
            raise TypeError(f"tp must be a static_decode.model.parallel.TensorParallel, got {type(tp).__name__}")
        tp.check(config)
        self.config, self.attn_impl, self.tp = config, attn_impl, tp
        self.kv_dtype = kv_dtype
        kw = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)  # replicated
        self.fused_projections = fused_projections
        self.layers = nn.ModuleList(
            Block(config, **kw, tp=tp, fused=fused_projections) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)  # replicated
        )
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2, device=device), persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the float32 inverse frequencies on the model's device (after loading onto meta)."""
        device = self.embed_tokens.weight.device
        self.inv_freq = rope.inv_freq(self.config.rope, self.config.head_dim, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def kv_heads(self) -> int:
        """KV heads this process holds (all of them at world 1, num_kv_heads / world under tp)."""
        return self.config.num_kv_heads // self.tp.world

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the K/V caches `new_cache` makes (the model's own unless set)."""
        return self._kv_dtype if self._kv_dtype is not None else self.dtype

    @kv_dtype.setter
    def kv_dtype(self, dtype: torch.dtype | str | None) -> None:
        if isinstance(dtype, str):
            dtype = KV_DTYPES.get(dtype, dtype)
        if dtype is not None and dtype not in KV_DTYPES.values():
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)} or None (the model's dtype), got {dtype!r}")
        self._kv_dtype = dtype

    def check_max_len(self, max_len: int) -> None:
        """Refuse a cache length this model cannot attend over exactly (a sliding window shorter than max_len),
        naming `sliding_window` and both numbers; allocates nothing."""
        self.config.check_max_len(max_len)

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """A cache sized for this model (this rank's KV heads): every layer's K and V in one allocation each."""
        c = self.config
        self.check_max_len(max_len)  # before the allocation
        return StaticKVCache(
            batch,
            self.kv_heads,
            max_len,
            c.head_dim,
            layers=c.num_layers,
            dtype=self.kv_dtype,
            device=self.device,
        )

    # ---- device side: the step -----------------------------------------------------------------------------
    def hidden_states(
        self, tokens: torch.Tensor, cache: StaticKVCache, n_new: torch.Tensor, read_len: int, *, fresh: bool = False
    ) -> torch.Tensor:
        """The step up to (and including) the final norm: [B, T, D]. Writes K/V and advances the lengths.

        fresh=True promises (the host checked its mirror) that every row starts empty and fills all T slots and
        read_len == T: the attention then runs causal SDPA instead of a mask (attention.StepMask.causal)."""
        T = tokens.shape[1]
        positions = cache.lens[:, None] + torch.arange(T, device=tokens.device)  # [B, T] old lens + slot
        cos, sin = rope.cos_sin(self.inv_freq, positions, self.dtype)  # [B, 1, T, d/2]
        lens_after = cache.lens + n_new  # [B]
        x = self.embed_tokens(tokens)  # [B, T, D]
        if self.layer_runner is not None and torch.compiler.is_compiling():
            # A compiled step whose blocks run as separately compiled layer regions (capture.regions, the CPU
            # default): the runner is traced as opaque calls; eager steps always take the inline loop below.
            x = self.layer_runner(x, cos, sin, cache, n_new, lens_after, read_len, fresh)
        else:
            groups = self.config.num_heads // self.config.num_kv_heads
            impl, mask = step_attention(
                self.attn_impl, groups, cache.kv_heads, lens_after, n_new, T, read_len, cache.head_dim, cache.dtype,
                fresh=fresh,
            )
            x = run_blocks(self.layers, x, cos, sin, cache, n_new, lens_after, read_len, impl, mask)
        cache.advance(n_new)
        return self.norm(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] from final-normed hidden states [..., D]."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return projection.linear(h, weight)

    def step(
        self, tokens: torch.Tensor, cache: StaticKVCache, n_new: torch.Tensor, read_len: int
    ) -> torch.Tensor:
        """The fixed-shape step: logits [B, T, V] for tokens [B, T]; see the module docstring."""
        return self.head(self.hidden_states(tokens, cache, n_new, read_len))

    # ---- host side: the checked wrapper --------------------------------------------------------------------
    def check_cache(self, cache: StaticKVCache) -> None:
        """Refuse a cache that was not made for this model (shape, dtype or device)."""
        c = self.config
        want = (c.num_layers, self.kv_heads, c.head_dim, self.kv_dtype, self.device)
        got = (cache.layers, cache.kv_heads, cache.head_dim, cache.dtype, cache.device)
        if want != got:
            raise ValueError(
                f"cache (layers, kv_heads, head_dim, dtype, device) = {got}, the model needs {want}; "
                "use model.new_cache()"
            )

    def forward(
        self, tokens: torch.Tensor, cache: StaticKVCache, n_new: IntsLike, read_len: int | None = None
    ) -> torch.Tensor:
        """Checked step: validates everything on the host first, then runs `step` and commits the lengths.

        tokens: [B, T] int64 (slots past n_new[b] are padding but must still be valid ids); n_new: B ints.
        read_len defaults to the longest row after the chunk. On any error nothing is written.
        """
        self.check_cache(cache)
        self.tp.require_group()
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise ValueError(
                f"tokens must be an int64 tensor [B, T], got {getattr(tokens, 'dtype', type(tokens))} "
                f"{tuple(getattr(tokens, 'shape', ()))}"
            )
        B, T = tokens.shape
        if cache.batch != B:
            raise ValueError(f"tokens has batch {B}, the cache has batch {cache.batch}")
        if tokens.device != cache.device:
            raise ValueError(f"tokens is on {tokens.device}, the cache is on {cache.device}")
        if tokens.numel():
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(
                    f"token ids must lie in 0..{self.config.vocab_size - 1}, got range {lo}..{hi}"
                )
        n = cache.validate(n_new, T)
        longest = int(np.max(cache.host_lens + n)) if B else 0
        if read_len is None:
            read_len = longest
        elif isinstance(read_len, bool) or not isinstance(read_len, int):
            raise TypeError(f"read_len must be a Python int, got {type(read_len).__name__}")
        elif not longest <= read_len <= cache.max_len:
            raise ValueError(
                f"read_len={read_len} must lie in {longest}..{cache.max_len} (the longest row after "
                "this chunk)"
            )
        logits = self.step(tokens, cache, cache.device_ints(n), read_len)
        cache.commit(n)
        return logits
