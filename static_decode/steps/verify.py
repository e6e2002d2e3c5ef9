"""The speculative step kinds: drafting on the device and verify steps that accept a run of tokens.

Same signature and rules as static_decode.steps.functions: `fn(model, cache, bufs, read_len) -> None`, fixed shapes, no
host reads. A verify step feeds [next, draft_1..draft_K] at the row's length; with a accepted drafts the row emits
a + 1 tokens and its device length is lowered to cover only them (rejected K/V stay past it, masked, to be
overwritten: nothing moves). Greedy acceptance keeps the longest prefix argmax agrees with; sampled acceptance is
the speculative rejection rule, so emitted tokens are distributed exactly as plain sampling's. `speculative_steps`
returns the kinds a speculation config adds. Acceptance and the draft kinds in full: docs/internals.md#verify.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from static_decode.core.cache import StaticKVCache
from static_decode.model.llama import Llama
from static_decode.steps import sampling
from static_decode.steps.functions import StepBuffers, StepFn, emit
from static_decode.steps.speculation import DraftModel, PromptLookup, Speculation

ACCEPT_SALT = 0x85EBCA6B  # keys the acceptance uniforms apart from the token draws of the same (seed, step)
DRAFT_SALT = 0xC2B2AE35  # keys a draft model's own draws apart from the target's

VERIFY_KINDS = ("verify", "verify_greedy")
DRAFT_KINDS = ("draft_prefill", "draft", "draft_greedy", "draft_follow")


def lookup_draft(hist: torch.Tensor, hist_len: torch.Tensor, read_len: int, tokens: int, ngram: int) -> torch.Tensor:
    """[B, tokens] draft ids by prompt lookup over hist[:, :read_len] ([B, >= read_len] int64, row b holding
    hist_len[b] tokens): what followed the most recent earlier occurrence of each row's last `ngram` tokens.

    A draft that runs past the known text repeats the matched span (a loop in the text continues); a row
    without a match drafts its last token repeated (verified like any draft: it only costs acceptance).
    """
    B = hist.shape[0]
    dev = hist.device
    last_tok = hist.gather(1, (hist_len - 1).clamp(min=0)[:, None])  # [B, 1]
    if read_len <= ngram:  # too short for an earlier occurrence of a whole n-gram
        return last_tok.expand(B, tokens).clone()
    h = hist[:, :read_len]  # [B, S], S = read_len: the bucket bounds the search as it bounds the attention read
    i = torch.arange(ngram, device=dev)  # [n]
    # Clamped: a history shorter than the n-gram would index below 0 (the host bounds every length by read_len).
    suffix = h.gather(1, (hist_len[:, None] - ngram + i[None, :]).clamp(min=0, max=read_len - 1))  # [B, n]
    windows = h.unfold(1, ngram, 1)  # [B, S - n + 1, n] a view: each start position's n-gram
    j = torch.arange(windows.shape[1], device=dev)  # [S - n + 1]
    # An earlier occurrence ends before the suffix's last token, so at least one token follows it.
    hit = (windows == suffix[:, None, :]).all(dim=-1) & (j[None, :] + ngram < hist_len[:, None])  # [B, S - n + 1]
    best = torch.where(hit, j[None, :], -1).amax(dim=-1)  # [B] the most recent start, -1 = none
    period = (hist_len - ngram - best).clamp(min=1)  # [B] distance from the match to the suffix
    k = torch.arange(tokens, device=dev)  # [K]
    src = best[:, None] + ngram + k[None, :] % period[:, None]  # [B, K] all < hist_len
    draft = h.gather(1, src.clamp(min=0, max=read_len - 1))  # [B, K]
    return torch.where(best[:, None] >= 0, draft, last_tok)


def _verify_logits(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> tuple[torch.Tensor, ...]:
    """Feed [next, draft] to the live rows; logits [B, K + 1, V] and the slots fed per row [B]."""
    K = bufs.draft.shape[1]
    feed = torch.cat([bufs.next, bufs.draft], dim=1)  # [B, K + 1] token ids (not K/V: nothing is concatenated there)
    n_new = (~bufs.done).to(torch.int64) * (K + 1)  # [B] done rows feed nothing
    return model.step(feed, cache, n_new, read_len), n_new


def _accept(
    cache: StaticKVCache, bufs: StepBuffers, tokens: torch.Tensor, count: torch.Tensor, n_new: torch.Tensor,
    logits: torch.Tensor,
) -> None:
    """Emit the first count[b] of tokens [B, K + 1] (slot t's token scored by the target's logits [B, K + 1, V] at
    slot t); lower the device lengths by the slots not kept."""
    emit(bufs, tokens, count, logits)  # lowers count to what was recorded (EOS, limit, done rows)
    cache.lens.sub_(n_new - count)


def greedy_accept(logits: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of draft [B, K] against logits [B, K + 1, V]: the tokens [B, K + 1] (the model's
    argmax at every slot) and how many of them to emit [B] (accepted drafts + 1)."""
    K = draft.shape[1]
    pred = logits.argmax(dim=-1)  # [B, K + 1]
    agree = (draft == pred[:, :K]).to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [B] accepted drafts
    return pred, agree + 1


