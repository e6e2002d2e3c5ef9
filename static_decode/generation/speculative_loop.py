"""The host loop of a speculative request: verify steps (plain ones while the policy pauses), read-backs, bounds.

Called by `Generator` after the first token of a request whose generator has `speculate` set; the step functions
are in static_decode.steps.verify, what to speculate with and when to pause in static_decode.steps.speculation.
"""

from __future__ import annotations

from collections.abc import Generator as Coroutine
from typing import Protocol

import numpy as np
import torch

from static_decode.base import ranges
from static_decode.core.cache import StaticKVCache
from static_decode.generation.request import Request
from static_decode.model.llama import Llama
from static_decode.steps.functions import StepBuffers, StepFn, read_rows
from static_decode.steps.speculation import NgramIndex, PromptLookup, Speculation, SpeculationPolicy


class Host(Protocol):
    """What the loop uses of a `Generator` (a protocol: this module is imported by the generator's)."""

    model: Llama
    cache: StaticKVCache
    bufs: StepBuffers
    draft_cache: StaticKVCache | None
    speculate: Speculation
    max_len: int

    def read_len(self, longest: int) -> int: ...

    def step_fn(self, kind: str, read_len: int) -> StepFn: ...


def decode_speculative(
    gen: Host,
    req: Request,
    every: int,
    policy: SpeculationPolicy,
    finished: np.ndarray,
    emitted: np.ndarray,
    eos: set[int],
    history: list[int] | None = None,
) -> Coroutine[list[list[int]], None, int]:
    """Decode with verify steps (plain steps while the policy pauses speculation); yield each read-back.

    The host does not know how many tokens a verify step accepted until it reads back, so it keeps per row an upper
    bound of the length (each verify step adds at most K + 1, a plain one 1; never past prompt + max_new_tokens - 1)
    for the read length (a finished row's exact length counts too), and a lower bound of the emitted tokens (at
    least 1 per step for a live row) to stop once every row must be finished. A read-back (every `every` steps, at a
    lower bound reaching max_new_tokens, and at each change between verify and plain steps, so a window's tokens
    belong to one kind) makes both exact again. With `PromptLookup.skip_unmatched` (the CPU default) the host reads
    back after every step and keeps each row's text in an `NgramIndex`, launching a plain step when no live row's
    last n-gram occurred before; row 0's index starts with `history`, the tokens its kept cache already held.
    Returns the steps launched.
    """
    cache, bufs, model, R, max_new = gen.cache, gen.bufs, gen.model, len(req.rows), req.max_new_tokens
    K = gen.speculate.tokens
    draft = gen.draft_cache is not None
    verify = "verify_greedy" if req.greedy else "verify"
    plain = "decode_greedy" if req.greedy else "decode"
    draft_kind = "draft_greedy" if req.greedy else "draft"
    start = cache.host_lens[:R] - 1  # a row's device length is start + emitted (its last token is not fed)
    cap = cache.host_lens[:R] + max_new - 1  # ... and never more than this
    live_before = bufs.live_steps[:R].cpu().numpy().copy()  # at the last read-back (the first token's step counted)
    total = 0
    decode_range = ranges.range(ranges.DECODE_STEP, ranges.COLORS["decode"])
    spec = gen.speculate
    skip = isinstance(spec, PromptLookup) and (
        spec.skip_unmatched if spec.skip_unmatched is not None else cache.device.type == "cpu"
    )
    index = None
    if skip:  # the host's copy of each row's text: read back after every step (free on the CPU)
        every = 1
        tail = bufs.out[:R, 0].cpu().tolist()  # token 0 of each row (read already: no new sync on the CPU)
        before = [history or [], *([[]] * (R - 1))]
        index = [NgramIndex(spec.ngram, [*before[b], *row, tail[b]]) for b, row in enumerate(req.rows)]
    while not finished.all():
        speculating = policy.speculate()
        if index is not None and speculating:
            speculating = any(index[b].matched() for b in range(R) if not finished[b])
        width = K + 1 if speculating else 1  # tokens a step may add per row
        lens = start + emitted  # [R] exact at the read-back
        left = ~finished
        steps = 0
        while steps < every and not (emitted[left] + steps >= max_new).all():
            # every row's length, a finished one's too (exact: it feeds nothing): each formulation reads up to
            # read_len and the CPU kernel refuses a row longer than that
            longest = int(np.where(left, np.minimum(lens + steps * width, cap), lens).max())
            read_len = gen.read_len(min(longest + width, gen.max_len))
            with torch.no_grad(), decode_range:
                if speculating:
                    if draft:
                        gen.step_fn(draft_kind, read_len)(model, cache, bufs, read_len)
                    gen.step_fn(verify, read_len)(model, cache, bufs, read_len)
                else:
                    if draft:
                        gen.step_fn("draft_follow", read_len)(model, cache, bufs, read_len)
                    gen.step_fn(plain, read_len)(model, cache, bufs, read_len)
            steps += 1
        total += steps
        before = emitted.copy()
        piece = read_rows(bufs, min(max_new, int(emitted.max()) + steps * width), finished, emitted, eos, max_new)
        live_now = bufs.live_steps[:R].cpu().numpy().copy()  # on the CPU .cpu() is the buffer itself
        if speculating:
            policy.verify_steps += steps
            policy.observe(int((emitted - before).sum()), int((live_now - live_before).sum()))
        else:
            policy.ran_plain(steps)
        live_before = live_now
        if index is not None:
            for b, toks in enumerate(piece):
                index[b].extend(toks)
        yield piece
    return total
