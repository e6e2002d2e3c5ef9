"""Per-kind eager fallback of the step registry, and the compile settings chosen for collectives.

Pins: with fallback on, a kind that cannot compile (here: a graph break under fullgraph, standing in for a
collective a backend cannot hold) runs its eager step with the same results, every one of its records names
the reason, the other kinds stay compiled, and capture-report's table and --check show it; with fallback
off (the default outside tensor parallelism) the same failure raises. Steps whose all-reduces run on NCCL are
captured as CUDA graphs; on any other backend (gloo on CUDA tensors) they are compiled without them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from capture import BucketLadder, CaptureOptions, CaptureReport, CompileSettings, StepRegistry

LADDER = BucketLadder((4, 8))


def _good(x: torch.Tensor, out: torch.Tensor, read_len: int) -> None:
    out.copy_(x[:read_len].sum() * 2)


def _breaks(x: torch.Tensor, out: torch.Tensor, read_len: int) -> None:
    y = x[:read_len].sum()
    torch._dynamo.graph_break()  # fullgraph=True makes this a compile error
    out.copy_(y + 1)


def _registry(fallback: bool) -> tuple[StepRegistry, torch.Tensor, torch.Tensor]:
    torch._dynamo.reset()
    x, out = torch.arange(8.0), torch.zeros(())
    steps = {"good": _good, "breaks": _breaks}
    settings = CompileSettings(backend="eager")  # dynamo's tracing (where the break is found), no inductor
    return StepRegistry(steps, LADDER, args=(x, out), device="cpu", settings=settings, fallback=fallback), x, out


def test_a_kind_that_cannot_compile_runs_eagerly_and_says_why():
    registry, x, out = _registry(fallback=True)
    report = registry.warm_up(progress=False)
    assert set(registry.fallbacks) == {"breaks"}
    for r in report.records:
        if r.kind == "breaks":
            assert r.fallback.startswith("Unsupported: ") and "graph_break" in r.fallback, r.fallback
        else:
            assert (r.fallback, r.graphs, r.graph_breaks) == ("", 1, 0)
    for read_len in LADDER.lengths:  # eager results, and the good kind is still right
        registry.step("breaks", read_len)(x, out, read_len)
        assert out.item() == x[:read_len].sum().item() + 1
        registry.step("good", read_len)(x, out, read_len)
        assert out.item() == 2 * x[:read_len].sum().item()
    assert report.fallbacks == {"breaks": registry.fallbacks["breaks"]}
    assert "fell back to eager" in report.summary()
    table = report.table()
    runs = table.columns[-1]
    assert [c.startswith("eager (") for c in runs._cells] == [r.kind == "breaks" for r in report.records]

    # --check: a baseline where the kind compiled differs on the fallback field, naming the pair.
    clean = CaptureReport(records=[dataclasses.replace(r, fallback="") for r in report.records], seconds=0.0)
    diffs = report.differences(clean)
    assert diffs and all(d.startswith("breaks @ ") and "fallback" in d for d in diffs)
    again = CaptureReport.from_json(report.to_json())  # JSON keeps the reason
    assert [r.fallback for r in again.records] == [r.fallback for r in report.records]


def test_without_fallback_the_failure_raises():
    registry, x, out = _registry(fallback=False)
    with pytest.raises(Exception, match="(?i)graph.?break|Unsupported"):
        registry.warm_up(progress=False)
    assert registry.fallbacks == {}


def test_lazy_first_call_falls_back_too():
    registry, x, out = _registry(fallback=True)
    registry.step("breaks", 8)(x, out, 8)  # compiles at the first real call, fails, runs eagerly
    assert out.item() == x.sum().item() + 1
    assert registry.records[("breaks", 8)].fallback == registry.fallbacks["breaks"]


def test_collectives_backend_decides_cuda_graphs():
    cuda = torch.device("cuda")
    assert CompileSettings.for_device(cuda).cudagraphs(cuda)
    assert CompileSettings.for_device(cuda, collectives="nccl").cudagraphs(cuda)  # NCCL is capturable
    gloo = CompileSettings.for_device(cuda, collectives="gloo")
    assert not gloo.cudagraphs(cuda) and gloo.mode is None  # inductor without CUDA graphs
    assert CompileSettings.for_device("cpu", collectives="gloo") == CompileSettings.for_device("cpu")


def test_capture_options_fallback_is_a_bool_or_none():
    assert CaptureOptions().fallback is None
    with pytest.raises(TypeError, match="fallback"):
        CaptureOptions(fallback="yes")
