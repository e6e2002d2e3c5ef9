"""The CUDA capture settings, resolved for device "cuda" on a machine without a GPU (nothing runs on a device).

Pins: one compile per step kind on CUDA (the read length symbolic, passed as a DynamicInt at every call, CUDA
graphs recorded per rung: three warm-up calls), the CUDA ladder (few rungs, its read bound, whole split-key
blocks), the torch.compile arguments the settings produce, the compile cache's CUDA layout (Triton's cache and the
portable artifacts in the directory), and the registry's retry: a compile that fails with a key-splitting attention
formulation compiles again with the next one instead of falling back to an eager step.
"""

from __future__ import annotations

import os

import pytest
import torch

from capture import BucketLadder, CompileSettings
from capture import _dynamo_counters as dc
from capture.compile_cache import CompileCache
from capture.registry import StepRegistry
from capture.settings import RECOMPILE_HEADROOM
from static_decode.core.split_attention import SPLIT_BLOCK


def test_cuda_default_is_one_compile_per_kind() -> None:
    s = CompileSettings.for_device("cuda")
    assert (s.mode, s.symbolic_read_len, s.layer_regions, s.fused_decode, s.dynamic) == (
        "reduce-overhead", True, 0, False, False)
    assert s.cudagraphs("cuda") and not s.cudagraphs("cpu")
    gloo = CompileSettings.for_device("cuda", collectives="gloo")  # host collectives: no CUDA graphs
    assert gloo.symbolic_read_len and not gloo.cudagraphs("cuda")
    assert CompileSettings.for_device("cuda", collectives="nccl") == s
    assert "symbolic read_len" in s.describe()


