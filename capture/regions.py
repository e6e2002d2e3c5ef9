"""Layer regions: a compiled step whose decoder blocks are compiled apart, once, and shared by every step kind.

Inductor's compile time grows with the graph, so each step graph holds only the embedding, rotary tables, head and
sampling; each of `regions` equal spans of layers is one opaque custom op (`static_decode::layer_region`) whose body
calls one separately compiled region, compiled once per chunk shape for every kind. With `fused_decode`, a
one-row one-slot step's op runs the fused C++ decode layers instead. CPU only (a CUDA graph cannot replay the
Python that calls a region); tensor-parallel models keep the whole-step graph. The op declares K and V mutated and
reads nothing back. Design notes and costs: docs/internals.md#regions.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from capture import _dynamo_counters as dc
from capture.settings import CompileSettings
from static_decode.core.cache import LayerSpan, StaticKVCache
from static_decode.model import fused_decode
from static_decode.model.blocks import layer_windows, run_blocks, softcapped, step_attention
from static_decode.model.llama import Llama

_LIVE: dict[int, LayerRegions] = {}  # handle -> the regions of a live runner (the op finds its region here)
_HANDLES = itertools.count()


def spans(layers: int, regions: int) -> tuple[tuple[int, int], ...]:
    """Equal spans (start, stop) covering `layers`: as many as the largest divisor of `layers` <= `regions`."""
    if layers < 1 or regions < 1:
        raise ValueError(f"layers and regions must be >= 1, got layers={layers}, regions={regions}")
    n = max(d for d in range(1, min(layers, regions) + 1) if layers % d == 0)
    size = layers // n
    return tuple((i * size, (i + 1) * size) for i in range(n))


def _region(
    blocks: list[Any],
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    k: Tensor,
    v: Tensor,
    lens: Tensor,
    max_len: int,
    n_new: Tensor,
    lens_after: Tensor,
    read_len: int,
    impl: str,
    groups: int,
    fresh: bool,
    scales: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """One span of blocks: what is compiled apart. k, v: [n, B, Hkv, max_len + spare, d] of the span's layers;
    scales: an int8 cache's K and V scales of those layers ([n, B, Hkv, max_len + spare]; None for a float cache)."""
    impl, mask = step_attention(
        impl, groups, k.shape[2], lens_after, n_new, x.shape[1], read_len, k.shape[-1], k.dtype, fresh=fresh,
        windows=layer_windows(blocks),  # each block's own sliding window (None: full causal)
        softcap=softcapped(blocks),  # Gemma 2's softcapped scores take a formulation that caps them
    )
    span = LayerSpan(k, v, lens, max_len, scales)
    return run_blocks(blocks, x, cos, sin, span, n_new, lens_after, read_len, impl, mask)


# The op is defined with torch.library's low-level API, not `torch.library.custom_op`: custom_op's Python wrappers
# (argument defaults, an autograd function, version-counter bumps, output alias checks) cost ~150 us per call on
# the 2-vCPU machine (161 against 14 us for the same body; profiles/RESULTS.md, "Fixed cost around the kernels"), and a
# decode step calls the op once per span. Nothing here needs them: steps run without autograd, and the fake below
# is what tracing needs. The schema declares the mutation of K and V (`(a!)`, `(b!)`), which is what inductor
# functionalises and then reinplaces on the cache buffers.
_LIB = torch.library.Library("static_decode", "FRAGMENT")
_LIB.define(
    "layer_region(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor lens, Tensor n_new, "
    "Tensor lens_after, SymInt read_len, int start, int stop, bool fresh, int handle) -> Tensor"
)


def layer_region(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    k: Tensor,
    v: Tensor,
    lens: Tensor,
    n_new: Tensor,
    lens_after: Tensor,
    read_len: int,
    start: int,
    stop: int,
    fresh: bool,
    handle: int,
) -> Tensor:
    """Layers start..stop-1 of the runner `handle` on x [B, T, D]; writes their K/V in `k`, `v` (the cache's
    whole buffers, so the mutated inputs are graph inputs, which inductor reinplaces). Returns the new x."""
    regions = _LIVE.get(handle)
    if regions is None:
        raise RuntimeError(f"layer regions {handle} were closed; their runner cannot run steps any more")
    return regions.run(x, cos, sin, k, v, lens, n_new, lens_after, read_len, start, stop, fresh)


_LIB.impl("layer_region", layer_region, "CompositeExplicitAutograd")


@torch.library.register_fake("static_decode::layer_region", lib=_LIB)
def _(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    k: Tensor,
    v: Tensor,
    lens: Tensor,
    n_new: Tensor,
    lens_after: Tensor,
    read_len: int,
    start: int,
    stop: int,
    fresh: bool,
    handle: int,
) -> Tensor:
    return torch.empty_like(x)  # [B, T, D]


