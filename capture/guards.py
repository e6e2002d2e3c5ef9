"""Compile-regression guards to put in your own tests: count, don't grep logs.

    gen.generate(prompt, 8)                 # warm-up: compiles what it needs
    with steady_state():                    # no recompile, no new graph, no break, no skip, no host sync
        gen.generate(other_prompt, 64)

`count_compiles`, `fail_on_recompile`, `assert_no_graph_breaks`, `assert_no_cudagraph_skips`, `no_host_sync` (CUDA
only) are the parts of `steady_state`. The counts come from private torch counters (capture._dynamo_counters); a
check whose counter is unknown is skipped, never passed by comparing None. Usage: docs/compile.md, each guard:
docs/internals.md#guards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from capture import _dynamo_counters as dc


class CompileRegressionError(AssertionError):
    """A guard saw compile work, a graph break, a CUDA-graph skip or a host sync where none was allowed."""


RecompileError = dc.recompile_error_type()


@dataclass(frozen=True)
class CompileCounts:
    """Compile counters at one moment (process totals), or the difference between two moments."""

    graphs: int  # FX graphs compiled (one per (kind, bucket) in a healthy registry)
    graph_breaks: int  # graph breaks (0 under fullgraph=True, or compilation would have failed)
    recompiles: int  # compiles of a frame after its first (guard failures); -1 when this torch hides it
    cudagraph_skips: int  # times reduce-overhead fell back to running without a CUDA graph

    @classmethod
    def now(cls) -> CompileCounts:
        frames = dc.frame_compiles()
        graphs = dc.graphs()
        return cls(
            graphs=-1 if graphs is None else graphs,
            graph_breaks=dc.graph_breaks(),
            recompiles=-1 if frames is None else frames[1],
            cudagraph_skips=dc.cudagraph_skips(),
        )

    def __sub__(self, before: CompileCounts) -> CompileCounts:
        # Clamped at 0: torch._dynamo.reset() inside the interval clears the frame counters.
        def diff(a: int, b: int) -> int:
            return -1 if a < 0 or b < 0 else max(0, a - b)

        return CompileCounts(
            graphs=diff(self.graphs, before.graphs),
            graph_breaks=diff(self.graph_breaks, before.graph_breaks),
            recompiles=diff(self.recompiles, before.recompiles),
            cudagraph_skips=diff(self.cudagraph_skips, before.cudagraph_skips),
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class CompileCounter:
    """What `count_compiles()` yields: `.counts` is the difference since entry (live; final after exit)."""

    def __init__(self) -> None:
        self.start = CompileCounts.now()
        self._end: CompileCounts | None = None
        self._breaks_at_start = dc.graph_break_reasons()

    @property
    def counts(self) -> CompileCounts:
        return (self._end or CompileCounts.now()) - self.start

    def new_break_reasons(self) -> dict[str, int]:
        """Graph-break reasons seen since entry, with their counts."""
        now = dc.graph_break_reasons()
        return {
            k: v - self._breaks_at_start.get(k, 0)
            for k, v in now.items()
            if v > self._breaks_at_start.get(k, 0)
        }

    def stop(self) -> None:
        self._end = CompileCounts.now()


@contextlib.contextmanager
def count_compiles() -> Iterator[CompileCounter]:
    """Count compile work inside the block: `with count_compiles() as c: ...`, then `c.counts.graphs` etc."""
    counter = CompileCounter()
    try:
        yield counter
    finally:
        counter.stop()


@contextlib.contextmanager
def fail_on_recompile(*, allow_new_graphs: bool = False) -> Iterator[CompileCounter]:
    """Raise `RecompileError` at any recompile in the block; at exit, also fail on any newly compiled graph.

    allow_new_graphs=True keeps only dynamo's recompile check (first compiles of new functions pass).
    """
    with count_compiles() as counter, dc.error_on_recompile():
        yield counter
    counts = counter.counts
    if counts.recompiles > 0:
        raise CompileRegressionError(
            f"{counts.recompiles} recompile(s) in a block that allows none: {counts}"
        )
    if not allow_new_graphs and counts.graphs > 0:
        raise CompileRegressionError(
            f"{counts.graphs} graph(s) compiled in a block that allows none (a bucket or a step not warmed "
            f"up?): {counts}"
        )


@contextlib.contextmanager
def assert_no_graph_breaks() -> Iterator[CompileCounter]:
    """Fail at exit if anything compiled in the block broke its graph, naming the reasons."""
    with count_compiles() as counter:
        yield counter
    if counter.counts.graph_breaks > 0:
        raise CompileRegressionError(f"graph breaks in the block: {counter.new_break_reasons()}")


@contextlib.contextmanager
def assert_no_cudagraph_skips() -> Iterator[CompileCounter]:
    """Fail at exit if reduce-overhead ran any graph without CUDA graphs (see the inductor log for why)."""
    with count_compiles() as counter:
        yield counter
    skips = counter.counts.cudagraph_skips
    if skips > 0:
        raise CompileRegressionError(
            f"{skips} CUDA-graph skip(s): a compiled step ran without a CUDA graph (a mutated input without "
            "a static address? a CPU tensor? set TORCH_LOGS=perf_hints to see the reason)"
        )


def host_sync_checks_active() -> bool:
    """Whether `no_host_sync()` can check anything here (a CUDA device is present)."""
    return torch.cuda.is_available()


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """On CUDA: any synchronising call in the block raises (sync debug mode "error"). Elsewhere a no-op."""
    if not host_sync_checks_active():
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@contextlib.contextmanager
def steady_state(*, host_sync: bool = True) -> Iterator[CompileCounter]:
    """A warmed-up loop: no recompile, no new graph, no graph break, no CUDA-graph skip, no host sync (CUDA).

    host_sync=False leaves host syncs allowed (a loop that reads tokens back to stream them must sync).
    """
    sync = no_host_sync() if host_sync else contextlib.nullcontext()
    with assert_no_cudagraph_skips(), assert_no_graph_breaks(), fail_on_recompile() as counter, sync:
        yield counter