def sampled_accept(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, seed: torch.Tensor, step: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule: p [B, K + 1, V] target probabilities, q [B, K, V] draft probabilities, draft [B, K]
    drafted ids (q > 0 there), seed / step [B] (step: the index of the row's first token of this step).
    Returns tokens [B, K + 1] and how many of them to emit [B]."""
    B, K1, V = p.shape
    K = K1 - 1
    slot = torch.arange(K1, device=p.device)  # [K + 1]
    p_d = p[:, :K].gather(-1, draft[..., None]).squeeze(-1)  # [B, K]
    q_d = q.gather(-1, draft[..., None]).squeeze(-1)  # [B, K]
    u = sampling.uniform(sampling.mix32(seed ^ ACCEPT_SALT), step, K)  # [B, K] one uniform per draft slot
    keep = (u * q_d < p_d).to(torch.int64)  # [B, K]  u < p/q without dividing by a tiny q
    a = keep.cumprod(dim=-1).sum(dim=-1)  # [B] accepted drafts
    p_a = p.gather(1, a[:, None, None].expand(B, 1, V)).squeeze(1)  # [B, V]
    q_a = q.gather(1, a.clamp(max=K - 1)[:, None, None].expand(B, 1, V)).squeeze(1)  # [B, V]
    q_a = q_a * (a < K)[:, None]  # no draft after slot K: the bonus token is drawn from p itself
    resid = (p_a - q_a).clamp(min=0)  # [B, V]
    resid = torch.where(resid.sum(dim=-1, keepdim=True) > 0, resid, p_a)  # p == q up to rounding: draw from p
    x = sampling.draw(resid, seed, step + a)  # [B] the token at slot a
    drafts = draft.gather(1, slot.clamp(max=K - 1)[None, :].expand(B, K1))  # [B, K + 1] slot K: never emitted
    tokens = torch.where(slot[None, :] == a[:, None], x[:, None], drafts)  # [B, K + 1]
    return tokens, a + 1


def _target_probs(logits: torch.Tensor, bufs: StepBuffers) -> torch.Tensor:
    """sampling.probabilities at every slot: [B, T, V] from logits [B, T, V]."""
    B, T, V = logits.shape

    def per_slot(x: torch.Tensor) -> torch.Tensor:
        return x[:, None].expand(B, T).reshape(B * T)  # [B * T] a row's parameter at each of its slots

    p = sampling.probabilities(
        logits.reshape(B * T, V), per_slot(bufs.temperature), per_slot(bufs.top_k), per_slot(bufs.top_p)
    )  # [B * T, V]
    return p.view(B, T, V)


def _verify_greedy(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """Verify `bufs.draft` greedily; emit and roll back."""
    logits, n_new = _verify_logits(model, cache, bufs, read_len)
    _accept(cache, bufs, *greedy_accept(logits, bufs.draft), n_new, logits)


def _verify_sampled(
    model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int, q: torch.Tensor | None
) -> None:
    """Verify `bufs.draft` by the rejection rule against q [B, K, V] (None: the one-hot of a fixed draft)."""
    logits, n_new = _verify_logits(model, cache, bufs, read_len)
    if q is None:
        q = F.one_hot(bufs.draft, logits.shape[-1]).to(torch.float32)  # [B, K, V] a fixed draft: q = 1 on it
    tokens, count = sampled_accept(_target_probs(logits, bufs), q, bufs.draft, bufs.seed, bufs.step)
    _accept(cache, bufs, tokens, count, n_new, logits)


def _lookup(spec: PromptLookup) -> tuple[StepFn, StepFn]:
    K, n = spec.tokens, spec.ngram

    def verify_lookup_greedy(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
        bufs.draft.copy_(lookup_draft(bufs.hist, bufs.plen + bufs.step, read_len, K, n))
        _verify_greedy(model, cache, bufs, read_len)

    def verify_lookup(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
        bufs.draft.copy_(lookup_draft(bufs.hist, bufs.plen + bufs.step, read_len, K, n))
        _verify_sampled(model, cache, bufs, read_len, None)

    return verify_lookup, verify_lookup_greedy


def _draft_model(spec: DraftModel, dcache: StaticKVCache) -> dict[str, StepFn]:
    draft, K = spec.model, spec.tokens

    def draft_prefill(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
        """The prompt chunk the target just took, into the draft's cache at the same positions."""
        dcache.lens.copy_(cache.lens - bufs.n_new)
        draft.hidden_states(bufs.chunk, dcache, bufs.n_new, read_len)

    def draft_follow(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
        """Before a plain decode step: the token it feeds, into the draft's cache."""
        dcache.lens.copy_(cache.lens)
        draft.hidden_states(bufs.next, dcache, (~bufs.done).to(torch.int64), read_len)

    def run_draft(bufs: StepBuffers, cache: StaticKVCache, read_len: int, sample: bool) -> None:
        dcache.lens.copy_(cache.lens)  # the rollback of the last verify step
        live = (~bufs.done).to(torch.int64)  # [B]
        seed = sampling.mix32(bufs.seed ^ DRAFT_SALT)  # [B]
        tok = bufs.next  # [B, 1]
        for t in range(K):  # unrolled: K one-token steps of the draft in one captured graph
            logits = draft.step(tok, dcache, live, read_len)[:, 0]  # [B, V]
            if sample:
                q = sampling.probabilities(logits, bufs.temperature, bufs.top_k, bufs.top_p)  # [B, V]
                bufs.draft_probs[:, t].copy_(q)
                tok = sampling.draw(q, seed, bufs.step + t)[:, None]  # [B, 1]
            else:
                tok = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
            bufs.draft[:, t : t + 1].copy_(tok)
        # The last draft's K/V too: when every draft is accepted the draft cache must hold it.
        draft.hidden_states(tok, dcache, live, read_len)

    def draft_sampled(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
        run_draft(bufs, cache, read_len, True)

    def draft_greedy(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
        run_draft(bufs, cache, read_len, False)

    def verify_draft(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
        _verify_sampled(model, cache, bufs, read_len, bufs.draft_probs)

    return {
        "draft_prefill": draft_prefill,
        "draft": draft_sampled,
        "draft_greedy": draft_greedy,
        "draft_follow": draft_follow,
        "verify": verify_draft,
        "verify_greedy": _verify_greedy,
    }


def speculative_kinds(spec: Speculation, greedy: bool) -> tuple[str, ...]:
    """The kinds a request with `spec` launches beyond the plain ones (which run while speculation pauses)."""
    if isinstance(spec, PromptLookup):
        return ("verify_greedy",) if greedy else ("verify",)
    return ("draft_prefill", "draft_follow") + (("draft_greedy", "verify_greedy") if greedy else ("draft", "verify"))


def speculative_steps(spec: Speculation, draft_cache: StaticKVCache | None = None) -> dict[str, StepFn]:
    """The step kinds a Generator adds for `spec` (a draft model needs its cache, `draft_cache`)."""
    if isinstance(spec, PromptLookup):
        verify, verify_greedy = _lookup(spec)
        return {"verify": verify, "verify_greedy": verify_greedy}
    if isinstance(spec, DraftModel):
        if draft_cache is None:
            raise ValueError("a DraftModel's steps need the draft's cache (draft_cache)")
        return _draft_model(spec, draft_cache)
    raise TypeError(f"speculate must be a PromptLookup or a DraftModel, got {type(spec).__name__}")
