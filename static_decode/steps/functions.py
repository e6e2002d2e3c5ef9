"""The device-only step functions of generation, over static buffers the host fills.

Every step has the signature `fn(model, cache, bufs, read_len) -> None`: fixed shapes, one Python int
(`read_len`), no host reads, results written in place into `bufs` (so a CUDA-graph replay overwriting its
outputs can lose nothing). The capture layer compiles these functions unchanged, one graph per
(kind, read bucket); `STEPS` maps each kind to its function (static_decode.steps.verify adds the speculative kinds).

A request runs `prefill` per prompt chunk, `first`, then `decode` per token (the greedy kinds when every row has
temperature 0). Each row counts its own emitted tokens; a `done` row is fed nothing. Every sampler value lives in a
buffer, so one graph per kind serves every request. Rows, counters and penalties: docs/internals.md#functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np
import torch

from static_decode.core.cache import StaticKVCache
from static_decode.model.llama import Llama
from static_decode.steps import grammar, logprobs, sampling

PAD = -1  # out[b, i] past row b's last token (the host fills `out` with it per request); never a token id
LOGIT_BIAS_SLOTS = 64  # (token id, bias) entries per row (`bias_ids`, `bias_values`): a request's logit_bias at most


@dataclass
class StepBuffers:
    """Static device buffers of one Generator (allocated once; the host only fills them).

    B is the cache's batch (rows past a request's batch are kept `done` and fed nothing), C the chunk size, L the
    long chunk size (0: no long chunks),
    N the output capacity (max_len), D the model width, E the number of EOS ids (at least 1; -1 entries match
    nothing), K the draft tokens of a speculative verify step (0 without speculation), Q the vocabulary of a draft
    model's probabilities (0 unless a draft model samples), V the vocabulary of `seen` (0: no repetition penalty,
    for callers that allocate steps without a model; it spans `counts` too), M = LOGIT_BIAS_SLOTS, P the top
    logprobs kept per token (`logprob` has N + 1 columns when logprobs are kept, else 0: static_decode.steps.logprobs).
    S and Z the grammar tables' states and token classes (0 without grammar tables: static_decode.steps.grammar).
    `out`, `hist`, `seen`, `counts` and the logprob buffers have one column more than they can fill: masked writes
    of a fixed-shape step land there (the last column), and nothing reads it.
    """

    chunk: torch.Tensor  # [B, C] int64 prompt chunk, padded with id 0 past n_new
    long_chunk: torch.Tensor  # [B, L] int64 a long prompt chunk (`prefill_long`; L = 0 when off), padded likewise
    n_new: torch.Tensor  # [B] int64 real tokens per row in `chunk`
    hidden: torch.Tensor  # [B, D] model dtype: final-normed hidden state of each row's last prompt token
    next: torch.Tensor  # [B, 1] int64 the token each row feeds at the next decode step
    done: torch.Tensor  # [B] bool the row emitted EOS (or is not part of the request)
    out: torch.Tensor  # [B, N + 1] int64 emitted tokens, PAD past each row's last (column N: trash)
    step: torch.Tensor  # [B] int64 tokens each row has emitted (the index of its next one)
    live_steps: torch.Tensor  # [B] int64 emitting steps in which the row recorded a token (tokens per step)
    limit: torch.Tensor  # [B] int64 tokens a row may emit (max_new_tokens): it is done once it has
    hist: torch.Tensor  # [B, N + 1] int64 the request's prompt then its output (column N: trash)
    plen: torch.Tensor  # [B] int64 prompt tokens of each row in `hist`
    draft: torch.Tensor  # [B, K] int64 the draft tokens a verify step checks
    draft_probs: torch.Tensor  # [B, K, Q] float32 a sampling draft model's probabilities for each draft slot
    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, <= 0 = off
    top_p: torch.Tensor  # [B] float32, >= 1 = off
    seed: torch.Tensor  # [B] int64 per-row 32-bit seed (sampling.row_seed)
    eos: torch.Tensor  # [E] int64 EOS ids, -1 = unused entry
    seen: torch.Tensor  # [B, V + 1] bool tokens fed or emitted so far (column V: trash; V = 0: no penalty kept)
    repeat_penalty: torch.Tensor  # [B] float32 the repetition penalty, 1 = off
    counts: torch.Tensor  # [B, V + 1] int32 times each token was emitted in this request (column V: trash)
    presence_penalty: torch.Tensor  # [B] float32 subtracted from the logit of every emitted token, 0 = off
    frequency_penalty: torch.Tensor  # [B] float32 subtracted once per emission of a token, 0 = off
    min_p: torch.Tensor  # [B] float32 keep tokens with probability >= min_p x the top one's, 0 = off
    bias_ids: torch.Tensor  # [B, M] int64 token ids of the logit bias entries (unused: id 0 ...)
    bias_values: torch.Tensor  # [B, M] float32 ... with bias 0, which adds nothing)
    logprob: torch.Tensor  # [B, N + 1] float32 each emitted (or prompt) token's logprob, at its column in `out`
    top_logprobs: torch.Tensor  # [B, N + 1, P] float32 the P best logprobs there, best first
    top_ids: torch.Tensor  # [B, N + 1, P] int32 ... and their token ids
    grammar_state: torch.Tensor  # [B] int64 each row's state in the grammar automaton, -1 = unconstrained
    grammar_class: torch.Tensor  # [G] int32 each token's class in the automaton (G = V with grammar tables, else 0)
    grammar_next: torch.Tensor  # [S, Z] int32 the state a class leads to, -1 = not allowed (steps.grammar)
    grammar_live: torch.Tensor  # [S] bool the state allows some token (a row reaching one that allows none ends)
    grammar_allow: torch.Tensor  # [B, G] bool the host's mask for rows under a per-step host grammar (else all True)

    @classmethod
    def allocate(
        cls,
        batch: int,
        chunk: int,
        capacity: int,
        width: int,
        eos_slots: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        draft_tokens: int = 0,
        draft_vocab: int = 0,
        long_chunk: int = 0,
        vocab: int = 0,
        logprobs: int | None = None,
        grammar: tuple[int, int] | None = None,
    ) -> StepBuffers:
        """Every buffer of `buffer_layout`, filled with its starting value."""
        layout = buffer_layout(batch, chunk, capacity, width, eos_slots, dtype=dtype, draft_tokens=draft_tokens,
                               draft_vocab=draft_vocab, long_chunk=long_chunk, vocab=vocab, logprobs=logprobs,
                               grammar=grammar)
        return cls(**{name: torch.full(shape, fill, dtype=dt, device=device)
                      for name, (shape, dt, fill) in layout.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every buffer by name (e.g. to mark them as static addresses for CUDA graphs)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def buffer_layout(
    batch: int,
    chunk: int,
    capacity: int,
    width: int,
    eos_slots: int,
    *,
    dtype: torch.dtype,
    draft_tokens: int = 0,
    draft_vocab: int = 0,
    long_chunk: int = 0,
    vocab: int = 0,
    logprobs: int | None = None,
    grammar: tuple[int, int] | None = None,
) -> dict[str, tuple[tuple[int, ...], torch.dtype, float]]:
    """name -> (shape, dtype, starting value) of every step buffer: the one table `StepBuffers.allocate` makes and
    static_decode.generation.memory counts. logprobs: the top logprobs kept per token (None: no logprobs kept)."""
    i64, f32, b = torch.int64, torch.float32, torch.bool
    cols = 0 if logprobs is None else capacity + 1  # column capacity: trash
    top = 0 if logprobs is None else logprobs
    states, classes = grammar or (0, 0)  # the grammar tables' states and token classes (None: no tables)
    g_vocab = vocab if grammar is not None else 0
    return {
        "chunk": ((batch, chunk), i64, 0),
        "long_chunk": ((batch, long_chunk), i64, 0),
        "n_new": ((batch,), i64, 0),
        "hidden": ((batch, width), dtype, 0),
        "next": ((batch, 1), i64, 0),
        "done": ((batch,), b, 0),
        "out": ((batch, capacity + 1), i64, 0),  # column capacity: trash
        "step": ((batch,), i64, 0),
        "live_steps": ((batch,), i64, 0),
        "limit": ((batch,), i64, capacity),  # no limit until a request sets one (raw step callers, warm-up)
        "hist": ((batch, capacity + 1), i64, 0),
        "plen": ((batch,), i64, 0),
        "draft": ((batch, draft_tokens), i64, 0),
        "draft_probs": ((batch, draft_tokens, draft_vocab), f32, 0),
        "temperature": ((batch,), f32, 0),
        "top_k": ((batch,), i64, 0),
        "top_p": ((batch,), f32, 0),
        "seed": ((batch,), i64, 0),
        "eos": ((max(eos_slots, 1),), i64, -1),  # at least one entry, so the EOS test has a shape
        "seen": ((batch, vocab + 1), b, 0),  # column vocab: trash
        "repeat_penalty": ((batch,), f32, 1),
        "counts": ((batch, vocab + 1), torch.int32, 0),  # column vocab: trash
        "presence_penalty": ((batch,), f32, 0),
        "frequency_penalty": ((batch,), f32, 0),
        "min_p": ((batch,), f32, 0),
        "bias_ids": ((batch, LOGIT_BIAS_SLOTS), i64, 0),
        "bias_values": ((batch, LOGIT_BIAS_SLOTS), f32, 0),
        "logprob": ((batch, cols), f32, 0),
        "top_logprobs": ((batch, cols, top), f32, 0),
        "top_ids": ((batch, cols, top), torch.int32, 0),
        "grammar_state": ((batch,), i64, -1),
        "grammar_class": ((g_vocab,), torch.int32, 0),
        "grammar_next": ((states, classes), torch.int32, -1),
        "grammar_live": ((states,), b, 0),
        "grammar_allow": ((batch, g_vocab), b, 1),
    }


def prefill_chunk(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """Run the model on `bufs.chunk`; keep each row's hidden state at its last real slot (if it has one)."""
    _prefill(model, cache, bufs, bufs.chunk, read_len)


