"""A multi-turn conversation that keeps its history in the generator's cache.

Each turn appends only its own tokens to what is cached, instead of prefilling the whole history again:

    conv = Conversation(gen)
    for tok in conv.send(turn1_ids, 64): ...     # prefill turn 1, decode the reply
    for tok in conv.send(turn2_ids, 64): ...     # prefill the reply's last token + turn 2 only

Row 0 of the cache carries the conversation. A turn that would not fit, or that follows another request's reset of
the cache, is refused before anything changes (docs/internals.md#conversation).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from static_decode.base.checks import check_int
from static_decode.generation.generator import Generator
from static_decode.generation.request import Request, SamplingOptions, SamplingParams, check_request

if TYPE_CHECKING:
    from typing_extensions import Unpack


class Conversation:
    """The turns of one conversation over `gen` (single row); see the module docstring."""

    def __init__(self, gen: Generator) -> None:
        if not isinstance(gen, Generator):
            raise TypeError(f"gen must be a static_decode.Generator, got {type(gen).__name__}")
        self.gen = gen
        self.history: list[int] = []  # token ids in the cache, in order
        self.pending: int | None = None  # the last emitted token: part of the conversation, not yet cached
        self.turns = 0  # turns completed
        self._epoch: int | None = None  # the generator's cache epoch the history lives in

    @property
    def tokens(self) -> list[int]:
        """The whole conversation so far: what is cached plus the last emitted token."""
        return self.history + ([] if self.pending is None else [self.pending])

    def send(
        self,
        ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        *,
        read_every: int | None = None,
        **options: Unpack[SamplingOptions],
    ) -> Iterator[int]:
        """Append `ids` (the next turn, already rendered and tokenized) and stream the reply's token ids, picked as
        `sampling` with `options` over it (Generator.generate).

        Checked now, before anything changes, and again when the returned iterator starts the turn: a request
        run on the generator in between (which resets its cache) or another turn sent meanwhile makes the turn
        refuse then, before it touches the cache, rather than append to tokens that are not the history."""
        params = SamplingParams.of(sampling, **options)
        self._checked(ids, max_new_tokens, read_every, params)
        return self._turn(ids, max_new_tokens, read_every, params, (self.turns, self._epoch))

    def _checked(
        self, ids: Sequence[int], max_new_tokens: int, read_every: int | None, params: SamplingParams
    ) -> tuple[Request, list[int], int]:
        """The turn's checked request, its fed tokens and read-back period; raises naming what is wrong."""
        gen, turn = self.gen, self.turns + 1
        if self._epoch is not None and self._epoch != gen.epoch:
            raise RuntimeError(
                f"turn {turn}: another request reset this generator's cache since turn {self.turns}, so the "
                "conversation's history is gone; start a new Conversation"
            )
        feed = ([] if self.pending is None else [self.pending]) + list(ids)
        max_new = check_int("max_new_tokens", max_new_tokens, minimum=1)
        drafts = gen.draft_slots  # a speculative verify step writes K drafts past the last token
        need = len(self.history) + len(feed) + max_new + drafts
        if need > gen.max_len:
            extra = f" + {drafts} draft slots" if drafts else ""
            raise ValueError(
                f"turn {turn} does not fit: {len(self.history)} cached + {len(feed)} new + max_new_tokens="
                f"{max_new}{extra} = {need} > max_len={gen.max_len}; nothing was sent"
            )
        req = check_request(
            feed, max_new, params, vocab_size=gen.model.config.vocab_size, max_len=gen.max_len - len(self.history),
            max_batch=None, draft_slots=drafts,
        )
        gen.check_penalty(req)
        if req.logprobs is not None or req.prompt_logprobs is not None:
            raise ValueError("logprobs and prompt_logprobs are not supported on a Conversation's turns; use "
                             "Generator.generate (or a PrefixCache) for a scored request")
        every = gen.read_every if read_every is None else check_int("read_every", read_every, minimum=1)
        return req, feed, every

    def _turn(
        self, ids: Sequence[int], max_new_tokens: int, read_every: int | None, params: SamplingParams,
        sent: tuple[int, int | None],
    ) -> Iterator[int]:
        if (self.turns, self._epoch) != sent:
            raise RuntimeError(
                f"turn {sent[0] + 1}: the conversation moved on (turn {self.turns} ran) between send() and this "
                "turn's first token; nothing was sent: send it again"
            )
        req, feed, every = self._checked(ids, max_new_tokens, read_every, params)  # the cache is still the history
        pieces = self.gen._run(req, every, keep_cache=self._epoch is not None, history=self.history)
        reply: list[int] = []
        for piece in pieces:
            reply.extend(piece[0])
            yield from piece[0]
        # Reached only when the turn ran to its end (an abandoned turn resets the cache, and the epoch with it).
        self.history += feed + reply[:-1]
        self.pending = reply[-1] if reply else None
        self._epoch = self.gen.epoch
        self.turns += 1

    def reset(self) -> None:
        """Forget the history: the next turn starts from an empty cache."""
        self.history, self.pending, self.turns, self._epoch = [], None, 0, None
