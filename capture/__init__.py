"""capture: compiled fixed-shape steps, one graph per (step kind, read bucket), and compile-regression guards.

* `BucketLadder` (capture.buckets): which read lengths get a graph.
* `CompileSettings` (capture.settings): torch.compile arguments per device.
* `StepRegistry` (capture.registry): compiles, warms up and runs the steps.
* guards (capture.guards): `steady_state`, `fail_on_recompile`, `count_compiles`, `no_host_sync`, ...
* `CaptureReport` (capture.report): per-pair records, table, JSON, baseline check.
"""

from capture.buckets import BucketLadder
from capture.guards import (
    CompileCounts,
    CompileRegressionError,
    RecompileError,
    assert_no_cudagraph_skips,
    assert_no_graph_breaks,
    count_compiles,
    fail_on_recompile,
    no_host_sync,
    steady_state,
)
from capture.registry import StepRegistry, preserving
from capture.report import CaptureRecord, CaptureReport
from capture.settings import CaptureOptions, CompileSettings

__all__ = [
    "BucketLadder",
    "CaptureRecord",
    "CaptureReport",
    "CompileCounts",
    "CompileRegressionError",
    "CaptureOptions",
    "CompileSettings",
    "RecompileError",
    "StepRegistry",
    "assert_no_cudagraph_skips",
    "assert_no_graph_breaks",
    "count_compiles",
    "fail_on_recompile",
    "no_host_sync",
    "preserving",
    "steady_state",
]