def prefill_long(
    model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int, *, fresh: bool = False
) -> None:
    """`prefill_chunk` over `bufs.long_chunk`. Not a captured kind: the generator runs it uncompiled, where a
    chunk is long enough for its GEMMs to decide its time (Generator's `long_chunk`). fresh: every row starts
    empty and fills the chunk (the host's promise; causal attention, `Llama.hidden_states`)."""
    _prefill(model, cache, bufs, bufs.long_chunk, read_len, fresh)


def prefill_scored(
    model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int, *, targets: torch.Tensor, start: int
) -> None:
    """`prefill_chunk` that also writes each prompt token's logprob given its prefix (targets [B, C]: the prompt
    token after each slot; start: the chunk's first prompt index; static_decode.steps.logprobs.score_prompt). Not a
    captured kind: the head over every slot of the chunk decides its time, and a request asks for it rarely
    (echo, scoring), so the generator runs it uncompiled rather than compile a graph for it."""
    h = _prefill(model, cache, bufs, bufs.chunk, read_len)  # [B, C, D]
    logprobs.score_prompt(bufs, model.head(h), targets, start)


def _prefill(
    model: Llama, cache: StaticKVCache, bufs: StepBuffers, tokens: torch.Tensor, read_len: int, fresh: bool = False
) -> torch.Tensor:
    """Run the model on `tokens`, keep each row's last real hidden state; the hidden states [B, C, D]."""
    h = model.hidden_states(tokens, cache, bufs.n_new, read_len, fresh=fresh)  # [B, C, D]
    B, _, D = h.shape
    last = (bufs.n_new - 1).clamp(min=0)  # [B]
    h_last = h.gather(1, last[:, None, None].expand(B, 1, D)).squeeze(1)  # [B, D]
    bufs.hidden.copy_(torch.where(bufs.n_new[:, None] > 0, h_last, bufs.hidden))
    return h


