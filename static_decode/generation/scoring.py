"""The host side of a request's logprobs: each read-back's tokens as records, and the checks before a request.

The steps write every emitted token's logprob and top alternatives beside `bufs.out`
(static_decode.steps.logprobs); a request that asks for them (`SamplingParams.logprobs`) gets, at each read-back,
the records of the tokens that read-back returned, read from the same columns right after it. Prompt logprobs come
from scored prefill chunks and are read after the request's first step (the columns decode steps write next).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TypeVar

import numpy as np

from static_decode.generation.request import Request
from static_decode.steps import logprobs
from static_decode.steps.functions import StepBuffers
from static_decode.steps.logprobs import TokenLogprob

MAX_LOGPROBS = 20  # alternatives per token OpenAI's API allows (top_logprobs 0..20), and vLLM's default bound

Piece = list[list[int]] | list[list[TokenLogprob]]
R = TypeVar("R")


def check(req: Request, max_logprobs: int | None) -> None:
    """Refuse logprobs past what the generator's buffers keep (`max_logprobs`; None: none), naming the value."""
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(req, name)
        if k is None:
            continue
        if max_logprobs is None:
            raise ValueError(f"{name}={k} needs a generator that keeps logprobs: Generator(..., max_logprobs="
                             f"{max(k, 1)}) or more (None, the default, keeps none)")
        if k > max_logprobs:
            raise ValueError(f"{name}={k} exceeds this generator's max_logprobs={max_logprobs}")


def records(bufs: StepBuffers, req: Request, piece: list[list[int]], emitted: np.ndarray) -> Piece:
    """`piece` (each row's new ids, read back just now; `emitted`: each row's count after them) as records when the
    request asks for logprobs, else as it is."""
    if req.logprobs is None:
        return piece
    first = [int(emitted[b]) - len(toks) for b, toks in enumerate(piece)]
    return logprobs.read(bufs, piece, first, req.logprobs)


def prompt_records(bufs: StepBuffers, req: Request) -> list[TokenLogprob] | list[list[TokenLogprob]] | None:
    """The prompt's records (one list per row; a single prompt's list alone), or None when not asked for."""
    if req.prompt_logprobs is None:
        return None
    recs = logprobs.read_prompt(bufs, req.rows, req.prompt_logprobs)
    return recs[0] if req.single else recs


def mapped(pieces: Generator[list[list[int]], None, R], fn: Callable[[list[list[int]]], Piece]) -> Generator[
    Piece, None, R
]:
    """`pieces` with `fn` applied to each yielded piece (when it is yielded), returning what `pieces` returns (as
    `yield from` would; closed with it)."""
    try:
        while True:
            try:
                piece = next(pieces)
            except StopIteration as stop:
                return stop.value
            yield fn(piece)
    finally:
        pieces.close()
