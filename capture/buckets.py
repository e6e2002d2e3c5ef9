"""The read-length ladder: which read lengths get their own compiled graph.

The host rounds the read length it needs (rule 5) up to the next rung of a short ladder, so each (step kind, rung)
is one graph instead of one per token. `BucketLadder.geometric(max_len, align, growth)` gives rungs align, then
each `growth` times the last rounded up to `align`, ending at `max_len`; a live length L reads a rung r with

    L <= r < growth * L + align        (and r <= max_len)

More rungs read less past the live length but cost more graphs. The trade-off: docs/internals.md#buckets.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from static_decode.base.checks import check_int, is_number

DEFAULT_ALIGN = 256  # rung granularity: a multiple of the attention tile sizes, small next to real contexts
DEFAULT_GROWTH = 1.5  # worst-case read is < 1.5x the live length + align; ~16 rungs at 128k
# Where the read length is symbolic (the CPU default), one compile serves every rung and a rung costs only its
# warm-up calls, so the default ladder is finer: reads < 1.25x live + 128 (28 rungs at 128k, 10 at 2k). Measured on
# SmolLM2-135M (CPU, f32, max_len 2048): decode at context 1,024 30.9 -> 29.8 ms/token (reads 1,152 keys, not
# 1,280), a 128-token prompt 135 -> 126 ms to the first token (reads 128, not 256).
FINE_ALIGN, FINE_GROWTH = 128, 1.25
# CUDA: every rung is a CUDA graph recorded at warm-up (three calls of the step) and its own slice of the graph
# pool, also where one compile covers them all, and a Llama-3.1-8B step took ~84 s a graph with a static read
# length on an H200 (12 rungs at 32k: ~17 minutes a kind). So the CUDA default is coarse for capture time: reads
# < 1.5x live + 1024, 9 rungs at 32k, 12 at 128k (a rung of the 1k-aligned ladder is also whole blocks of every
# attention kernel's key tile). Finer ladders cost only warm-up calls with a symbolic read length: pass one.
CUDA_ALIGN, CUDA_GROWTH = 1024, 1.5


@dataclass(frozen=True)
class BucketLadder:
    """Strictly increasing read lengths; the last one is the cache capacity (`max_len`).

    lengths: the rungs, e.g. (256, 384, 768, ..., max_len). Build one with `geometric` or pass your own.
    """

    lengths: tuple[int, ...]  # strictly increasing positive ints; lengths[-1] == max_len

    def __post_init__(self) -> None:
        if isinstance(self.lengths, str | bytes) or not isinstance(self.lengths, Iterable):
            raise TypeError(f"lengths must be a sequence of ints, got {type(self.lengths).__name__}")
        lengths = tuple(check_int(f"lengths[{i}]", x, minimum=1) for i, x in enumerate(self.lengths))
        if not lengths:
            raise ValueError("lengths must hold at least one read length (the cache capacity)")
        for i in range(1, len(lengths)):
            if lengths[i] <= lengths[i - 1]:
                raise ValueError(
                    f"lengths must be strictly increasing; lengths[{i - 1}]={lengths[i - 1]} >= "
                    f"lengths[{i}]={lengths[i]} in {lengths}"
                )
        object.__setattr__(self, "lengths", lengths)

    @classmethod
    def geometric(
        cls, max_len: int, *, align: int = DEFAULT_ALIGN, growth: float = DEFAULT_GROWTH
    ) -> BucketLadder:
        """Rungs align, ceil(growth * prev / align) * align, ..., max_len (the bound: module docstring)."""
        max_len = check_int("max_len", max_len, minimum=1)
        align = check_int("align", align, minimum=1)
        if not is_number(growth) or not math.isfinite(growth):
            raise TypeError(f"growth must be a finite number, got {growth!r}")
        if growth <= 1.0:
            raise ValueError(f"growth must be > 1 (each rung longer than the last), got {growth}")
        rungs: list[int] = []
        r = align
        while r < max_len:
            rungs.append(r)
            # Round up to the alignment, and always move by at least one alignment step.
            r = max(r + align, math.ceil(growth * r / align) * align)
        rungs.append(max_len)
        return cls(tuple(rungs))

    @classmethod
    def default(cls, max_len: int) -> BucketLadder:
        """The library default: `geometric(max_len, align=256, growth=1.5)`."""
        return cls.geometric(max_len)

    @classmethod
    def fine(cls, max_len: int) -> BucketLadder:
        """The default where the read length is symbolic: `geometric(max_len, align=128, growth=1.25)`."""
        return cls.geometric(max_len, align=FINE_ALIGN, growth=FINE_GROWTH)

    @classmethod
    def cuda(cls, max_len: int) -> BucketLadder:
        """The CUDA default: `geometric(max_len, align=1024, growth=1.5)` (few rungs: each one is a CUDA graph)."""
        return cls.geometric(max_len, align=CUDA_ALIGN, growth=CUDA_GROWTH)

    @classmethod
    def of(
        cls,
        ladder: BucketLadder | Sequence[int] | None,
        max_len: int,
        *,
        fine: bool = False,
        device_type: str = "cpu",
    ) -> BucketLadder:
        """Normalise a user's choice: None -> the default (on CUDA `cuda`; elsewhere `fine` if the read length is
        symbolic), a list -> that ladder; it must end at max_len."""
        if ladder is None:
            if device_type == "cuda":
                return cls.cuda(max_len)
            return cls.fine(max_len) if fine else cls.default(max_len)
        if not isinstance(ladder, BucketLadder):
            ladder = cls(tuple(ladder))
        if ladder.max_len != max_len:
            raise ValueError(
                f"the ladder's last rung is {ladder.max_len}, the cache capacity is max_len={max_len}; "
                "the last rung must equal the capacity so that every legal length has a graph"
            )
        return ladder

    @property
    def max_len(self) -> int:
        return self.lengths[-1]

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        return iter(self.lengths)

    def bucket_for(self, length: int) -> int:
        """The smallest rung >= length (length from the host mirror: the longest row after this step)."""
        length = check_int("length", length, minimum=0)
        if length > self.max_len:
            raise ValueError(
                f"length {length} exceeds the cache capacity max_len={self.max_len} (the last rung); "
                "no graph reads that far"
            )
        return self.lengths[bisect.bisect_left(self.lengths, length)]

    def touched(self, lengths: Iterable[int]) -> tuple[int, ...]:
        """The distinct rungs that `bucket_for` picks for these lengths, ascending."""
        return tuple(sorted({self.bucket_for(n) for n in lengths}))