class LayerRegions:
    """The model's blocks as `regions` equal spans compiled apart, for one runner (one cache).

    A `static_decode.model.blocks.LayerRunner`: `installed()` makes it the model's runner around each call of a compiled
    step, so tracing the step puts one `layer_region` op per span where the inline loop was. graphs: the region
    graphs allowed before dynamo's recompile limit (chunk shapes x read buckets when the read length is static).
    """

    def __init__(
        self, model: Llama, cache: StaticKVCache, settings: CompileSettings, *, regions: int, graphs: int
    ) -> None:
        self.model, self.max_len = model, cache.max_len
        # An int8 cache's scale buffers: the op's body hands each region its layers' views. They are not op arguments:
        # nothing in a step graph outside the regions reads or writes them, so there is no order for it to keep.
        self.scales = None if cache.k_scale is None or cache.v_scale is None else (cache.k_scale, cache.v_scale)
        self.spans = spans(len(model.layers), regions)
        self._blocks = {(a, b): list(model.layers[a:b]) for a, b in self.spans}
        self.symbolic = settings.symbolic_read_len
        self.groups = model.config.num_heads // model.config.num_kv_heads
        self._code = dc.own_copy(_region)  # its own dynamo cache entries, dropped by close()
        self._fn = settings.compile(self._code, graphs=graphs, symbolic=self.symbolic)
        self.handle = next(_HANDLES)
        self.compiled = 0  # region graphs dynamo compiled so far (the capture records report them apart)
        # One-row, one-token steps: every layer in one kernel call instead of the compiled spans, where the model
        # and cache allow (static_decode.model.fused_decode); `fused_why` says why not otherwise.
        self.fused: fused_decode.FusedLayers | None = None
        self.fused_why = fused_decode.unsupported(model, cache) if settings.fused_decode else "fused_decode=False"
        self._whole = (0, len(model.layers))
        if self.fused_why is None:
            self.fused = fused_decode.FusedLayers(model, *self._whole)
        _LIVE[self.handle] = self

    def __call__(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        cache: StaticKVCache,
        n_new: Tensor,
        lens_after: Tensor,
        read_len: int,
        fresh: bool,
    ) -> Tensor:
        """Traced inside a step: one opaque op per span, or one for every layer where the fused kernel runs them."""
        for start, stop in (self._whole,) if self._fuses(x) else self.spans:
            x = torch.ops.static_decode.layer_region(
                x, cos, sin, cache.k, cache.v, cache.lens, n_new, lens_after, read_len, start, stop, fresh,
                self.handle,
            )  # [B, T, D]
        return x

    def run(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k: Tensor,
        v: Tensor,
        lens: Tensor,
        n_new: Tensor,
        lens_after: Tensor,
        read_len: int,
        start: int,
        stop: int,
        fresh: bool,
    ) -> Tensor:
        """The op's body at run time: the compiled region over this span's blocks and K/V views, or the fused
        kernel over every layer (the traced call chose it: a one-row, one-token step)."""
        if (start, stop) == self._whole and self._fuses(x):
            return self.fused(x, cos, sin, k, v, lens, n_new, lens_after, read_len, self.scales)
        n = dc.dynamic_int(int(read_len)) if self.symbolic else int(read_len)
        # The op is reached with or without the ADInplaceOrView key excluded (inductor calls it both ways), and
        # dynamo guards on the inputs' dispatch keys: one setting for every call, or each way is a recompile.
        before = dc.graphs()  # a dict lookup: cheap beside the region, and exact about what compiled here
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = self._fn(
                self._blocks[(start, stop)], x, cos, sin, k[start:stop], v[start:stop], lens, self.max_len, n_new,
                lens_after, n, self.model.attn_impl, self.groups, fresh,
                None if self.scales is None else (self.scales[0][start:stop], self.scales[1][start:stop]),
            )
        if before is not None:
            self.compiled += (dc.graphs() or 0) - before
        return out

    def _fuses(self, x: Tensor) -> bool:
        """Whether a step over x [B, T, D] runs the fused kernel: it is available and the step is one row, one slot
        (shapes, so the traced call and the op's body decide alike)."""
        return self.fused is not None and x.shape[0] == 1 and x.shape[1] == 1

    def graphs_compiled(self) -> int:
        """Region graphs compiled so far (StepRegistry's nested_graphs)."""
        return self.compiled

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """This object as the model's layer runner for the duration (the step's guards see the same object)."""
        previous = self.model.layer_runner
        self.model.layer_runner = self
        try:
            yield
        finally:
            self.model.layer_runner = previous

    def close(self) -> None:
        """Drop the compiled region (its dynamo cache entries) and the handle; later steps raise."""
        import torch._dynamo

        torch._dynamo.reset_code(self._code.__code__)
        _LIVE.pop(self.handle, None)
