"""The compiled step runner: the capture policy for the generator's steps over one cache and one set of buffers.

The generator asks any runner two things (`static_decode.steps.functions.StepRunner`): the read length of a step (here
rounded up to a rung of the bucket ladder) and the callable of a step kind at that length (here the
registry's compiled step). Decided here, not in the generator: the unbucketed kinds, the static tensors, warm-up's
scratch state (restored afterwards), the compile settings and eager fallback, the compile cache and the layer
regions: docs/internals.md#runner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

from capture import _dynamo_counters as dc
from capture.buckets import BucketLadder
from capture.compile_cache import CompileCache
from capture.regions import LayerRegions
from capture.registry import Pair, StepRegistry, preserving
from capture.report import CaptureRecord, CaptureReport
from capture.settings import CaptureOptions, CompileSettings
from static_decode.core.cache import StaticKVCache
from static_decode.model.llama import Llama
from static_decode.steps.functions import STEPS, UNBUCKETED, StepBuffers, StepFn

REGION_SHAPES = 3  # chunk shapes a region compiles for: decode (1), a prefill chunk, a speculative verify step


class CompiledRunner:
    """Compiled steps over `cache` and `bufs` by (kind, read bucket); warmed up per `options`."""

    def __init__(
        self,
        model: Llama,
        cache: StaticKVCache,
        bufs: StepBuffers,
        options: CaptureOptions | None = None,
        *,
        steps: Mapping[str, StepFn] | None = None,
        draft_cache: StaticKVCache | None = None,
    ) -> None:
        opts = CaptureOptions() if options is None else options
        if not isinstance(opts, CaptureOptions):
            raise TypeError(f"capture must be a capture.CaptureOptions, got {type(opts).__name__}")
        self.options = opts
        # A draft model's cache is state the steps mutate too: static addresses, and its lengths kept by warm-up.
        caches = [cache] if draft_cache is None else [cache, draft_cache]
        live = [*(c.lens for c in caches), *bufs.tensors().values()]

        def idle() -> contextlib.AbstractContextManager[None]:
            return preserving(live, prepare=lambda: (bufs.done.fill_(True), bufs.n_new.zero_()))

        tp = model.tp
        settings = opts.settings or CompileSettings.for_device(cache.device, collectives=tp.backend())
        self._fns = {kind: dc.own_copy(fn) for kind, fn in (STEPS if steps is None else steps).items()}
        ladder = BucketLadder.of(
            opts.buckets, cache.max_len, fine=settings.symbolic_read_len, device_type=cache.device.type
        )
        self.regions = self._regions(model, cache, settings, ladder)
        self.registry = StepRegistry(
            self._fns, ladder,
            args=(model, cache, bufs),
            device=cache.device, settings=settings, unbucketed=UNBUCKETED,
            static_tensors=[*(t for c in caches for t in (c.k, c.v)), *live], scratch=idle,
            # Each emitting call advances the output index; reset it, or 3 calls per pair under CUDA graphs
            # (x kinds x buckets) would scatter past the end of `bufs.out` when max_len is small.
            before_call=bufs.step.zero_,
            fallback=tp.enabled if opts.fallback is None else opts.fallback,
            compile_cache=None if opts.compile_cache is None else CompileCache(opts.compile_cache, cache.device),
            around=None if self.regions is None else self.regions.installed,
            nested_graphs=None if self.regions is None else self.regions.graphs_compiled,
        )
        if opts.warm_up == "all":
            self.warm_up(opts.kinds, progress=opts.progress)

    @staticmethod
    def _regions(
        model: Llama, cache: StaticKVCache, settings: CompileSettings, ladder: BucketLadder
    ) -> LayerRegions | None:
        """The layer regions `settings` asks for (capture.regions), or None: a whole-step graph. A tensor-parallel
        model keeps the whole step (its all-reduces stay in one graph)."""
        if not settings.layer_regions or model.tp.enabled:
            return None
        if settings.cudagraphs(cache.device):
            raise ValueError(
                f"layer_regions={settings.layer_regions} needs steps without CUDA graphs (a graph replays kernels, "
                f"not the Python that calls a region); settings: {settings.describe()}"
            )
        # Region graphs: one per chunk shape (decode 1, the prefill chunk, a verify step), per rung when static.
        graphs = REGION_SHAPES * (1 if settings.symbolic_read_len else len(ladder))
        return LayerRegions(model, cache, settings, regions=settings.layer_regions, graphs=graphs)

    def close(self) -> None:
        """Drop the compiled steps: their cache entries, the graphs installed as globals and (under CUDA graphs)
        the cache and buffers those graphs hold, so they are freed with this runner's Generator state. The
        Generator calls it before it allocates anew (a regrowth); the runner cannot run steps afterwards."""
        import torch._dynamo

        for fn in self._fns.values():
            torch._dynamo.reset_code(fn.__code__)  # this runner's own copies only: other runners keep theirs
        self._fns.clear()
        if self.regions is not None:
            self.regions.close()
        self.registry = None

    # ---- the StepRunner protocol -------------------------------------------------------------------------
    def read_len(self, longest: int) -> int:
        return self.registry.ladder.bucket_for(longest)

    def step(self, kind: str, read_len: int) -> StepFn:
        return self.registry.step(kind, read_len)

    # ---- what was captured, and capturing more -------------------------------------------------------------
    @property
    def ladder(self) -> BucketLadder:
        return self.registry.ladder

    @property
    def settings(self) -> CompileSettings:
        return self.registry.settings

    @property
    def cudagraphs(self) -> bool:
        """Whether the steps run as CUDA graphs."""
        return self.registry.cudagraphs

    @property
    def records(self) -> dict[Pair, CaptureRecord]:
        """One record per (kind, read_len) compiled so far (warm-up or first use)."""
        return dict(self.registry.records)

    @property
    def fallbacks(self) -> dict[str, str]:
        """Kinds that run their eager step (compile or capture failed), with the reason."""
        return dict(self.registry.fallbacks)

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.registry.kinds

    def pairs(self, kinds: Iterable[str] | None = None) -> list[Pair]:
        """Every (kind, read_len) of these kinds (default: all), largest reads first."""
        return self.registry.pairs(kinds)

    def warm_up(
        self, kinds: Iterable[str] | None = None, *, buckets: Iterable[int] | None = None, progress: bool = True
    ) -> CaptureReport:
        """Compile (and capture) every pair of `kinds` (default: all) at `buckets` (default: every rung) not
        captured yet, on scratch state; return their records."""
        pairs = self.registry.pairs(kinds)
        if buckets is not None:
            wanted = {self.registry.ladder.bucket_for(b) for b in buckets}
            pairs = [(k, n) for k, n in pairs if k in UNBUCKETED or n in wanted]
        return self.registry.warm_up(pairs, progress=progress)
