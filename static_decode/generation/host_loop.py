"""The host loop of one request on a Generator: prefill in chunks, the first token, then decode steps launched
back to back with a read-back of the emitted tokens every `every` steps (the one sync of decode), and the request's
stats. The Generator owns the cache, the buffers and the runner; speculation's loop is speculative_loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from static_decode.base import ranges
from static_decode.core.cache import StaticKVCache
from static_decode.generation import scoring
from static_decode.generation.request import Request
from static_decode.generation.speculative_loop import decode_speculative
from static_decode.generation.stats import GenerationStats
from static_decode.model.llama import Llama
from static_decode.steps.functions import StepBuffers, StepFn, logprobs, prefill_long, prefill_scored, read_rows
from static_decode.steps.speculation import Speculation, SpeculationPolicy


class Generator(Protocol):
    """What the loop uses of a `Generator` (a protocol: this module is imported by the generator's)."""

    model: Llama
    cache: StaticKVCache
    bufs: StepBuffers
    draft_cache: StaticKVCache | None
    speculate: Speculation | None
    max_len: int
    chunk_size: int
    long_chunk: int
    eos_token_ids: tuple[int, ...]
    epoch: int
    stats: GenerationStats | None
    prompt_logprobs: Any
    _constraint: Any

    def read_len(self, longest: int) -> int: ...

    def step_fn(self, kind: str, read_len: int) -> StepFn: ...

    def _prepare(self, req: Request, keep_cache: bool = False, history: Sequence[int] = ()) -> list[int]: ...


def prefill(gen: Generator, rows: list[list[int]], score: bool = False) -> None:
    """Feed the prompts in chunks (the last padded); rows run out at their length. While the longest row has
    `long_chunk` tokens left, a long chunk runs uncompiled at the exact live read length (see
    DEFAULT_LONG_CHUNK); the rest goes in chunk_size chunks through the runner (compiled, captured). score:
    every chunk is a chunk_size `prefill_scored` (uncompiled), which keeps each prompt token's logprob."""
    cache, bufs = gen.cache, gen.bufs
    lens = np.array([len(r) for r in rows] + [0] * (cache.batch - len(rows)), dtype=np.int64)
    start, longest = 0, int(lens.max())
    while start < longest:
        long = not score and gen.long_chunk > 0 and longest - start >= gen.long_chunk
        C = gen.long_chunk if long else gen.chunk_size
        n = np.clip(lens - start, 0, C)
        chunk = np.zeros((cache.batch, C), dtype=np.int64)
        for b, row in enumerate(rows):
            chunk[b, : n[b]] = row[start : start + n[b]]
        n = cache.validate(n, C)
        (bufs.long_chunk if long else bufs.chunk).copy_(torch.from_numpy(chunk))
        bufs.n_new.copy_(torch.from_numpy(n))
        longest_after = int((cache.host_lens + n).max())
        with ranges.range(ranges.PREFILL_CHUNK, ranges.COLORS["prefill"]):
            if long:  # (the caller holds no_grad)
                fresh = bool((cache.host_lens == 0).all() and (n == C).all())  # causal SDPA, no mask
                prefill_long(gen.model, cache, bufs, longest_after, fresh=fresh)
            elif score:
                targets = logprobs.prompt_targets(rows, start, C, cache.batch)  # [B, C]
                prefill_scored(gen.model, cache, bufs, longest_after,
                               targets=torch.from_numpy(targets).to(cache.device), start=start)
                if gen.draft_cache is not None:
                    read_len = gen.read_len(longest_after)
                    gen.step_fn("draft_prefill", read_len)(gen.model, cache, bufs, read_len)
            else:
                read_len = gen.read_len(longest_after)
                gen.step_fn("prefill", read_len)(gen.model, cache, bufs, read_len)
                if gen.draft_cache is not None:
                    gen.step_fn("draft_prefill", read_len)(gen.model, cache, bufs, read_len)
        cache.commit(n)
        start += C


def run(
    gen: Generator, req: Request, every: int, keep_cache: bool, history: Sequence[int]
) -> Iterator[list[list[int]]]:
    """One checked request on `gen` (Generator._run holds its busy flag): prepare, prefill, the first token, then
    decode steps (or speculation's loop) with a read-back every `every` steps, yielding each read-back as records
    (ids, or TokenLogprob records) per row; the stats when done; on failure or abandon, an empty cache."""
    history = gen._prepare(req, keep_cache, history)  # may allocate and capture: untimed
    constraint = gen._constraint
    if constraint is not None and constraint.path == "host":
        every = 1  # the host writes each step's mask from the token before it
    gen.prompt_logprobs = None
    t0 = time.perf_counter()
    cache, bufs, model, R, max_new = gen.cache, gen.bufs, gen.model, len(req.rows), req.max_new_tokens
    eos = set(gen.eos_token_ids) if req.stop_at_eos else set()
    emitted = np.zeros(R, dtype=np.int64)
    finished = np.zeros(R, dtype=bool)
    complete = False
    # NVTX ranges wrap each launch on the host (never inside a compiled step). Decode samples inside its step,
    # so "sample" marks only the separate first-token launch.
    sample_range = ranges.range(ranges.SAMPLE, ranges.COLORS["sample"])
    decode_range = ranges.range(ranges.DECODE_STEP, ranges.COLORS["decode"])
    try:
        # Grad mode is set per launch, never held across a yield (it is thread-global state of the caller).
        with torch.no_grad():
            prefill(gen, req.rows, score=req.prompt_logprobs is not None)
            with sample_range:
                gen.step_fn("first_greedy" if req.greedy else "first", 0)(model, cache, bufs, 0)
        gen.prompt_logprobs = scoring.prompt_records(bufs, req)  # before a decode step writes their columns
        if gen.speculate is not None:
            piece = read_rows(bufs, 1, finished, emitted, eos, max_new)
            t1 = time.perf_counter()
            yield scoring.records(bufs, req, piece, emitted)
            policy = SpeculationPolicy(gen.speculate)
            steps = yield from scoring.mapped(
                decode_speculative(gen, req, every, policy, finished, emitted, eos, history),
                lambda piece: scoring.records(bufs, req, piece, emitted),
            )
        else:
            steps = 0
            longest = int(cache.host_lens.max())  # exact now; an upper bound from here on
            kind = "decode_greedy" if req.greedy else "decode"
            while True:
                if steps + 1 == max_new or steps % every == 0:
                    piece = read_rows(bufs, steps + 1, finished, emitted, eos, max_new)
                    if constraint is not None:
                        constraint.update(bufs, piece, finished)
                    if steps == 0:
                        t1 = time.perf_counter()
                    yield scoring.records(bufs, req, piece, emitted)
                    if steps + 1 == max_new or finished.all():
                        break
                steps += 1
                read_len = gen.read_len(longest + steps)
                with torch.no_grad(), decode_range:
                    gen.step_fn(kind, read_len)(model, cache, bufs, read_len)
            policy = None
        t2 = time.perf_counter()
        # Each emitted token except a row's last was fed back: that is how far the device lengths moved.
        cache.commit(np.concatenate([emitted - 1, np.zeros(cache.batch - R, dtype=np.int64)]))
        complete = True
        # Steps that still emitted for some row (the first token's step aside); read after the clock stopped.
        live = int(bufs.live_steps[:R].max()) - 1
        gen.stats = GenerationStats(
            prompt_tokens=req.prompt_tokens, new_tokens=int(emitted.sum()), prefill_s=t1 - t0,
            decode_s=t2 - t1, decode_steps=steps, verify_steps=0 if policy is None else policy.verify_steps,
            accepted_per_step=0.0 if policy is None else policy.accepted_per_step, rows=R, live_steps=live,
        )
    finally:
        if not complete:  # abandoned or failed: leave a consistent, empty cache
            cache.reset()
            gen.epoch += 1
