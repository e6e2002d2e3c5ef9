"""capture: compiled fixed-shape steps by (step kind, read bucket), and compile-regression guards.

* `BucketLadder` (capture.buckets): which read lengths get a graph.
* `CompileSettings`, `CaptureOptions` (capture.settings): torch.compile arguments per device; what to capture.
* `StepRegistry` (capture.registry): compiles, warms up and runs steps.
* `CompileCache` (capture.compile_cache): a persistent compile cache directory (`CaptureOptions(compile_cache=)`).
* `CompiledRunner` (capture.runner): the generator's steps compiled over one cache (the capture policy).
* guards (capture.guards): `steady_state`, `fail_on_recompile`, `count_compiles`, `no_host_sync`, ...
* `CaptureRecord`, `CaptureReport` (capture.report): per-pair records, table, JSON, baseline check.

Names are imported on first use (PEP 562), so `import capture.settings` does not load torch._dynamo.
"""

from __future__ import annotations

from static_decode.base.exports import lazy_exports

_EXPORTS = {
    "BucketLadder": "capture.buckets",
    "CaptureOptions": "capture.settings",
    "CompileSettings": "capture.settings",
    "StepRegistry": "capture.registry",
    "preserving": "capture.registry",
    "CompiledRunner": "capture.runner",
    "CompileCache": "capture.compile_cache",
    "CaptureRecord": "capture.report",
    "CaptureReport": "capture.report",
    "CompileCounts": "capture.guards",
    "CompileRegressionError": "capture.guards",
    "RecompileError": "capture.guards",
    "assert_no_cudagraph_skips": "capture.guards",
    "assert_no_graph_breaks": "capture.guards",
    "count_compiles": "capture.guards",
    "fail_on_recompile": "capture.guards",
    "no_host_sync": "capture.guards",
    "steady_state": "capture.guards",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