def emit(bufs: StepBuffers, tokens: torch.Tensor, count: torch.Tensor, logits: torch.Tensor | None = None) -> None:
    """Record the first count[b] <= T of tokens [B, T] for each row b: out, hist, next, done, step, and (when the
    buffers keep them) their logprobs under the model's logits [B, T, V] at the same columns.

    count is what the step accepted (done rows: 0). A row stops early at an EOS among them or at its `limit`, so
    it may record fewer; `count` is lowered in place to what was recorded (the caller rolls the cache back by it).
    """
    B, T = tokens.shape
    N = bufs.out.shape[1] - 1  # the trash column
    t = torch.arange(T, device=tokens.device)  # [T]
    is_eos = (tokens[:, :, None] == bufs.eos[None, None, :]).any(dim=-1)  # [B, T]
    # The first EOS among the accepted tokens ends the row after it; so does the limit.
    first_eos = torch.where(is_eos & (t[None, :] < count[:, None]), t[None, :], T).amin(dim=-1)  # [B]
    n = torch.minimum(torch.minimum(count, first_eos + 1), bufs.limit - bufs.step)  # [B]
    n = torch.where(bufs.done, 0, n)
    keep = t[None, :] < n[:, None]  # [B, T]
    pos = bufs.step[:, None] + t[None, :]  # [B, T]
    # index_put_ on the whole buffer, not scatter_: inductor reinplaces the one, and turns the other into a copy of
    # the buffer, the scatter and a copy back (for `seen`, [B, V + 1] bool, ~1 ms a CPU step; cache.py likewise).
    rows = torch.arange(B, device=tokens.device)[:, None].expand(B, T)  # [B, T]
    bufs.out.index_put_((rows, torch.where(keep, pos, N)), tokens)
    bufs.hist.index_put_((rows, torch.where(keep, bufs.plen[:, None] + pos, N)), tokens)
    if logits is not None:
        logprobs.record(bufs, logits, tokens, torch.where(keep, pos, N))
    last = tokens.gather(1, (n - 1).clamp(min=0)[:, None])  # [B, 1]
    bufs.next.copy_(torch.where(n[:, None] > 0, last, bufs.next))  # done rows keep a valid id
    bufs.step.add_(n)
    bufs.live_steps.add_((n > 0).to(torch.int64))
    V = bufs.seen.shape[1] - 1  # a shape: static in a trace
    if V > 0:
        marked = torch.ones((), dtype=torch.bool, device=tokens.device)
        bufs.seen.index_put_((rows, torch.where(keep, tokens, V)), marked)
        one = torch.ones((), dtype=bufs.counts.dtype, device=tokens.device)
        bufs.counts.index_put_((rows, torch.where(keep, tokens, V)), one.expand(B, T), accumulate=True)
    ended = (is_eos & (t[None, :] < n[:, None])).any(dim=-1) | (bufs.step >= bufs.limit)  # [B]
    if grammar.active(bufs):  # a constrained row (never speculative: T = 1) moves by its token
        ended = ended | grammar.advance(bufs, tokens[:, 0], n > 0)  # [B]
    bufs.done.copy_(bufs.done | ended)
    count.copy_(n)