def test_cuda_compile_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_compile(fn, **kwargs):
        seen.update(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    CompileSettings.for_device("cuda").compile(lambda x: x, graphs=9, symbolic=True)
    assert seen["mode"] == "reduce-overhead" and seen["fullgraph"] is True and "options" not in seen
    # DynamicInt makes only the read length symbolic; without it automatic dynamic shapes do (dynamic=None).
    assert seen["dynamic"] is (False if dc.has_dynamic_int() else None)
    if "recompile_limit" in seen:
        assert seen["recompile_limit"] == 9 + RECOMPILE_HEADROOM
    tuned = CompileSettings(options={"triton.cudagraphs": True, "coordinate_descent_tuning": True},
                            symbolic_read_len=True)
    assert tuned.cudagraphs("cuda")
    seen.clear()
    tuned.compile(lambda x: x, graphs=1, symbolic=True)
    assert seen["options"] == {"triton.cudagraphs": True, "coordinate_descent_tuning": True} and "mode" not in seen


@pytest.mark.parametrize("max_len", [2048, 32768, 131072])
def test_cuda_ladder(max_len: int) -> None:
    ladder = BucketLadder.of(None, max_len, fine=True, device_type="cuda")
    assert ladder == BucketLadder.cuda(max_len) and ladder.max_len == max_len
    assert len(ladder) < len(BucketLadder.default(max_len)) < len(BucketLadder.fine(max_len))
    if max_len == 32768:
        assert len(ladder) == 9  # the H200 run's default had 12 at 32k
    for r in ladder.lengths[:-1]:
        assert r % 1024 == 0 and r % SPLIT_BLOCK == 0  # whole blocks for split_key: one symbolic graph
    for live in range(1, max_len + 1, 97):
        assert live <= ladder.bucket_for(live) < 1.5 * live + 1024
    assert BucketLadder.of(None, 2048, fine=True) == BucketLadder.fine(2048)  # the CPU keeps its fine ladder


def test_registry_on_cuda_settings(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A StepRegistry for device "cuda" with the CUDA defaults (built without a GPU): every bucketed kind symbolic,
    CUDA graphs (three warm-up calls), the formulation retry on; each call passes the read length as a DynamicInt
    and begins a new CUDA-graph step."""
    calls = []
    steps = {"decode": lambda buf, n: calls.append(n), "first": lambda buf, n: calls.append(n)}
    cache = CompileCache(tmp_path / "cc", "cuda")
    reg = StepRegistry(steps, BucketLadder.cuda(32768), args=(torch.zeros(2),), device="cuda",
                       settings=CompileSettings.for_device("cuda"), unbucketed=("first",), compile_cache=cache)
    assert reg.cudagraphs and reg.warm_up_calls == 3 and reg.formulation_retry
    assert reg.symbolic == {"decode"}
    reg._compiled = dict(steps)  # stand-ins for the compiled steps: record what they are called with
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    reg._runner("decode")(torch.zeros(2), 3072)
    reg._runner("first")(torch.zeros(2), 3072)
    assert calls == [3072, 0] and len(marks) == 2
    if dc.has_dynamic_int():
        assert isinstance(calls[0], dc.dynamic_int_type())
    assert not isinstance(calls[1], dc.dynamic_int_type() or ())


def test_compile_cache_layout_on_cuda(tmp_path) -> None:
    cache = CompileCache(tmp_path / "cc", "cuda")
    assert cache.artifacts and cache.triton_dir == tmp_path / "cc" / "triton"
    assert not cache.load()  # nothing saved yet: nothing loaded, no error
    before = (os.environ.get("TRITON_CACHE_DIR"), os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    with cache.active():
        assert os.environ["TRITON_CACHE_DIR"] == str((tmp_path / "cc" / "triton").resolve())
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cc" / "inductor").resolve())
    assert (os.environ.get("TRITON_CACHE_DIR"), os.environ.get("TORCHINDUCTOR_CACHE_DIR")) == before
    cpu = CompileCache(tmp_path / "cc", "cpu")
    assert not cpu.artifacts and cpu.triton_dir is None


def test_a_failing_formulation_compiles_again_with_the_next() -> None:
    """The retry on CUDA, simulated: a step that cannot compile while flex is in use (then while split_key is)
    is called again with a model view that resolves past it, records no eager fallback, and names what gave way;
    another kind keeps the model it was given."""

    class Model:
        attn_skip: tuple[str, ...] = ()

        def skipping(self, impls: tuple[str, ...]) -> Model:
            view = Model()
            view.attn_skip = tuple(impls)
            return view

    def step(model: Model, buf: torch.Tensor, n: int) -> None:
        if "flex" not in model.attn_skip:
            raise RuntimeError("LoweringException: flex_decoding\nmore")
        buf.fill_(2.0 if "split_key" not in model.attn_skip else 3.0)

    seen: list[tuple[str, ...]] = []
    buf, model = torch.zeros(1), Model()
    steps = {"decode": step, "prefill": lambda m, b, n: seen.append(m.attn_skip)}
    reg = StepRegistry(steps, BucketLadder((64,)), args=(model, buf), device="cpu",
                       settings=CompileSettings(backend="eager"), fallback=True)
    reg.formulation_retry = True  # what device "cuda" sets
    reg._compiled = dict(steps)
    reg._runners = {k: reg._runner(k) for k in steps}
    report = reg.warm_up(progress=False)
    assert float(buf) == 2.0 and all(r.fallback == "" for r in report.records) and reg.fallbacks == {}
    assert reg.formulation_fallbacks == {"decode": {"flex": "RuntimeError: LoweringException: flex_decoding"}}
    assert seen == [()] and model.attn_skip == ()
    view = reg._view("decode", model)
    assert view is reg._view("decode", model) and view.attn_skip == ("flex",)  # one view, so its graph is reused


def test_no_formulation_left_falls_back_or_raises() -> None:
    def step(buf: torch.Tensor, n: int) -> None:
        raise RuntimeError("broken")

    reg = StepRegistry({"decode": step}, BucketLadder((64,)), args=(torch.zeros(1),), device="cpu",
                       settings=CompileSettings(backend="eager"), fallback=False)
    reg.formulation_retry = True
    reg.formulation_fallbacks = {"decode": {"flex": "x", "split_key": "y"}}
    reg._view = lambda kind, model: model  # type: ignore[method-assign]
    reg._compiled = {"decode": step}
    reg._runners = {"decode": reg._runner("decode")}
    with pytest.raises(RuntimeError, match="broken"):
        reg.warm_up(progress=False)
