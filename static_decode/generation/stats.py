"""Timings of one generation request, as the host saw them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GenerationStats:
    """Timings of the last request (host wall clock; each ends at a read-back, so device work is included)."""

    prompt_tokens: int  # real prompt tokens over all rows
    new_tokens: int  # emitted tokens over all rows (EOS included)
    prefill_s: float  # from the request's start to the first token back on the host
    decode_s: float  # from then to the last token back on the host
    decode_steps: int  # decode steps launched (plain ones emit one token per live row, verify steps 1..K+1)
    verify_steps: int = 0  # of which speculative verify steps
    accepted_per_step: float = 0.0  # mean tokens per live row and verify step (0 without speculation)
    rows: int = 1  # request rows (the tokens of a row after its first come from decode steps)
    # decode steps in which some row still emitted; the rest ran after every row had finished, until the next
    # read-back noticed (up to read_every - 1 of them). None: every step counts.
    live_steps: int | None = None

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_s / self.decode_steps if self.decode_steps else 0.0

    @property
    def decoded_tokens(self) -> int:
        """Tokens the decode steps produced, over all rows (each row's first comes with the prefill)."""
        return max(self.new_tokens - self.rows, 0)

    @property
    def steps_used(self) -> int:
        """Decode steps that emitted tokens (all of them when unknown)."""
        return self.decode_steps if self.live_steps is None else min(self.live_steps, self.decode_steps)

    @property
    def ms_per_token(self) -> float:
        """Decode time per token of one row over the steps that emitted (a step's time when each emits one token,
        less with speculation; the steps run after every row finished are not charged to the tokens)."""
        per_row = self.decoded_tokens / self.rows if self.rows else 0
        return self.ms_per_step * self.steps_used / per_row if per_row else 0.0

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else 0.0

    def summary(self, *, load_s: float | None = None, capture_s: float | None = None) -> str:
        """One line: [load,] [capture,] prefill, ms per decoded token (the steps in brackets when they are not
        one per token), tokens/s over the request."""
        spec = (
            f", {self.verify_steps} verify steps at {self.accepted_per_step:.2f} tokens per step"
            if self.verify_steps else ""
        )
        per_row = self.decoded_tokens // self.rows if self.rows else 0
        steps = f" [{self.steps_used} steps{spec}]" if self.steps_used != per_row or spec else ""
        parts = [] if load_s is None else [f"load {load_s:.2f} s"]
        parts += [] if capture_s is None else [f"capture {capture_s:.1f} s"]
        parts += [
            f"prefill {1e3 * self.prefill_s:.1f} ms ({self.prompt_tokens} tokens)",
            f"{self.ms_per_token:.2f} ms per decoded token ({self.decoded_tokens} tokens{steps})",
            f"{self.tokens_per_s:.1f} tokens/s ({self.new_tokens} new tokens)",
        ]
        return ", ".join(parts)