def _emit(bufs: StepBuffers, token: torch.Tensor, logits: torch.Tensor) -> None:
    """Record one token [B] per live row, drawn from the model's logits [B, V]."""
    emit(bufs, token[:, None], (~bufs.done).to(torch.int64), logits[:, None])


def _penalized(logits: torch.Tensor, bufs: StepBuffers) -> torch.Tensor:
    """logits [B, V] (float32 out) with each row's logit bias added, then the repetition penalty applied to its
    seen tokens and the presence / frequency penalties to its emitted ones (those two without `seen`/`counts`,
    V = 0)."""
    if grammar.active(bufs):
        logits = grammar.mask(logits, bufs)  # [B, V] tokens the row's grammar does not allow: -inf
    logits = sampling.bias(logits, bufs.bias_ids, bufs.bias_values)  # [B, V]
    if bufs.seen.shape[1] - 1 != logits.shape[-1]:
        return logits
    logits = sampling.penalize(logits, bufs.seen[:, :-1], bufs.repeat_penalty)  # [B, V]
    return sampling.penalize_counts(logits, bufs.counts[:, :-1], bufs.presence_penalty, bufs.frequency_penalty)


def _choose(logits: torch.Tensor, bufs: StepBuffers) -> torch.Tensor:
    """[B] tokens sampled from logits [B, V] (penalised); row b's draw is keyed by (seed[b], step[b])."""
    logits = _penalized(logits, bufs)
    return sampling.sample(logits, bufs.temperature, bufs.top_k, bufs.top_p, bufs.seed, bufs.step, bufs.min_p)


