"""One generation request, checked on the host before anything changes (a refused request leaves the
generator exactly as it was)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from static_decode.base.checks import check_int, is_number
from static_decode.generation.structured import Grammar
from static_decode.steps.functions import LOGIT_BIAS_SLOTS

# The sampling buffer holds float32: a smaller positive temperature would round to 0 there and silently run greedy.
TINIEST_TEMPERATURE = float(np.finfo(np.float32).tiny)
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as OpenAI's API bounds them
BIAS_RANGE = (-100.0, 100.0)  # a logit_bias value, as OpenAI's API bounds it

LogitBias = tuple[tuple[int, float], ...]  # (token id, bias) pairs, ids ascending and distinct


class SamplingOptions(TypedDict, total=False):
    """SamplingParams' fields as keyword arguments (`generate(prompt, n, temperature=0.7, seed=1)`)."""

    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    stop_at_eos: bool
    repeat_penalty: float | None
    min_p: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] | None
    logprobs: int | None
    prompt_logprobs: int | None
    grammar: Grammar | None


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens, checked once when made (a ValueError/TypeError naming the bad value).

    temperature 0 is greedy; otherwise the draw is on the device (top_k / top_p optional, in transformers' order),
    reproducible when `seed` is given. A row stops after it emits an EOS id (included) when stop_at_eos.
    repeat_penalty (> 0; None or 1 = off) penalises every token the row has fed or emitted
    (static_decode.steps.sampling.penalize). top_k past the vocabulary keeps every token.

    min_p (in [0, 1]; None or 0 = off) keeps the tokens whose probability after temperature is at least min_p times
    the top token's, before top_k and top_p (vLLM's order). presence_penalty and frequency_penalty (in [-2, 2] as
    OpenAI's API; None or 0 = off) subtract presence * (count > 0) + frequency * count from each token's logit,
    count being how often the row emitted it in this request (OpenAI's definition, over the sampled tokens; vLLM
    likewise counts output tokens only: the prompt is not counted). logit_bias: up to LOGIT_BIAS_SLOTS (64) token
    id -> bias entries (a mapping or (id, bias) pairs; ids distinct ints >= 0, checked against the vocabulary by the
    request; biases in [-100, 100]) added to the logits before everything else, greedy rows included (OpenAI's: -100
    all but bans a token); kept as (id, bias) pairs in id order, without the entries of bias 0. The bias, then
    repeat_penalty, then the presence and frequency penalties apply to greedy and sampled rows alike (vLLM's and
    llama.cpp's order).

    logprobs (an int >= 0; None = off, vLLM's name): return each emitted token with its logprob and the `logprobs`
    best alternatives (static_decode.steps.logprobs.TokenLogprob) instead of its bare id; prompt_logprobs likewise
    for every prompt token given its prefix (Generator.prompt_logprobs). Both are of the model's own distribution,
    log_softmax of its logits before the bias, penalties, temperature and filters (vLLM's default); at most the
    generator's `max_logprobs` alternatives.

    grammar (a static_decode.generation.structured.Grammar: `Grammar.json_schema(schema, tokenizer)` or
    `Grammar.json_object(tokenizer)`; None = free text): every token is one the grammar allows, and EOS only where
    the text is complete; a row ends when its text can go no further. Compiled once, reused across requests."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_at_eos: bool = True
    repeat_penalty: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | LogitBias | None = None  # kept as LogitBias
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        t, top_k, top_p, seed, penalty = self.temperature, self.top_k, self.top_p, self.seed, self.repeat_penalty
        if not is_number(t) or not (t == 0 or TINIEST_TEMPERATURE <= t < 1e30):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number in [{TINIEST_TEMPERATURE}, 1e30), "
                             f"got {t!r}")
        if top_k is not None:
            top_k = check_int("top_k", top_k, minimum=1)
        if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if seed is not None:
            seed = check_int("seed", seed, minimum=0)
        if penalty is not None and (not is_number(penalty) or not 0 < penalty < 1e30):
            raise ValueError(f"repeat_penalty must be a finite number > 0 (1 = off), got {penalty!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise TypeError(f"grammar must be a static_decode.generation.structured.Grammar, got "
                            f"{type(self.grammar).__name__}")
        min_p = self.min_p
        if min_p is not None and (not is_number(min_p) or not 0 <= min_p <= 1):
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {min_p!r}")
        counted = {}
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            lo, hi = PENALTY_RANGE
            if v is not None and (not is_number(v) or not lo <= v <= hi):
                raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}] (0 = off), got {v!r}")
            counted[name] = None if v is None else float(v)
        scored = {name: None if getattr(self, name) is None else check_int(name, getattr(self, name), minimum=0)
                  for name in ("logprobs", "prompt_logprobs")}
        for name, value in (("temperature", float(t)), ("top_k", top_k), ("seed", seed), *scored.items(),
                            ("top_p", None if top_p is None else float(top_p)),
                            ("repeat_penalty", None if penalty is None else float(penalty)),
                            ("stop_at_eos", bool(self.stop_at_eos)),
                            ("min_p", None if min_p is None else float(min_p)), *counted.items(),
                            ("logit_bias", None if self.logit_bias is None else _logit_bias(self.logit_bias))):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, sampling: SamplingParams | None = None, **options: object) -> SamplingParams:
        """`sampling` (default: greedy) with `options`, SamplingParams' fields by name, over it; another name is a
        TypeError naming it."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unexpected sampling option {unknown[0]!r}; the options are "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        if not options:
            return sampling or cls()
        return dataclasses.replace(sampling or cls(), **options)


def _logit_bias(value: object) -> LogitBias:
    """A logit_bias mapping or sequence of (id, bias) pairs as checked pairs in id order; raises naming the bad
    entry."""
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Iterable) and not isinstance(value, str | bytes):
        pairs = list(value)
    else:
        raise TypeError(f"logit_bias must be a mapping of token id -> bias (or (id, bias) pairs), got "
                        f"{type(value).__name__}: {value!r}")
    if len(pairs) > LOGIT_BIAS_SLOTS:
        raise ValueError(f"logit_bias has {len(pairs)} entries; at most {LOGIT_BIAS_SLOTS} are kept per request")
    out: dict[int, float] = {}
    lo, hi = BIAS_RANGE
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise TypeError(f"logit_bias entries must be (token id, bias) pairs, got {pair!r}")
        tid, b = pair
        tid = check_int("a logit_bias token id", tid, minimum=0)
        if not is_number(b) or not math.isfinite(b) or not lo <= b <= hi:
            raise ValueError(f"logit_bias[{tid}] must be a number in [{lo:g}, {hi:g}], got {b!r}")
        if tid in out:
            raise ValueError(f"logit_bias gives token id {tid} twice")
        out[tid] = float(b)
    return tuple(sorted((t, b) for t, b in out.items() if b != 0))  # a bias of 0 adds nothing: not kept


@dataclass(frozen=True)
class Request:
    """A checked request: the prompt rows and how to pick tokens."""

    rows: list[list[int]]  # one list of prompt ids per row (a single prompt is one row)
    single: bool  # the caller passed one prompt (a flat list), so it gets one list of ids back
    max_new_tokens: int
    temperature: float  # 0 = greedy
    top_k: int | None
    top_p: float | None
    seed: int | None
    stop_at_eos: bool
    repeat_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0  # 0 = off
    frequency_penalty: float = 0.0  # 0 = off
    logit_bias: LogitBias = ()  # (token id, bias) pairs, ids in the vocabulary
    logprobs: int | None = None  # alternatives per emitted token's record (None: ids, no records)
    prompt_logprobs: int | None = None  # alternatives per prompt token's record (None: none scored)
    grammar: Grammar | None = None  # the structured-output constraint (None: free text)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def samplers_on(self) -> list[str]:
        """The samplers this request sets to something other than off, as `name=value` (e.g. for a refusal)."""
        on = [(name, v) for name, v, off in (
            ("repeat_penalty", self.repeat_penalty, 1.0), ("min_p", self.min_p, 0.0),
            ("presence_penalty", self.presence_penalty, 0.0), ("frequency_penalty", self.frequency_penalty, 0.0),
            ("logit_bias", dict(self.logit_bias), {})) if v != off]
        return [f"{name}={v}" for name, v in on]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r) for r in self.rows)


def _is_id(t: object) -> bool:
    return isinstance(t, int | np.integer) and not isinstance(t, bool)


def check_request(
    prompt: object,
    max_new_tokens: object,
    sampling: SamplingParams | None = None,
    *,
    vocab_size: int,
    max_len: int,
    max_batch: int | None = None,
    draft_slots: int = 0,
    **options: object,
) -> Request:
    """The checked request, or a ValueError/TypeError naming the bad value (rows: at most `max_batch`); how it
    samples is `sampling` with `options` over it (SamplingParams.of).

    draft_slots: the draft tokens of a speculative verify step, which writes them past the row's length (so
    prompt + max_new_tokens + draft_slots must fit in max_len)."""
    if not isinstance(prompt, Sequence | np.ndarray) or isinstance(prompt, str | bytes | bytearray) or not len(prompt):
        raise ValueError(f"prompt must be a non-empty list of token ids or of such lists, got {prompt!r}")
    single = all(_is_id(t) for t in prompt)
    rows = [list(prompt)] if single else [list(p) if isinstance(p, Sequence | np.ndarray) else p for p in prompt]
    max_new = check_int("max_new_tokens", max_new_tokens, minimum=1)
    for b, row in enumerate(rows):
        if not isinstance(row, list) or not row:
            raise ValueError(f"prompt row {b} must be a non-empty list of token ids, got {row!r}")
        for t in row:
            if not _is_id(t) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt row {b} holds {t!r}; token ids must be ints in 0..{vocab_size - 1}")
        if len(row) + max_new + draft_slots > max_len:
            drafts = f" and {draft_slots} draft slots of speculation" if draft_slots else ""
            raise ValueError(
                f"prompt row {b} has {len(row)} tokens; with max_new_tokens={max_new}{drafts} that needs "
                f"{len(row) + max_new + draft_slots} > max_len={max_len} positions"
            )
    if max_batch is not None and len(rows) > max_batch:
        raise ValueError(f"the request has {len(rows)} rows, this generator was built for batch={max_batch}")
    p = SamplingParams.of(sampling, **options)
    for tid, _ in p.logit_bias or ():
        if tid >= vocab_size:
            raise ValueError(f"logit_bias names token id {tid}; token ids must be in 0..{vocab_size - 1}")
    if p.grammar is not None and p.grammar.vocab_size != vocab_size:
        raise ValueError(f"the grammar was compiled for a vocabulary of {p.grammar.vocab_size} tokens, the model has "
                         f"{vocab_size} (Grammar.json_schema(..., vocab_size={vocab_size}))")
    return Request(
        rows=[[int(t) for t in r] for r in rows], single=single, max_new_tokens=max_new,
        temperature=p.temperature, top_k=None if p.top_k is None else min(p.top_k, vocab_size), top_p=p.top_p,
        seed=p.seed, stop_at_eos=p.stop_at_eos, repeat_penalty=1.0 if p.repeat_penalty is None else p.repeat_penalty,
        min_p=p.min_p or 0.0, presence_penalty=p.presence_penalty or 0.0, frequency_penalty=p.frequency_penalty or 0.0,
        logit_bias=p.logit_bias or (), logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs,
        grammar=p.grammar,
    )
