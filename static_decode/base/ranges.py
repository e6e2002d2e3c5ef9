"""Named NVTX ranges for Nsight, and a no-op when the `nvtx` package is missing.

    from static_decode.base import ranges
    with ranges.range(ranges.DECODE_STEP):
        logits = step(tokens, cache, n_new, read_len)

    @ranges.range(ranges.SAMPLE)
    def sample(logits): ...

The range names, in the NVTX domain `static-decode`, are the contract with docs/gpu.md: use the constants below.
Host side only: never inside code torch.compile traces (each call would be a graph break). Without a profiler or
the package a range is one shared no-op. Where and what it costs: docs/internals.md#ranges.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

try:
    import nvtx as _nvtx
except ImportError:  # the library runs without it; ranges become no-ops
    _nvtx = None

F = TypeVar("F", bound=Callable[..., Any])

DOMAIN = "static-decode"
AVAILABLE = _nvtx is not None

# ---- the range names the library emits (docs/gpu.md refers to these) --------------------------------------
PREFILL_CHUNK = "prefill/chunk"  # one chunk of chunked prefill (one step launch)
DECODE_STEP = "decode/step"  # one decode step (one token per row)
SAMPLE = "sample"  # sampling the next token from the logits


def capture_name(kind: str, bucket: int) -> str:
    """The range around warm-up and capture of one compiled step: `capture/<kind>/<bucket>`."""
    return f"capture/{kind}/{bucket}"


def bench_name(phase: str) -> str:
    """The range around one phase of `static-decode bench`: `bench/<phase>`."""
    return f"bench/{phase}"


# Colours by the first path component, so a timeline reads at a glance. Names the nvtx package knows without
# matplotlib (it falls back to matplotlib only for other names).
COLORS = {"prefill": "green", "decode": "blue", "sample": "orange", "capture": "purple", "bench": "yellow"}


class _NullRange:
    """What `range` returns without nvtx: enter/exit do nothing; as a decorator it returns func itself."""

    __slots__ = ()

    def __enter__(self) -> _NullRange:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def __call__(self, func: F) -> F:
        return func


_NULL = _NullRange()


class NvtxRange:
    """A push/pop pair in the `static-decode` domain; a context manager and a decorator.

    Stateless between uses (the nesting lives on NVTX's per-thread stack), so one instance may be shared,
    nested and re-entered; `range` caches one per (name, color).
    """

    __slots__ = ("name", "color", "_domain", "_attributes")

    def __init__(self, name: str, color: str | int | None, domain: Any) -> None:
        self.name = name
        self.color = color
        self._domain = domain
        self._attributes = domain.get_event_attributes(message=name, color=color)

    def __enter__(self) -> NvtxRange:
        self._domain.push_range(self._attributes)
        return self

    def __exit__(self, *exc: object) -> bool:
        self._domain.pop_range()
        return False  # never swallow the exception

    def __call__(self, func: F) -> F:
        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        return inner  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"NvtxRange({self.name!r}, color={self.color!r})"


@functools.cache
def _domain() -> Any:
    """The live NVTX domain, or None when no tool is attached (nvtx then hands out a dummy domain).

    nsys/ncu inject their library at process start, so deciding once per process is right.
    """
    domain = _nvtx.get_domain(DOMAIN)
    return domain if isinstance(domain, _nvtx.Domain) else None


_CACHE: dict[tuple[str, str | int | None], NvtxRange | _NullRange] = {}


def range(name: str, color: str | int | None = None) -> NvtxRange | _NullRange:  # shadows the builtin
    """An NVTX range named `name` (context manager or decorator).

    A shared no-op object when nvtx is not installed or no profiler is attached, so an annotated call costs
    what a bare `with` costs. color: an nvtx colour name or 0xRRGGBB int; defaults by the name's first
    component (see COLORS).
    """
    try:
        cached = _CACHE.get((name, color))
    except TypeError:  # an unhashable name; refused just below
        cached = None
    if cached is not None:
        return cached
    if not isinstance(name, str) or not name:
        raise ValueError(f"range name must be a non-empty str, got {name!r}")
    domain = _domain() if _nvtx is not None else None
    if domain is None:
        made: NvtxRange | _NullRange = _NULL
    else:
        made = NvtxRange(name, COLORS.get(name.split("/", 1)[0], "blue") if color is None else color, domain)
    _CACHE[(name, color)] = made
    return made