def sample_first(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """Emit token 0 of every row from the kept prompt hidden state (cache and read_len unused)."""
    logits = model.head(bufs.hidden)  # [B, V]
    _emit(bufs, _choose(logits, bufs), logits)


def greedy_first(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """`sample_first` for an all-greedy request."""
    logits = model.head(bufs.hidden)  # [B, V]
    _emit(bufs, sampling.greedy(_penalized(logits, bufs)), logits)


def decode_one(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """Feed each live row its next token, then sample and emit the following one."""
    n_new = (~bufs.done).to(torch.int64)  # [B] done rows append nothing
    logits = model.step(bufs.next, cache, n_new, read_len)[:, 0]  # [B, V]
    _emit(bufs, _choose(logits, bufs), logits)


def greedy_one(model: Llama, cache: StaticKVCache, bufs: StepBuffers, read_len: int) -> None:
    """`decode_one` for an all-greedy request."""
    n_new = (~bufs.done).to(torch.int64)  # [B]
    logits = model.step(bufs.next, cache, n_new, read_len)[:, 0]  # [B, V]
    _emit(bufs, sampling.greedy(_penalized(logits, bufs)), logits)


def read_rows(
    bufs: StepBuffers, stop: int, finished: np.ndarray, emitted: np.ndarray, eos: set[int], max_new: int
) -> list[list[int]]:
    """Host side: each request row's new tokens, out[b, emitted[b]:stop] with PAD stripped (rows emit at their
    own pace: a done row none, a verify step 1..K+1); updates `finished` (EOS or max_new tokens) and `emitted`."""
    lo = int(emitted.min())
    block = bufs.out[: len(finished), lo:stop].cpu().numpy()  # the one sync per read
    piece = []
    for b, row in enumerate(block):
        toks = [int(t) for t in row[emitted[b] - lo :] if t != PAD]
        if (toks and toks[-1] in eos) or emitted[b] + len(toks) >= max_new:
            finished[b] = True
        emitted[b] += len(toks)
        piece.append(toks)
    return piece


StepFn = Callable[[Llama, StaticKVCache, StepBuffers, int], None]

STEPS: dict[str, StepFn] = {
    "prefill": prefill_chunk,
    "first": sample_first,
    "first_greedy": greedy_first,
    "decode": decode_one,
    "decode_greedy": greedy_one,
}
UNBUCKETED = ("first", "first_greedy")  # kinds that read no cache: always launched with read_len 0
GREEDY_KINDS = ("prefill", "first_greedy", "decode_greedy")  # what an all-greedy request launches
SAMPLED_KINDS = ("prefill", "first", "decode")  # what a request with temperature > 0 launches


class StepRunner(Protocol):
    """What the generator asks of a runner: the read length of a step and the callable of a step kind there.

    `EagerRunner` (here) is the default; `capture.CompiledRunner` compiles the same STEPS, one graph per
    (kind, read bucket)."""

    def read_len(self, longest: int) -> int:
        """The read length of a step whose longest row (after it) holds `longest` tokens."""
        ...

    def step(self, kind: str, read_len: int) -> StepFn:
        """The callable `fn(model, cache, bufs, read_len)` that runs step `kind` at `read_len`."""
        ...


class EagerRunner:
    """The uncompiled steps (`steps`: kind -> function, default STEPS), each reading exactly the live length."""

    def __init__(self, steps: dict[str, StepFn] | None = None) -> None:
        self.steps = dict(STEPS if steps is None else steps)

    def read_len(self, longest: int) -> int:
        return longest

    def step(self, kind: str, read_len: int) -> StepFn:
        try:
            return self.steps[kind]
        except KeyError:
            raise KeyError(f"no step kind {kind!r}; the kinds are {tuple(self.steps)}") from None
