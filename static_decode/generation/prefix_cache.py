"""Prompt-prefix reuse across independent requests on one generator's cache (row 0).

`PrefixCache` remembers the token sequence the cache holds after each request and starts the next from the longest
common prefix with the new prompt: the cache's length is set back to the prefix (the K/V past it is masked and
overwritten) and only the rest is prefilled, always at least one token. Abandoned, refused and speculative
requests: docs/internals.md#prefix-cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from static_decode.base.checks import check_int
from static_decode.generation.generator import Generator
from static_decode.generation.request import Request, SamplingOptions, SamplingParams, check_request

if TYPE_CHECKING:
    from typing_extensions import Unpack


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class Reuse:
    """How a request starts: `cached` prompt tokens reused, `fed` prefilled."""

    cached: int
    fed: int


class PrefixCache:
    """Requests on `gen` (one row) that reuse the longest cached prefix of their prompt; see the module docstring."""

    def __init__(self, gen: Generator) -> None:
        if not isinstance(gen, Generator):
            raise TypeError(f"gen must be a static_decode.Generator, got {type(gen).__name__}")
        self.gen = gen
        self.tokens: list[int] = []  # what row 0 of the cache holds, in order
        self._epoch: int | None = None  # the generator's cache epoch `tokens` lives in

    def cached(self) -> list[int]:
        """The tokens the cache holds for the next request (empty when another request reset it)."""
        return self.tokens if self._epoch == self.gen.epoch else []

    def plan(self, prompt: Sequence[int], scored: bool = False) -> Reuse:
        """How many tokens of `prompt` the next request would reuse and prefill (nothing changes). scored: the
        request asks for prompt logprobs, which only a prefill of the whole prompt computes (nothing is reused)."""
        held = [] if scored else self.cached()
        keep = min(common_prefix(held, prompt), len(prompt) - 1)
        if self.gen.draft_cache is not None and keep < len(held):
            keep = 0  # the draft cache cannot be cut back
        return Reuse(cached=max(keep, 0), fed=len(prompt) - max(keep, 0))

    def stream(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        *,
        read_every: int | None = None,
        **options: Unpack[SamplingOptions],
    ) -> tuple[Reuse, Iterator[list[int]]]:
        """Check the request (a ValueError/TypeError naming the bad value; nothing changes), then return how it
        starts and an iterator over its new tokens, one list per read-back; tokens are picked as `sampling` with
        `options` over it (Generator.generate). The cache is cut back to the reused prefix when the iterator
        starts; if another request changed the cache in between, the iterator refuses then (RuntimeError), before
        it touches anything."""
        gen = self.gen
        params = SamplingParams.of(sampling, **options)
        prompt = list(prompt) if isinstance(prompt, Sequence) and not isinstance(prompt, str | bytes) else prompt
        check_request(  # the whole prompt, as a fresh request would be checked (bounds, ids, sampling)
            prompt, max_new_tokens, params, vocab_size=gen.model.config.vocab_size, max_len=gen.max_len,
            max_batch=1, draft_slots=gen.draft_slots,
        )
        reuse = self.plan(prompt, params.prompt_logprobs is not None)
        req = check_request(
            prompt[reuse.cached :], max_new_tokens, params, vocab_size=gen.model.config.vocab_size,
            max_len=gen.max_len - reuse.cached, max_batch=1, draft_slots=gen.draft_slots,
        )
        gen.check_penalty(req)  # the generator's own refusal (penalties, min_p, logit_bias with speculation), here
        every = gen.read_every if read_every is None else check_int("read_every", read_every, minimum=1)
        return reuse, self._run(req, every, prompt, reuse)

    def _run(self, req: Request, every: int, prompt: list[int], reuse: Reuse) -> Iterator[list[int]]:
        gen = self.gen
        if gen._busy:  # checked before the cache is touched: the open request keeps its cache
            raise RuntimeError("the generator is still running a stream: finish or close it first")
        scored = req.prompt_logprobs is not None
        if self.plan(prompt, scored) != reuse:  # another request ran on the generator since stream() planned this
            raise RuntimeError(
                f"the cache changed between stream() and this request's first token (it planned to reuse "
                f"{reuse.cached} cached tokens, {self.plan(prompt, scored).cached} are there now); nothing was run: "
                "call stream() again"
            )
        if reuse.cached:
            self._cut(reuse.cached)
            self._mark_seen(prompt[: reuse.cached])
        # prompt lookup searches the reused prefix too: a seeded request then draws what it would from nothing
        pieces = gen._run(req, every, keep_cache=reuse.cached > 0, history=prompt[: reuse.cached])
        reply: list[int] = []
        started = complete = False
        try:
            for piece in pieces:
                started = True
                reply.extend(t if isinstance(t, int) else t.token for t in piece[0])  # ids or logprob records
                yield piece[0]
            complete = True
        finally:
            if complete:
                self.tokens, self._epoch = prompt + reply[:-1], gen.epoch
            else:
                pieces.close()  # the generator resets the cache (a new epoch) and is free for the next request
                if started and gen.draft_cache is None:  # prefilled: the prompt's K/V is in place
                    self._cut(len(prompt))
                    self.tokens, self._epoch = list(prompt), gen.epoch
                else:
                    self.tokens, self._epoch = [], None

    def _cut(self, length: int) -> None:
        """Set row 0's length to `length` (at most what it holds): the host mirror and the device tensor."""
        cache = self.gen.cache
        cache.host_lens[0] = length
        cache.lens[0:1].fill_(length)

    def _mark_seen(self, ids: list[int]) -> None:
        """The repetition penalty's seen-token marks of row 0: exactly the reused tokens (the generator marks the
        fed ones; a continued request would otherwise keep the marks of the previous reply)."""
        seen = self.gen.bufs.seen  # [B, vocab + 1] bool
        seen[0].zero_()
        seen[0, torch.tensor(sorted(set(ids)), dtype=torch.int64, device=seen.device)] = True

    def reset(self) -> None:
        """Forget the cached sequence: the next request prefills its whole prompt."""
        self.tokens, self._epoch = [], None
