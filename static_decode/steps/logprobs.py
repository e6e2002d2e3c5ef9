"""Token logprobs on the device, and their read-back on the host.

The reported logprob is the model's own distribution: log_softmax of the raw logits, before the logit bias, the
penalties, temperature, min-p, top-k and top-p (vLLM's default, "raw_logprobs"; OpenAI reports the model's
distribution likewise). Sampling filters change which token is drawn, not what the model thinks of it.

The token-choosing steps compute, for every emitted token, its logprob and the K best tokens with theirs (K fixed
when the buffers are allocated; K = 0 keeps only the chosen token's, and buffers of 0 columns switch it all off:
a shape, so a trace takes the decision, never a tensor value). They are written beside `bufs.out`, at the same
columns, and read back with it. A scored prefill chunk (`score_prompt`) writes the logprob of every prompt token
given its prefix at the token's prompt index: column 0 is never a prompt token's (the first has none), and the
first read-back of a request, after token 0 is emitted at column 0 and before any decode step writes column 1,
takes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class StepBuffers(Protocol):
    """The step buffers these functions read and write (static_decode.steps.functions.StepBuffers has them)."""

    out: torch.Tensor  # [B, N] emitted tokens
    logprob: torch.Tensor  # [B, N + 1] float32 the chosen token's logprob
    top_logprobs: torch.Tensor  # [B, N + 1, P] float32 the P best logprobs
    top_ids: torch.Tensor  # [B, N + 1, P] int32 their ids


NO_TARGET = -1  # a prefill slot whose next prompt token is not in the prompt (the last one, padding)


@dataclass(frozen=True)
class TokenLogprob:
    """One token and what the model gave it: `logprob` (None for a prompt's first token, which nothing
    predicts) and the `top` alternatives as (token id, logprob) pairs, best first."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def enabled(bufs: StepBuffers) -> bool:
    """Whether these step buffers keep logprobs (a shape: static in a trace)."""
    return bufs.logprob.shape[1] > 0


def scores(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logprob of tokens [B, T] under logits [B, T, V] ([B, T] float32) and the k best ([B, T, k] float32 and
    int32 ids, best first). Ids past the vocabulary (a padded slot's target) are clamped: the caller writes those
    to the trash column."""
    lp = logits.to(torch.float32).log_softmax(dim=-1)  # [B, T, V]
    chosen = lp.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1)  # [B, T]
    if k == 0:
        return chosen, lp.new_zeros((*tokens.shape, 0)), tokens.new_zeros((*tokens.shape, 0), dtype=torch.int32)
    values, ids = lp.topk(k, dim=-1)  # [B, T, k] each
    return chosen, values, ids.to(torch.int32)


def record(bufs: StepBuffers, logits: torch.Tensor, tokens: torch.Tensor, cols: torch.Tensor) -> None:
    """Write the scores of tokens [B, T] under logits [B, T, V] at columns cols [B, T] of row b (the trash
    column for what is not kept). index_put_ on the whole buffers, as `emit` does, so inductor writes in place."""
    if not enabled(bufs):
        return
    B, T = tokens.shape
    chosen, values, ids = scores(logits, tokens, bufs.top_ids.shape[-1])  # [B, T], [B, T, K], [B, T, K]
    rows = torch.arange(B, device=tokens.device)[:, None].expand(B, T)  # [B, T]
    bufs.logprob.index_put_((rows, cols), chosen)
    if values.shape[-1] > 0:
        bufs.top_logprobs.index_put_((rows, cols), values)
        bufs.top_ids.index_put_((rows, cols), ids)


def score_prompt(bufs: StepBuffers, logits: torch.Tensor, targets: torch.Tensor, start: int) -> None:
    """Prompt logprobs of one prefill chunk: slot t's logits [B, C, V] score targets[b, t] [B, C] (the prompt
    token after it, NO_TARGET where there is none), written at prompt index start + t + 1."""
    C = targets.shape[1]
    N = bufs.logprob.shape[1] - 1  # the trash column
    col = start + 1 + torch.arange(C, device=targets.device)  # [C]
    cols = torch.where(targets >= 0, col[None, :], N)  # [B, C]
    record(bufs, logits, targets, cols)


def read(bufs: StepBuffers, rows: list[list[int]], first: list[int], k: int | None) -> list[list[TokenLogprob]]:
    """Host side: the records of tokens rows[b], which sit at columns first[b].. of row b, with `k` alternatives
    (None: none). One copy of the columns they span per buffer, right after the read-back of `out`: every step
    that wrote them has finished, so nothing is waited for."""
    width = max((f + len(r) for f, r in zip(first, rows, strict=True)), default=0)
    lo = min((f for f, r in zip(first, rows, strict=True) if r), default=0)
    if width <= lo:
        return [[] for _ in rows]
    n = len(rows)
    chosen = bufs.logprob[:n, lo:width].cpu().numpy()  # [R, W]
    kk = 0 if k is None else k
    values = bufs.top_logprobs[:n, lo:width, :kk].cpu().numpy()  # [R, W, k]
    ids = bufs.top_ids[:n, lo:width, :kk].cpu().numpy()  # [R, W, k]
    out = []
    for b, toks in enumerate(rows):
        recs = []
        for i, t in enumerate(toks):
            c = first[b] + i - lo
            top = tuple((int(j), float(v)) for j, v in zip(ids[b, c], values[b, c], strict=True))
            recs.append(TokenLogprob(int(t), float(chosen[b, c]), top))
        out.append(recs)
    return out


def read_prompt(bufs: StepBuffers, prompts: list[list[int]], k: int) -> list[list[TokenLogprob]]:
    """Host side: each prompt's records (the first token's logprob None), read after the request's first step."""
    recs = read(bufs, [p[1:] for p in prompts], [1] * len(prompts), k)
    return [[TokenLogprob(int(p[0]), None), *r] for p, r in zip(prompts, recs, strict=True)]


def prompt_targets(rows: list[list[int]], start: int, C: int, batch: int) -> np.ndarray:
    """[batch, C] int64: the prompt token after each slot of the chunk starting at `start` (NO_TARGET past it)."""
    targets = np.full((batch, C), NO_TARGET, dtype=np.int64)
    for b, row in enumerate(rows):
        nxt = row[start + 1 : start + 1 + C]
        targets[b, : len(nxt)] = nxt
    return targets
