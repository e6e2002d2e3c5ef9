"""BASELINE, deliberately naive: the `concat` decode system of `static-decode bench`.

Everything this library exists to avoid, on purpose, so the bench can show what it costs next to the real
thing on the same weights: the KV cache is a Python list of per-layer tensors grown with `torch.cat` every
step (rule 1 broken: the whole cache is copied each token), and the KV heads are repeated to the query heads
before attention (rule 2 broken: K and V are materialised G times). Attention reads the whole grown cache.
Only the bench's `concat` system imports it (and tests); nothing below the commands does. It reuses a
`static_decode.Llama`'s weights, so only the cache and the attention differ (docs/internals.md#bench-baselines).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from static_decode.model import rope
from static_decode.model.llama import Llama

NAME = "concat"  # the system's name in the bench output


class ConcatDecoder:
    """A Llama forward over a cache that grows by concatenation, with repeated KV heads (a baseline)."""

    def __init__(self, model: Llama) -> None:
        if not isinstance(model, Llama):
            raise TypeError(f"model must be a static_decode.Llama, got {type(model).__name__}")
        self.model = model
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.reset()

    def reset(self) -> None:
        """Forget the cache (the next step starts at position 0)."""
        layers = self.model.config.num_layers
        self.k = [None] * layers  # per layer [B, Hkv, L, d], regrown every step
        self.v = [None] * layers

    @property
    def length(self) -> int:
        """Tokens cached per row."""
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def bytes_cached(self) -> int:
        """Bytes of K and V held now (what the next step's torch.cat copies again)."""
        return sum(t.nbytes for t in (*self.k, *self.v) if t is not None)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [B, T] (int64) to every row; return logits [B, T, V]."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64:
            got = getattr(tokens, "shape", tokens)
            raise ValueError(f"tokens must be an int64 tensor [B, T], got {got!r}")
        m = self.model
        B, T = tokens.shape
        if self.k[0] is not None and self.k[0].shape[0] != B:
            raise ValueError(f"tokens has batch {B}, the cache holds {self.k[0].shape[0]} rows: reset() first")
        start = self.length
        positions = (start + torch.arange(T, device=tokens.device)).expand(B, T)  # [B, T]
        cos, sin = m.rotary(positions, torch.full((B,), start + T, device=tokens.device))  # [B, 1, T, r/2]
        x = m.embed_tokens(tokens)  # [B, T, D]
        for i, block in enumerate(m.layers):
            x = x + self._attention(i, block.self_attn, block.input_layernorm(x), cos, sin, start)
            x = x + block.mlp(block.post_attention_layernorm(x))
        return m.head(m.norm(x))

    def _attention(self, i: int, attn, x: torch.Tensor, cos, sin, start: int) -> torch.Tensor:
        B, T, _ = x.shape
        hq, hkv, d = attn.heads, attn.kv_heads, attn.head_dim
        wq, wk, wv = attn.qkv_weights()  # the checkpoint's three matrices (views where the model joined them)
        bq, bk, bv = attn.qkv_biases()
        q = F.linear(x, wq, bq).view(B, T, hq, d).transpose(1, 2)  # [B, Hq, T, d]
        k = F.linear(x, wk, bk).view(B, T, hkv, d).transpose(1, 2)  # [B, Hkv, T, d]
        v = F.linear(x, wv, bv).view(B, T, hkv, d).transpose(1, 2)  # [B, Hkv, T, d]
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        # The naive cache: a fresh allocation holding the old cache plus the chunk, every step.
        self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k], dim=2)  # [B, Hkv, L, d]
        self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v], dim=2)
        g = hq // hkv
        k_rep = self.k[i].repeat_interleave(g, dim=1)  # [B, Hq, L, d]: KV heads materialised G times
        v_rep = self.v[i].repeat_interleave(g, dim=1)
        L = k_rep.shape[2]
        # Query t sits at start + t and sees keys 0..start + t (offset causal mask, bottom-right aligned).
        pos = start + torch.arange(T, device=x.device)  # [T]
        visible = torch.arange(L, device=x.device) <= pos[:, None]  # [T, L]
        scores = q @ k_rep.transpose(-1, -2) / math.sqrt(d)  # [B, Hq, T, L]
        scores = scores.masked_fill(~visible, -math.inf)
        out = torch.softmax(scores, dim=-1) @ v_rep  # [B, Hq, T, d]
        return attn.o_proj(out.transpose(1, 2).reshape(B, T, hq * d))


def _demo() -> None:
    """Greedy tokens of the baseline against the library on a tiny random model (a smoke check)."""
    from static_decode.model.config import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = Llama(cfg).eval()
    base = ConcatDecoder(model)
    cache = model.new_cache(1, 64)
    prompt = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        a, b = base.step(prompt), model(prompt, cache, [5])
        for _ in range(8):
            diff = float((a - b).abs().max())
            print(f"baseline {int(a[0, -1].argmax())}  library {int(b[0, -1].argmax())}  max |diff| {diff:.2e}")
            tok = a[:, -1:].argmax(-1)
            a, b = base.step(tok), model(tok, cache, [1])


if __name__ == "__main__":
    _demo()
