"""One generation request, checked on the host before anything changes (a refused request leaves the
generator exactly as it was)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import numpy as np

from static_decode.base.checks import check_int, is_number

# The sampling buffer holds float32: a smaller positive temperature would round to 0 there and silently run greedy.
TINIEST_TEMPERATURE = float(np.finfo(np.float32).tiny)


class SamplingOptions(TypedDict, total=False):
    """SamplingParams' fields as keyword arguments (`generate(prompt, n, temperature=0.7, seed=1)`)."""

    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    stop_at_eos: bool
    repeat_penalty: float | None


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens, checked once when made (a ValueError/TypeError naming the bad value).

    temperature 0 is greedy; otherwise the draw is on the device (top_k / top_p optional, in transformers' order),
    reproducible when `seed` is given. A row stops after it emits an EOS id (included) when stop_at_eos.
    repeat_penalty (> 0; None or 1 = off) penalises every token the row has fed or emitted
    (static_decode.steps.sampling.penalize). top_k past the vocabulary keeps every token."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_at_eos: bool = True
    repeat_penalty: float | None = None

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
        for name, value in (("temperature", float(t)), ("top_k", top_k), ("seed", seed),
                            ("top_p", None if top_p is None else float(top_p)),
                            ("repeat_penalty", None if penalty is None else float(penalty)),
                            ("stop_at_eos", bool(self.stop_at_eos))):
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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
    return Request(
        rows=[[int(t) for t in r] for r in rows], single=single, max_new_tokens=max_new,
        temperature=p.temperature, top_k=None if p.top_k is None else min(p.top_k, vocab_size), top_p=p.top_p,
        seed=p.seed, stop_at_eos=p.stop_at_eos, repeat_penalty=1.0 if p.repeat_penalty is None else p.repeat_penalty,
    )
