"""The one place static-decode touches private torch.compile internals.

Reads dynamo's and inductor's counters (graphs, graph breaks, recompiles, cudagraph skips, compile-cache hits) and
sets the recompile limits, static addresses, a symbolic read length (`dynamic_int`) and inductor's cache directory
(`inductor_cache_dir`). None of it is public API and names move between releases, so every read is guarded: a
missing name reads as "unknown" (None), never an AttributeError. `capture.guards` is the public face of this
module. Which counters, and why callers take differences of snapshots: docs/internals.md#dynamo-counters.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

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


def mark_static(t: torch.Tensor) -> None:
    """Every dimension of `t` static, whatever automatic dynamic shapes would decide (no symbolic batch, say)."""
    torch._dynamo.mark_static(t)


@functools.cache
def dynamic_int_type() -> Callable[[int], int] | None:
    """torch's DynamicInt (an int subclass dynamo traces as a symbol), or None on a torch without it (< 2.9)."""
    try:
        from torch.fx.experimental.sym_node import DynamicInt
    except ImportError:  # callers fall back to automatic dynamic shapes
        return None
    return DynamicInt


def has_dynamic_int() -> bool:
    """Whether this torch can trace one Python int argument as a symbol from its first compile."""
    return dynamic_int_type() is not None


def dynamic_int(n: int) -> int:
    """`n` as an int dynamo traces symbolically (an int subclass: eager code sees the same number); `n` itself
    where this torch lacks DynamicInt."""
    wrap = dynamic_int_type()
    return n if wrap is None else wrap(n)


def _clear_inductor_memory_caches() -> None:
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    clear_caches()


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """os.environ[name] = value inside the block (None: leave it alone); the previous value (or absence) after."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def inductor_cache_dir(inductor: Path, triton: Path | None = None) -> Iterator[None]:
    """Inside the block inductor's on-disk caches (FX graph cache, AOTAutograd cache, compiled kernels) live in
    `inductor`, and Triton's in `triton` if given; both caches are switched on even where the environment turned
    them off, since a caller that names a directory wants it filled. Process-wide while the block runs (an
    environment variable and inductor's config): another thread compiling at the same time uses it too.
    Restored afterwards, environment and config alike."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor.mkdir(parents=True, exist_ok=True)
    if triton is not None:
        triton.mkdir(parents=True, exist_ok=True)
    patches = [inductor_config.patch(fx_graph_cache=True)]
    if hasattr(functorch_config, "enable_autograd_cache"):
        patches.append(functorch_config.patch(enable_autograd_cache=True))
    with contextlib.ExitStack() as stack:
        stack.enter_context(_env("TORCHINDUCTOR_CACHE_DIR", str(inductor.resolve())))
        stack.enter_context(_env("TRITON_CACHE_DIR", None if triton is None else str(triton.resolve())))
        for patch in patches:
            stack.enter_context(patch)
        _clear_inductor_memory_caches()
        stack.callback(_clear_inductor_memory_caches)  # runs first on the way out, inside the directory
        yield


def cache_counts() -> dict[str, int]:
    """Inductor's on-disk cache lookups so far in this process: FX graph and AOTAutograd cache hits and misses."""
    counters = _counters()
    inductor, aot = counters.get("inductor", {}), counters.get("aot_autograd", {})
    return {
        "fxgraph_hit": int(inductor.get("fxgraph_cache_hit", 0)),
        "fxgraph_miss": int(inductor.get("fxgraph_cache_miss", 0)),
        "autograd_hit": int(aot.get("autograd_cache_hit", 0)),
        "autograd_miss": int(aot.get("autograd_cache_miss", 0)),
    }


F = TypeVar("F", bound=Callable[..., Any])


def own_copy(fn: F) -> F:
    """`fn` with a code object and a globals dict of its own. Dynamo keeps its cache entries on the code object
    and installs each compiled graph as a global of the compiled frame (`__compiled_fn_N`); under CUDA graphs
    those graphs hold the static-address tensors they were compiled over (cache, buffers) as attributes. With the
    shared step functions all of that would live as long as the process; with a copy per runner it goes when the
    runner goes (a regrowth, a new Generator), and each runner's recompile count is its own."""
    own_globals = dict(fn.__globals__)  # a snapshot of the function's module's names (functions, torch, PAD)
    copy = types.FunctionType(fn.__code__.replace(), own_globals, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    return copy
