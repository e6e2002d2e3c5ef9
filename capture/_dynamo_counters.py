"""The one place static-decode touches private torch.compile internals.

Dynamo and inductor count what they do in `torch._dynamo.utils.counters` (a dict of Counters) and a few
module globals. None of it is public API, and names have moved between releases (the recompile limit was
`cache_size_limit` up to torch 2.6 and is `recompile_limit` since 2.7, with the old name kept as an alias for
a while). Everything that reads or sets those lives here, each read guarded so that a missing name degrades
to "unknown" (None) instead of an AttributeError, for torch 2.5 up to 2.15. `capture.guards` is the public,
documented face of this module.

What is read:

* graphs compiled: counters["stats"]["unique_graphs"] (one per FX graph dynamo hands to the backend);
* graph breaks: counters["graph_break"] (reason -> count);
* recompiles: convert_frame.FRAME_COMPILE_COUNTER (frame id -> compiles of that frame); every compile of a
  frame after its first is a recompile (a guard failed: a new shape, a new Python int, ...);
* cudagraph skips: counters["inductor"]["cudagraph_skips"] (reduce-overhead fell back to no CUDA graph).

`torch._dynamo.reset()` clears the frame counters but not `counters`, so callers take differences of
snapshots and clamp at zero.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# Recompile limit: (new name, old name). Both per code object and accumulated over all code objects.
_LIMIT_NAMES = (("recompile_limit", "cache_size_limit"),)
_ACCUMULATED_LIMIT_NAMES = (("accumulated_recompile_limit", "accumulated_cache_size_limit"),)


def _dynamo_config() -> Any:
    import torch._dynamo

    return torch._dynamo.config


def _counters() -> dict[str, Any]:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - every supported torch has it
        return {}
    return counters


def graphs() -> int | None:
    """FX graphs dynamo has compiled in this process so far."""
    counters = _counters()
    if not hasattr(counters, "get"):  # pragma: no cover - a torch without the counters dict
        return None
    return int(counters.get("stats", {}).get("unique_graphs", 0))


def graph_break_reasons() -> dict[str, int]:
    """Graph-break reason -> how often it happened, so far in this process."""
    return {str(k): int(v) for k, v in _counters().get("graph_break", {}).items()}


def graph_breaks() -> int:
    return sum(graph_break_reasons().values())


def cudagraph_skips() -> int:
    """How often inductor declined to use a CUDA graph under mode="reduce-overhead"."""
    inductor = _counters().get("inductor")
    return 0 if inductor is None else int(inductor.get("cudagraph_skips", 0))


def frame_compiles() -> tuple[int, int] | None:
    """(compiles, recompiles) summed over frames since the last torch._dynamo.reset(); None if unknown."""
    try:
        from torch._dynamo import convert_frame

        per_frame = convert_frame.FRAME_COMPILE_COUNTER
    except (ImportError, AttributeError):
        return None
    compiles = sum(int(n) for n in per_frame.values())
    recompiles = sum(max(0, int(n) - 1) for n in per_frame.values())
    return compiles, recompiles


def _config_name(pairs: tuple[tuple[str, str], ...]) -> str | None:
    cfg = _dynamo_config()
    for new, old in pairs:
        for name in (new, old):
            if hasattr(cfg, name):
                return name
    return None


def recompile_limit() -> int | None:
    """Dynamo's per-code-object recompile limit (whatever this torch calls it)."""
    name = _config_name(_LIMIT_NAMES)
    return None if name is None else int(getattr(_dynamo_config(), name))


def accumulated_recompile_limit() -> int | None:
    """Dynamo's cap on the graphs of one code object over all its compiles (whatever this torch calls it)."""
    name = _config_name(_ACCUMULATED_LIMIT_NAMES)
    return None if name is None else int(getattr(_dynamo_config(), name))


def raise_recompile_limit(at_least: int) -> None:
    """Make sure one code object may hold `at_least` compiled graphs (never lowers a larger setting).

    Both limits (per code object and accumulated), under every spelling this torch has: where the old name is
    an alias of the new one (torch 2.7+) setting both is one setting; where only one exists, that one is set.
    Process-wide on purpose: the limit is checked whenever a compiled function is called, not only while
    compiling, so a scoped patch around warm-up would not cover a lazily compiled bucket later.
    """
    cfg = _dynamo_config()
    at_least = int(at_least)
    for pairs in (_LIMIT_NAMES, _ACCUMULATED_LIMIT_NAMES):
        for new, old in pairs:
            for name in (new, old):
                if hasattr(cfg, name) and int(getattr(cfg, name)) < at_least:
                    setattr(cfg, name, at_least)


def recompile_error_type() -> type[BaseException]:
    """The exception dynamo raises under error_on_recompile."""
    try:
        from torch._dynamo.exc import RecompileError
    except ImportError:  # pragma: no cover
        return RuntimeError
    return RecompileError


@contextlib.contextmanager
def error_on_recompile() -> Iterator[None]:
    """Within the block dynamo raises RecompileError (naming the failed guard) instead of recompiling."""
    with _dynamo_config().patch(error_on_recompile=True):
        yield


def mark_static_address(t: torch.Tensor) -> None:
    """Tell dynamo/inductor this tensor keeps its address for the program's life (CUDA-graph input).

    guard=True: the graph is also guarded on this very tensor, so another Generator's buffers of the same shape
    get their own graph rather than a replay of one captured over someone else's addresses.
    """
    torch._dynamo.mark_static_address(t, guard=True)
