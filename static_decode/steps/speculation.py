"""Speculative decoding: what to speculate with, and when the host stops speculating.

`Generator(model, ..., speculate=PromptLookup(tokens=4, ngram=3))` or `speculate=DraftModel(small, tokens=4)`:
each verify step feeds the row's next token plus K draft tokens as one fixed-shape chunk of K + 1 slots, and
accepts on the device the longest prefix the target model agrees with, plus the model's own next token (the
step functions are in static_decode.steps.verify). Greedy output is token for token what plain decode returns;
sampled output keeps the target distribution (the speculative rejection rule). Rejected K/V stay in the cache
past the row's length, masked, and are overwritten by later steps: a rollback is only a lower device length.
`SpeculationPolicy` pauses speculation while verify steps yield too few tokens, deciding from token counts only so
seeded requests reproduce (docs/internals.md#speculation).
"""

from __future__ import annotations

from dataclasses import dataclass

from static_decode.base.checks import check_int, is_number
from static_decode.model.llama import Llama

DEFAULT_TOKENS = 4  # draft tokens per verify step
DEFAULT_NGRAM = 3  # prompt lookup: the suffix matched against the earlier text
# Below this many tokens per verify step (mean over the live rows since the last read-back), plain decode is
# cheaper: a K + 1 slot step costs about this much more than a 1-slot step on the CPU (profiles/RESULTS.md,
# "Speculative decoding"). GPU users, where a 5-slot step costs about a 1-slot step, can lower it towards 1.
DEFAULT_MIN_TOKENS_PER_STEP = 1.3
DEFAULT_PAUSE_STEPS = 32  # plain steps before speculation is tried again


def _check_policy(tokens: object, min_tokens_per_step: object, pause_steps: object) -> None:
    check_int("tokens", tokens, minimum=1)
    check_int("pause_steps", pause_steps, minimum=1)
    if not is_number(min_tokens_per_step):
        raise TypeError(f"min_tokens_per_step must be a number, got {type(min_tokens_per_step).__name__}")
    if not 0 <= min_tokens_per_step <= tokens + 1:
        raise ValueError(
            f"min_tokens_per_step={min_tokens_per_step} must lie in 0..tokens + 1 = {tokens + 1} "
            "(0: never fall back to plain decode)"
        )


@dataclass(frozen=True)
class PromptLookup:
    """Draft the `tokens` that followed the most recent earlier occurrence of the last `ngram` tokens of
    prompt + output (searched on the device each step). Pays on input-grounded output: edits, quotes, code.

    skip_unmatched: the host reads the tokens back after every step and launches a plain decode step instead of
    a verify step when no live row's last n-gram occurred before (a verify step would then yield one token at
    the price of K + 1 slots). None: on the CPU only, where that read-back costs nothing (a CPU step has run
    when its call returns) and a 5-slot step costs ~1.6x a 1-slot one; on a GPU every step stays a verify step
    (about the price of a plain one) and reads stay batched.
    """

    tokens: int = DEFAULT_TOKENS
    ngram: int = DEFAULT_NGRAM
    min_tokens_per_step: float = DEFAULT_MIN_TOKENS_PER_STEP
    pause_steps: int = DEFAULT_PAUSE_STEPS
    skip_unmatched: bool | None = None

    def __post_init__(self) -> None:
        _check_policy(self.tokens, self.min_tokens_per_step, self.pause_steps)
        check_int("ngram", self.ngram, minimum=1)
        if self.skip_unmatched is not None and not isinstance(self.skip_unmatched, bool):
            raise TypeError(f"skip_unmatched must be a bool or None, got {self.skip_unmatched!r}")


@dataclass(frozen=True)
class DraftModel:
    """Draft `tokens` with a smaller model of the same vocabulary, run on its own static cache and steps (its
    cache follows the target's lengths, so both roll back alike)."""

    model: Llama
    tokens: int = DEFAULT_TOKENS
    min_tokens_per_step: float = DEFAULT_MIN_TOKENS_PER_STEP
    pause_steps: int = DEFAULT_PAUSE_STEPS

    def __post_init__(self) -> None:
        if not isinstance(self.model, Llama):
            raise TypeError(f"DraftModel.model must be a static_decode.Llama, got {type(self.model).__name__}")
        _check_policy(self.tokens, self.min_tokens_per_step, self.pause_steps)

    def check_target(self, target: Llama) -> None:
        """Refuse a draft the target cannot verify: another vocabulary, device, or a sharded model."""
        dv, tv = self.model.config.vocab_size, target.config.vocab_size
        if dv != tv:
            raise ValueError(f"the draft model's vocabulary ({dv}) differs from the target's ({tv}); they must match")
        if self.model.device != target.device:
            raise ValueError(f"the draft model is on {self.model.device}, the target on {target.device}")
        if self.model.tp.enabled:
            raise ValueError("the draft model must not be tensor-parallel")


Speculation = PromptLookup | DraftModel


class NgramIndex:
    """The host's copy of one row's text for `PromptLookup.skip_unmatched`: whether the last n tokens occurred
    earlier with a token after them (the device lookup's rule), in O(n) per token."""

    def __init__(self, ngram: int, tokens: list[int]) -> None:
        self.n = ngram
        self.tokens: list[int] = []
        self.seen: set[tuple[int, ...]] = set()  # every n-gram that has a token after it
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        n = self.n
        for t in tokens:
            self.tokens.append(t)
            if len(self.tokens) > n:
                self.seen.add(tuple(self.tokens[-n - 1 : -1]))

    def matched(self) -> bool:
        return len(self.tokens) >= self.n and tuple(self.tokens[-self.n :]) in self.seen


class SpeculationPolicy:
    """The host's choice between verify steps and plain decode steps, from read-back token counts only.

    Speculate until `window` live row-steps of verify yield fewer than `min_tokens_per_step` tokens per row and
    step; then run `pause_steps` plain steps; then try again.
    """

    def __init__(self, spec: Speculation, window: int = 16) -> None:
        self.spec = spec
        self.window = check_int("window", window, minimum=1)
        self.plain_left = 0  # plain steps still to run before speculating again
        self.verify_steps = 0  # verify steps launched
        self.verify_row_steps = 0  # (row, verify step) pairs where the row was live
        self.verify_tokens = 0  # tokens those emitted
        self._tokens, self._row_steps = 0, 0  # the window being filled

    def speculate(self) -> bool:
        """Whether the next step is a verify step."""
        return self.plain_left == 0

    def ran_plain(self, steps: int) -> None:
        self.plain_left = max(0, self.plain_left - steps)

    def observe(self, tokens: int, row_steps: int) -> None:
        """The verify steps since the last read-back emitted `tokens` over `row_steps` live row-steps."""
        self.verify_tokens += tokens
        self.verify_row_steps += row_steps
        self._tokens += tokens
        self._row_steps += row_steps
        if self._row_steps >= self.window:
            if self._tokens < self.spec.min_tokens_per_step * self._row_steps:
                self.plain_left = self.spec.pause_steps
            self._tokens, self._row_steps = 0, 0

    @property
    def accepted_per_step(self) -> float:
        """Mean tokens per live row and verify step (>= 1 when any ran; 0 when none did)."""
        return self.verify_tokens / self.verify_row_steps if self.verify_row_steps else 0.0
