"""The compiled step registry: compiled steps by (step kind, read bucket), warmed up before they are needed.

A step is `fn(*args, read_len)` with `args` fixed for the registry's life and `read_len` a rung of the ladder;
each kind compiles once (fullgraph, dynamic=False): one graph per kind with a symbolic read length, one per rung
with a static one. The registry marks every tensor it is given a static address (else CUDA graphs are skipped),
keeps dynamo's recompile limit above its graphs, warms up on the owner's scratch state, falls back through the
CUDA attention formulations before eager, and (with `fallback=True`) runs a kind that fails to compile eagerly,
recording why. Design notes: docs/internals.md#registry.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from capture import _dynamo_counters as dc
from capture.buckets import BucketLadder
from capture.compile_cache import CompileCache
from capture.guards import count_compiles
from capture.report import CaptureRecord, CaptureReport
from capture.settings import RECOMPILE_HEADROOM, CompileSettings
from static_decode.base import ranges
from static_decode.base.progress import console, progress_bar
from static_decode.core import attention

Pair = tuple[str, int]
ScratchFactory = Callable[[], contextlib.AbstractContextManager[Any]]

CUDAGRAPH_WARMUP_CALLS = 3  # cudagraph trees: 1st call warms up, 2nd records, 3rd replays (checked here)
_GRAPHS_REQUESTED = 0  # all pairs of all registries in this process (the process-wide limit must cover them)


def _raise_recompile_limit() -> None:
    """Process-wide limits >= every pair of every registry so far + headroom (what torch < 2.13 relies on).

    Without per-compile isolation all compiles of one function share its code object's graphs, so one code
    object may hold the graphs of every registry made over it in this process (the Generator's runners compile
    their own copies; a caller passing shared functions does not): `_GRAPHS_REQUESTED` bounds that from above,
    whatever `torch._dynamo.reset()` cleared.
    """
    dc.raise_recompile_limit(_GRAPHS_REQUESTED + RECOMPILE_HEADROOM)


@contextlib.contextmanager
def preserving(tensors: Iterable[torch.Tensor], prepare: Callable[[], None] | None = None) -> Iterator[None]:
    """Snapshot `tensors`, run `prepare()` (e.g. "no row appends anything"); copy the snapshot back after."""
    tensors = list(tensors)
    saved = [t.clone() for t in tensors]
    try:
        if prepare is not None:
            prepare()
        yield
    finally:
        with torch.no_grad():
            for t, s in zip(tensors, saved, strict=True):
                t.copy_(s)


class StepRegistry:
    """Compiled steps by (kind, read bucket) for one set of static arguments (one graph per pair, or per kind
    with a symbolic read length).

    steps: kind -> fn(*args, read_len); ladder: the read buckets; args: the fixed leading arguments;
    unbucketed: kinds that read no cache (always called with read_len 0: one graph each);
    static_tensors: tensors steps mutate (marked as static addresses under CUDA graphs);
    scratch: a context factory for warm-up (see `preserving`); without it, warm-up runs on the live state;
    before_call: run before every warm-up call of a pair: resets what a call consumes (an output index, say),
        since under CUDA graphs a pair is called `warm_up_calls` times inside one scratch context;
    fallback: run a kind eagerly (and say why in its records) when it fails to compile or capture;
    compile_cache: where compiles read and write inductor's caches (None: the environment's);
    around: a context entered around every call of a compiled step, warm-up included (the runner installs its
        layer regions, capture.regions, for the step's tracing and guards); not around an eager fallback.
    nested_graphs: a running count of the graphs compiled by what the steps call at run time apart from their own
        graph (the layer regions); each record splits its compiles into `graphs` (the step's) and `region_graphs`.
    """

    def __init__(
        self,
        steps: Mapping[str, Callable[..., Any]],
        ladder: BucketLadder,
        *,
        args: Sequence[Any],
        device: torch.device | str,
        settings: CompileSettings | None = None,
        unbucketed: Iterable[str] = (),
        static_tensors: Iterable[torch.Tensor] = (),
        scratch: ScratchFactory | None = None,
        before_call: Callable[[], Any] | None = None,
        fallback: bool = False,
        compile_cache: CompileCache | None = None,
        around: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        nested_graphs: Callable[[], int] | None = None,
    ) -> None:
        global _GRAPHS_REQUESTED
        if not isinstance(ladder, BucketLadder):
            raise TypeError(f"ladder must be a BucketLadder, got {type(ladder).__name__}")
        if not steps:
            raise ValueError("steps must name at least one step kind")
        for kind, fn in steps.items():
            if not callable(fn):
                raise TypeError(f"step {kind!r} must be callable, got {type(fn).__name__}")
        self.unbucketed = frozenset(unbucketed)
        unknown = self.unbucketed - set(steps)
        if unknown:
            raise ValueError(f"unbucketed kinds {sorted(unknown)} are not among the steps {sorted(steps)}")
        self.ladder = ladder
        self.device = torch.device(device)
        self.settings = CompileSettings.for_device(self.device) if settings is None else settings
        self.cudagraphs = self.settings.cudagraphs(self.device)
        self.args = tuple(args)
        self.scratch = scratch
        self.before_call = before_call
        self.around = around
        self.nested_graphs = nested_graphs
        self._eager = dict(steps)
        # Kinds whose read length is symbolic: every bucketed kind under symbolic_read_len (an unbucketed kind is
        # always called with 0, which dynamo would specialise anyway).
        self.symbolic = frozenset(k for k in steps if self.settings.symbolic_read_len and k not in self.unbucketed)
        static_tensors = list(static_tensors)
        if self.cudagraphs:
            for t in static_tensors:
                dc.mark_static_address(t)
        if self.symbolic:
            # Only the read length may turn symbolic. dynamic=False already keeps tensors static; on a torch without
            # DynamicInt the steps compile with automatic dynamic shapes, which would also make symbolic whatever
            # tensor shape changed between two compiles of a step's code (dynamo keys that state by file and line,
            # so a regrown cache's bigger batch counts as a change).
            for t in static_tensors:
                dc.mark_static(t)
        self.compile_cache = compile_cache
        if compile_cache is not None:
            compile_cache.load()  # CUDA: last process's artifacts into the directory, before anything compiles
        n_graphs = {k: 1 if k in self.unbucketed else len(ladder) for k in steps}
        _GRAPHS_REQUESTED += sum(n_graphs.values())
        _raise_recompile_limit()
        self._compiled = {
            k: self.settings.compile(fn, graphs=n_graphs[k], symbolic=k in self.symbolic) for k, fn in steps.items()
        }
        self._runners = {k: self._runner(k) for k in self._compiled}
        self._rungs = frozenset(ladder.lengths)
        self.records: dict[Pair, CaptureRecord] = {}
        self.fallback = bool(fallback)
        self.fallbacks: dict[str, str] = {}  # kind -> why it runs eagerly
        # CUDA: a compile failure first retries with the next key-splitting attention formulation (_next_formulation)
        self.formulation_retry = self.device.type == "cuda" and self.settings.backend == "inductor"
        self.formulation_fallbacks: dict[str, dict[str, str]] = {}  # kind -> {formulation that failed: why}
        self._views: dict[str, tuple[Any, Any]] = {}  # kind -> (the model it was called with, the view it gets)

    # ---- what exists --------------------------------------------------------------------------------------
    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._compiled)

    def pairs(self, kinds: Iterable[str] | None = None) -> list[Pair]:
        """Every (kind, read_len) this registry can run, largest reads first (most memory, captured first)."""
        kinds = self.kinds if kinds is None else tuple(kinds)
        out: list[Pair] = []
        for kind in kinds:
            self._check_kind(kind)
            out += (
                [(kind, 0)] if kind in self.unbucketed else [(kind, r) for r in reversed(self.ladder.lengths)]
            )
        return out

    def _check_kind(self, kind: str) -> None:
        if kind not in self._compiled:
            raise KeyError(f"no step kind {kind!r}; this registry has {self.kinds}")

    def _pair(self, kind: str, read_len: int) -> Pair:
        self._check_kind(kind)
        if kind in self.unbucketed:
            return kind, 0
        if read_len not in self._rungs:
            raise ValueError(
                f"read_len={read_len} for step {kind!r} is not a bucket of the ladder {self.ladder.lengths}; "
                "round it up with ladder.bucket_for()"
            )
        return kind, read_len

    # ---- running ------------------------------------------------------------------------------------------
    def step(self, kind: str, read_len: int) -> Callable[..., Any]:
        """A callable `fn(*args, read_len)` running the compiled step (the Generator's `_step` hook)."""
        pair = self._pair(kind, read_len)
        if pair not in self.records:
            return lambda *a: self._first_call(pair, a)
        return self._runners[kind]

    def _runner(self, kind: str, *, eager: bool = False) -> Callable[..., Any]:
        """The per-call wrapper: no_grad (one grad mode for every call, so no guard ever fails on it), the
        fixed read length of an unbucketed kind, a symbolic kind's read length as a DynamicInt, and under CUDA
        graphs a new replay step and cloned outputs. eager=True: the same around the uncompiled step (a fallback).
        """
        fn = self._eager[kind] if eager else self._compiled[kind]
        fixed = 0 if kind in self.unbucketed else None
        cudagraphs = self.cudagraphs and not eager
        # Every call, not only the compiling one: should anything ever recompile the kind, it stays symbolic.
        symbolic = kind in self.symbolic and not eager
        around = self.around if self.around is not None and not eager else contextlib.nullcontext

        def call(*a: Any) -> Any:
            if kind in self.formulation_fallbacks:
                a = (self._view(kind, a[0]), *a[1:])
            if fixed is not None:
                a = (*a[:-1], fixed)
            elif symbolic:
                a = (*a[:-1], dc.dynamic_int(a[-1]))
            with torch.no_grad(), around():
                if cudagraphs:
                    torch.compiler.cudagraph_mark_step_begin()  # earlier outputs may now be overwritten
                out = fn(*a)
            if cudagraphs and out is not None:
                out = pytree.tree_map_only(torch.Tensor, torch.clone, out)
            return out

        return call

    def _first_call(self, pair: Pair, a: tuple[Any, ...]) -> Any:
        """Lazy capture: a real call of a pair that was not warmed up; timed and recorded."""
        _raise_recompile_limit()
        out, record = self._measure(pair, lambda: self._runners[pair[0]](*a), calls=1)
        self.records[pair] = record
        if record.graphs and self.compile_cache is not None:
            self.compile_cache.save()
        return out

    # ---- warm-up / capture --------------------------------------------------------------------------------
    @property
    def warm_up_calls(self) -> int:
        """Calls per pair at warm-up: cudagraph trees warm up, record, then replay (3); one compile call else."""
        return CUDAGRAPH_WARMUP_CALLS if self.cudagraphs else 1

    def warm_up(self, pairs: Iterable[Pair] | None = None, *, progress: bool = True) -> CaptureReport:
        """Compile (and under CUDA graphs capture) every pair not yet captured; return their records."""
        todo = [self._pair(*p) for p in (self.pairs() if pairs is None else pairs)]
        todo = [p for p in dict.fromkeys(todo) if p not in self.records]
        _raise_recompile_limit()
        calls = self.warm_up_calls
        t0 = time.perf_counter()
        scratch = self.scratch() if self.scratch is not None else contextlib.nullcontext()
        with scratch, progress_bar("capture", len(todo), enabled=progress and bool(todo)) as advance:
            for kind, read_len in todo:
                # The runner is looked up at each call: a fallback inside _measure swaps it for the eager one.
                def call(k: str = kind, n: int = read_len) -> Any:
                    if self.before_call is not None:
                        self.before_call()
                    return self._runners[k](*self.args, n)

                _, record = self._measure((kind, read_len), call, calls=calls)
                self.records[(kind, read_len)] = record
                advance(f"{kind} @ {read_len}: {record.seconds:.1f} s")
        if self.compile_cache is not None and any(self.records[p].graphs for p in todo):
            self.compile_cache.save()
        report = CaptureReport(
            records=[self.records[p] for p in todo],
            seconds=time.perf_counter() - t0,
            settings=self.settings.describe(),
            device=str(self.device),
        )
        if progress and todo:
            console().print(f"[capture] {report.summary()}")
        return report

    def _measure(self, pair: Pair, call: Callable[[], Any], *, calls: int) -> tuple[Any, CaptureRecord]:
        kind, read_len = pair
        mem0 = _reserved(self.device)
        out = None
        cache = self.compile_cache.active() if self.compile_cache is not None else contextlib.nullcontext()
        nested0 = self.nested_graphs() if self.nested_graphs is not None else 0
        with ranges.range(ranges.capture_name(kind, read_len)), cache, count_compiles() as counter, torch.no_grad():
            t0 = time.perf_counter()
            while True:
                try:
                    for _ in range(calls if kind not in self.fallbacks else 1):
                        out = call()
                    break
                except Exception as error:
                    if kind not in self.fallbacks and self._next_formulation(kind, error):
                        continue  # compiled again, attention taking the next formulation
                    if not self.fallback or kind in self.fallbacks:
                        raise
                    self._fall_back(kind, error)
                    out = call()  # now the eager step
                    break
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
        c = counter.counts
        nested = (self.nested_graphs() if self.nested_graphs is not None else 0) - nested0
        mem1 = _reserved(self.device)
        record = CaptureRecord(
            kind=kind,
            read_len=read_len,
            seconds=seconds,
            graphs=c.graphs - nested,
            region_graphs=nested,
            graph_breaks=c.graph_breaks,
            recompiles=c.recompiles,
            cudagraph_skips=c.cudagraph_skips,
            pool_bytes=None if mem0 is None or mem1 is None else max(0, mem1 - mem0),
            fallback=self.fallbacks.get(kind, ""),
        )
        return out, record

    def _next_formulation(self, kind: str, error: Exception) -> bool:
        """A compile on CUDA failed: record that the first key-splitting attention formulation still in use
        (attention.CUDA_DECODE_ORDER: flex, then split_key) failed for this kind, whose retried compile resolves
        past it. False when none is left to give way (then the kind falls back to eager, or the error is raised)."""
        if not self.formulation_retry:
            return False
        failed = self.formulation_fallbacks.get(kind, {})
        left = [impl for impl in attention.CUDA_DECODE_ORDER[:-1] if impl not in failed]
        if not left:
            return False
        lines = str(error).strip().splitlines()
        why = f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]
        self.formulation_fallbacks[kind] = {**failed, left[0]: why}
        console().print(f"[capture] step {kind!r}: attention {left[0]!r} failed to compile ({why}); compiling again")
        return True

    def _view(self, kind: str, model: Any) -> Any:
        """The model `kind`'s step is called with once a formulation failed for it: a view that resolves past
        those formulations (`Llama.skipping`), made once per model so that its compiled graph is reused."""
        seen = self._views.get(kind)
        skip = tuple(self.formulation_fallbacks[kind])
        if seen is None or seen[0] is not model or seen[1].attn_skip != skip:
            seen = self._views[kind] = (model, model.skipping(skip))
        return seen[1]

    def _fall_back(self, kind: str, error: Exception) -> None:
        """From now on run `kind` eagerly; remember why (the first line of the error)."""
        lines = str(error).strip().splitlines()
        why = f"{type(error).__name__}: {lines[0] if lines else ''}"
        self.fallbacks[kind] = why[:200]
        self._runners[kind] = self._runner(kind, eager=True)
        console().print(f"[capture] step {kind!r} runs eagerly: {self.fallbacks[kind]}")


def _reserved(device: torch.device) -> int | None:
    """Device memory reserved by the caching allocator (graph pools included); None off CUDA."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_reserved(device))
