"""The public compile-regression guards (capture.guards) catch what they claim to, and pass when they should.

Pins, each with a counterfactual that must trip the guard:
* a step that takes a length as a changing Python int recompiles, and `fail_on_recompile` raises at that call
  (while the same call with a warmed-up value passes);
* a newly compiled function inside `fail_on_recompile` fails at exit (not a dynamo "recompile", still work);
* a graph break is counted and `assert_no_graph_breaks` names its reason;
* reduce-overhead on CPU tensors is a CUDA-graph skip, and `assert_no_cudagraph_skips` fails on it;
* `no_host_sync` is a no-op without CUDA, and on CUDA (GPU-marked) turns `.item()` into an error;
* the recompile limit is raised, never lowered, under whichever name this torch uses.
Most cases compile with backend="eager" (dynamo only: what the counters count) to stay fast.
"""

from __future__ import annotations

import pytest
import torch

from capture import _dynamo_counters as dc
from capture.guards import (
    CompileCounts,
    CompileRegressionError,
    RecompileError,
    assert_no_cudagraph_skips,
    assert_no_graph_breaks,
    count_compiles,
    fail_on_recompile,
    host_sync_checks_active,
    no_host_sync,
    steady_state,
)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def read_prefix(x: torch.Tensor, n: int) -> torch.Tensor:
    return x[:n].sum()  # n is a Python int: specialised, so each new value is a new graph


def read_masked(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.arange(x.shape[0]) < n, x, 0).sum()  # n on the device: one graph for all n


def test_counts_subtract_and_clamp() -> None:
    a = CompileCounts(graphs=5, graph_breaks=1, recompiles=2, cudagraph_skips=0)
    b = CompileCounts(graphs=7, graph_breaks=1, recompiles=0, cudagraph_skips=3)
    assert b - a == CompileCounts(graphs=2, graph_breaks=0, recompiles=0, cudagraph_skips=3)
    unknown = CompileCounts(graphs=-1, graph_breaks=0, recompiles=-1, cudagraph_skips=0)
    assert (b - unknown).graphs == -1 and (b - unknown).recompiles == -1


def test_python_int_length_recompiles_and_guard_catches_it() -> None:
    """The counterfactual of the whole design: the length as a Python int is one graph per value."""
    step = torch.compile(read_prefix, backend="eager", fullgraph=True, dynamic=False)
    x = torch.arange(16.0)
    with count_compiles() as c:
        assert step(x, 3).item() == 3.0
        assert step(x, 5).item() == 10.0
    assert (c.counts.graphs, c.counts.recompiles, c.counts.graph_breaks) == (2, 1, 0)
    with fail_on_recompile():
        assert step(x, 5).item() == 10.0  # warmed up: passes
    with pytest.raises(RecompileError, match="n == "), fail_on_recompile():
        step(x, 7)


def test_device_tensor_length_does_not_recompile() -> None:
    step = torch.compile(read_masked, backend="eager", fullgraph=True, dynamic=False)
    x = torch.arange(16.0)
    step(x, torch.tensor(3))
    with steady_state() as c:
        for n in (1, 5, 16, 0):
            assert step(x, torch.tensor(n)).item() == sum(range(n))
    assert c.counts == CompileCounts(0, 0, 0, 0)


def test_new_graph_inside_fail_on_recompile_fails_at_exit() -> None:
    fresh = torch.compile(read_masked, backend="eager", fullgraph=True, dynamic=False)
    with pytest.raises(CompileRegressionError, match="1 graph"), fail_on_recompile():
        fresh(torch.ones(4), torch.tensor(2))
    torch._dynamo.reset()
    with fail_on_recompile(allow_new_graphs=True) as c:
        fresh(torch.ones(4), torch.tensor(2))
    assert c.counts.graphs == 1


def _breaks(x: torch.Tensor) -> torch.Tensor:
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2


def test_graph_break_is_counted_and_named() -> None:
    f = torch.compile(_breaks, backend="eager")  # fullgraph=False, so the break splits the graph
    match = "graph breaks in the block: .*graph_break"
    with pytest.raises(CompileRegressionError, match=match), assert_no_graph_breaks() as c:
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 4.0))
    assert c.counts.graph_breaks >= 1 and c.counts.graphs == 2


def test_reduce_overhead_on_cpu_tensors_is_a_cudagraph_skip() -> None:
    def bump(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    f = torch.compile(bump, mode="reduce-overhead", fullgraph=True, dynamic=False)
    with pytest.raises(CompileRegressionError, match="1 CUDA-graph skip"), assert_no_cudagraph_skips():
        assert torch.equal(f(torch.ones(4)), torch.full((4,), 3.0))


def test_no_host_sync_is_a_no_op_without_cuda() -> None:
    if host_sync_checks_active():
        pytest.skip("CUDA present: covered by the GPU test")
    with no_host_sync():
        assert torch.ones(2).sum().item() == 2.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_turns_item_into_an_error_on_cuda() -> None:
    x = torch.ones(2, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), no_host_sync():
        x.sum().item()
    assert torch.cuda.get_sync_debug_mode() == 0  # restored
    assert x.sum().item() == 2.0


def test_recompile_limit_raised_never_lowered() -> None:
    names = [dc._config_name(dc._LIMIT_NAMES), dc._config_name(dc._ACCUMULATED_LIMIT_NAMES)]
    assert names[0] in ("recompile_limit", "cache_size_limit")
    saved = {n: getattr(torch._dynamo.config, n) for n in names if n}
    before = dc.recompile_limit()
    try:
        dc.raise_recompile_limit(before + 1000)
        assert dc.recompile_limit() == before + 1000
        dc.raise_recompile_limit(1)
        assert dc.recompile_limit() == before + 1000
    finally:
        for n, v in saved.items():
            setattr(torch._dynamo.config, n, v)
