"""A Llama-family causal LM over the static KV cache: embedding, the decoder blocks (static_decode.model.blocks),
final norm, LM head (tied or not); module names are transformers' minus its `model.` prefix (`hf_name`).

The step contract: `step(tokens [B, T], cache, n_new [B] device, read_len: int)` writes every layer's K/V at the old
lengths, attends over `cache.layer_view(layer, read_len)`, advances the device lengths once and returns logits
[B, T, V], never reading a tensor back to the host; `forward` is the checked host wrapper. The families, positions
and tensor parallelism: docs/internals.md#llama.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from static_decode.core.attention import CHOICES, DEFAULT_IMPL, IMPLS
from static_decode.core.cache import IntsLike, StaticKVCache
from static_decode.model import projection, rope
from static_decode.model.blocks import (
    Block,
    LayerRunner,
    RMSNorm,
    layer_windows,
    run_blocks,
    softcapped,
    step_attention,
)
from static_decode.model.config import LlamaConfig
from static_decode.model.parallel import SINGLE, TensorParallel

# Llama.kv_dtype; "int8": int8 codes with a float32 scale per token and KV head (static_decode.core.kv_quant)
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def hf_name(name: str) -> str:
    """The transformers state-dict key of one of our parameters."""
    return name if name.startswith("lm_head.") else f"model.{name}"


class Llama(nn.Module):
    """A Llama-family causal LM whose attention reads and writes a `StaticKVCache`.

    `attn_impl` picks the core attention formulation (attention.CHOICES; "auto" resolves per step from the device,
    batch and KV heads: attention.resolve_impl); it is a runtime choice, not part of the checkpoint. `kv_dtype`
    (None: the model's dtype) is the dtype `new_cache` stores K/V in, also a runtime choice: a bfloat16 or float16
    cache for a float32 model halves the bytes a long-context decode step reads (llama.cpp's default is an f16
    cache); K/V are rounded once when written, the CPU kernel widens them back to float32 math, the SDPA
    formulations compute in the cache's dtype; "int8" (torch.int8) stores int8 codes and a float32 scale per token
    and KV head (static_decode.core.kv_quant: 0.52x a bfloat16 cache's bytes at head_dim 128), read in place by the
    CPU kernel and dequantized per read by the other formulations.
    `tp` makes this the rank's shard of a tensor-parallel model
    (static_decode.model.parallel); a world size that does not divide the KV heads (or the MLP width) is refused here.
    `fused_projections` (default): q/k/v and gate/up are one product each over weights joined by rows (see
    static_decode.model.joining); the state dict keeps the checkpoint's names either way.
    """

    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor | None  # longrope's table past the original context; None for the other types
    local_inv_freq: torch.Tensor | None  # Gemma 3: the sliding layers' table (config.local_rope); None without one
    # Formulations this model's steps resolve past (attention.resolve_impl's `skip`): set only on a view, see skipping.
    attn_skip: tuple[str, ...] = ()
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
            Block(
                config, **kw, tp=tp, fused=fused_projections, window=config.layer_window(i),
                rope_slot=config.layer_rope(i),
            )
            for i in range(config.num_layers)
        )
        # Gemma: the embedding times sqrt(D) rounded to the model dtype first, as transformers multiplies it.
        self.embed_mult = float(torch.tensor(config.hidden_size**0.5).to(dtype)) if config.embed_scale else None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw, plus_one=config.norm_plus_one)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)  # replicated
        )
        half = config.rope.rotary_dim(config.head_dim) // 2
        self.register_buffer("inv_freq", torch.empty(half, device=device), persistent=False)
        self.register_buffer("long_inv_freq", None, persistent=False)
        self.register_buffer("local_inv_freq", None, persistent=False)
        self.reset_rope()

    def reset_rope(self) -> None:
        """(Re)compute the float32 inverse frequencies on the model's device (after loading onto meta)."""
        device, c = self.embed_tokens.weight.device, self.config
        self.inv_freq = rope.inv_freq(c.rope, c.head_dim, device=device)
        if c.rope.type == "longrope":
            self.long_inv_freq = rope.long_inv_freq(c.rope, c.head_dim, device=device)
        if c.local_rope is not None:
            self.local_inv_freq = rope.inv_freq(c.local_rope, c.head_dim, device=device)

    def rotary(self, positions: torch.Tensor, seq_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, T, r/2] in the model's dtype for positions [B, T] of rows whose lengths after the step
        are seq_len [B] (the length picks the table of the "dynamic" and "longrope" types; rope.step_freq), scaled
        by the attention factor (yarn, longrope). With a local rope (Gemma 3) both are [2, B, 1, T, r/2]: the full
        layers' table, then the sliding layers' (Attention.rope_slot picks one)."""
        c = self.config
        freq = rope.step_freq(c.rope, c.head_dim, self.inv_freq, self.long_inv_freq, seq_len)  # [r/2] | [B, 1, r/2]
        cos, sin = rope.cos_sin(freq, positions, self.dtype, rope.attention_factor(c.rope))
        if c.local_rope is None or self.local_inv_freq is None:
            return cos, sin
        local = rope.step_freq(c.local_rope, c.head_dim, self.local_inv_freq, None, seq_len)
        lcos, lsin = rope.cos_sin(local, positions, self.dtype, rope.attention_factor(c.local_rope))
        return torch.stack((cos, lcos)), torch.stack((sin, lsin))  # [2, B, 1, T, r/2] each

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
        """Check a cache length before anything is allocated (LlamaConfig.check_max_len: a sliding window is a
        mask, so any length is exact)."""
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
        read_len == T: the attention then runs causal SDPA instead of a mask (masks.StepMask.causal)."""
        T = tokens.shape[1]
        positions = cache.lens[:, None] + torch.arange(T, device=tokens.device)  # [B, T] old lens + slot
        lens_after = cache.lens + n_new  # [B]
        cos, sin = self.rotary(positions, lens_after)  # [B, 1, T, r/2] ([2, B, 1, T, r/2] with a local rope)
        x = self.embed_tokens(tokens)  # [B, T, D]
        if self.embed_mult is not None:
            x = x * self.embed_mult  # [B, T, D]
        if self.layer_runner is not None and torch.compiler.is_compiling():
            # A compiled step whose blocks run as separately compiled layer regions (capture.regions, the CPU
            # default): the runner is traced as opaque calls; eager steps always take the inline loop below.
            x = self.layer_runner(x, cos, sin, cache, n_new, lens_after, read_len, fresh)
        else:
            groups = self.config.num_heads // self.config.num_kv_heads
            impl, mask = step_attention(
                self.attn_impl, groups, cache.kv_heads, lens_after, n_new, T, read_len, cache.head_dim, cache.dtype,
                fresh=fresh, skip=self.attn_skip, windows=layer_windows(self.layers), softcap=softcapped(self.layers),
            )
            x = run_blocks(self.layers, x, cos, sin, cache, n_new, lens_after, read_len, impl, mask)
        cache.advance(n_new)
        return self.norm(x)

    def skipping(self, impls: Sequence[str]) -> Llama:
        """A view of this model (the same parameters, buffers and cache layout; nothing copied) whose steps resolve
        past the attention formulations `impls`: what the capture registry hands a step kind whose compile failed
        with one of them, so that other kinds keep theirs."""
        bad = [i for i in impls if i not in IMPLS]
        if bad:
            raise ValueError(f"impls must be among {IMPLS}, got {bad[0]!r}")
        view = copy.copy(self)
        view.attn_skip = tuple(impls)
        return view

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] from final-normed hidden states [..., D] (Gemma 2: cap * tanh(logits / cap))."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = projection.linear(h, weight)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
