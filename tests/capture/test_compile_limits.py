"""The recompile limits without torch's per-compile limits (torch 2.11, the GPU machines): the registries raise the
process-wide limits for two generators in one process, and without that raise the limit is hit; and a regrowth
frees the old cache and its graphs."""

from __future__ import annotations

import pytest
import torch

from capture import (
    BucketLadder,
    CaptureOptions,
    CompileSettings,
    count_compiles,
    steady_state,
)
from capture import _dynamo_counters as dc
from static_decode import Generator, Llama
from tests.support.compiled_cases import (
    CHUNK,
    EAGER_BACKEND,
    GREEDY,
    LADDER,
    MAX_LEN,
    PROMPTS,
)


def _without_per_compile_limits(monkeypatch) -> list[dict]:
    """Simulate torch 2.11 (the GPU machines): torch.compile has no recompile_limit / isolate_recompiles, so the
    registries must rely on the process-wide limits. Returns the keyword arguments of every torch.compile call."""
    import capture.settings as cs

    passed: list[dict] = []
    real = torch.compile

    def spy(fn, **kw):
        passed.append(kw)
        return real(fn, **kw)

    monkeypatch.setattr(cs, "_compile_accepts", lambda name: False)
    monkeypatch.setattr(torch, "compile", spy)
    return passed


# Every rung of (16, 32, 64) for prefill and decode_greedy: a 3-token prompt decodes through 16, 32 and 64; a
# 40-token prompt prefills chunks ending at 8..40 (rungs 16, 32, 64).
FALLBACK_LADDER = BucketLadder((16, 32, 64))
FALLBACK_REQUESTS = [([3] * 3, 60), ([7] * 40, 5)]
SMALL_LIMITS = {"recompile_limit": 2, "accumulated_recompile_limit": 4}  # below one generator's 3 rungs


def _fallback_gen(model: Llama, batch: int) -> Generator:
    opts = CaptureOptions(buckets=FALLBACK_LADDER, settings=EAGER_BACKEND, warm_up="lazy", progress=False,
                          fallback=True)  # a limit hit would fall back to eager: visible in records and fallbacks
    return Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, batch=batch, compile=True, eos_token_ids=[],
                     capture=opts)


def test_without_per_compile_limits_the_process_wide_limits_cover_two_generators(
    model: Llama, eager: Generator, monkeypatch
) -> None:
    """torch < 2.13: only the process-wide limits bound each step's graphs. Two generators (batch 1 and 2) touch
    every bucket in one process with the limits set below what one generator needs (3 rungs > 2): the registries
    raise them (graphs of every registry so far + headroom), nothing falls back to eager or hits a limit, and
    the tokens are the eager ones. The counterfactual below shows these limits bite without the raise."""
    from capture import registry
    from capture.settings import RECOMPILE_HEADROOM

    passed = _without_per_compile_limits(monkeypatch)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(**SMALL_LIMITS), count_compiles() as c:
            gens = [_fallback_gen(model, batch) for batch in (1, 2)]
            for gen in gens:
                for prompt, n in FALLBACK_REQUESTS:
                    rows = [prompt] + [[5, 1]] * (gen.cache.batch - 1)
                    assert gen.generate(rows, n, stop_at_eos=False) == eager.generate(rows, n, stop_at_eos=False)
            floor = registry._GRAPHS_REQUESTED + RECOMPILE_HEADROOM
            assert dc.recompile_limit() >= floor and dc.accumulated_recompile_limit() >= floor
    finally:
        torch._dynamo.reset()
    assert passed and all(not {"recompile_limit", "isolate_recompiles"} & set(kw) for kw in passed)
    touched = set(gens[0].runner.pairs(GREEDY))
    for gen in gens:
        assert gen.runner.fallbacks == {} and set(gen.runner.records) == touched
        assert all(r.fallback == "" for r in gen.capture_records)
    assert c.counts.graphs == 2 * len(touched)  # one graph per (kind, rung) per generator, none more


def test_counterfactual_without_the_raise_the_process_wide_limit_is_hit(
    model: Llama, eager: Generator, monkeypatch
) -> None:
    """The same simulation with the registry's raise disabled: the third prefill rung of one generator hits the
    small limit (fullgraph: an error, here caught by fallback), so the test above would fail without it."""

    _without_per_compile_limits(monkeypatch)
    monkeypatch.setattr(dc, "raise_recompile_limit", lambda at_least: None)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(**SMALL_LIMITS):
            gen = _fallback_gen(model, 1)
            prompt, n = FALLBACK_REQUESTS[1]
            assert gen.generate(prompt, n, stop_at_eos=False) == eager.generate(prompt, n, stop_at_eos=False)
    finally:
        torch._dynamo.reset()
    assert "recompile" in gen.runner.fallbacks.get("prefill", "").lower(), gen.runner.fallbacks


@pytest.mark.parametrize("static_addresses", [False, True])
def test_a_regrowth_frees_the_old_cache_and_its_graphs(model: Llama, monkeypatch, static_addresses: bool) -> None:
    """Compiled steps must not keep the cache and buffers they were compiled over alive. Under CUDA graphs those
    tensors are marked static (guarded) and become attributes of the graphs dynamo installs as globals; that
    path is simulated on the CPU by reporting CUDA graphs on (static_addresses=True)."""
    import gc
    import weakref

    if static_addresses:
        monkeypatch.setattr(CompileSettings, "cudagraphs", lambda self, device: True)
    torch._dynamo.reset()
    opts = CaptureOptions(buckets=LADDER, settings=EAGER_BACKEND, kinds=GREEDY, progress=False)
    gen = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, compile=True, eos_token_ids=[], capture=opts)
    other = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, compile=True, eos_token_ids=[], capture=opts)
    want = other.generate(PROMPTS, 6)
    gen.generate(PROMPTS[0], 6)
    old = [weakref.ref(t) for t in (gen.cache.k, gen.cache.v, gen.cache.lens, *gen.bufs.tensors().values())]
    old_runner = weakref.ref(gen.runner)
    assert gen.generate(PROMPTS, 6) == want  # 3 rows: the cache regrows
    gc.collect()
    assert old_runner() is None and all(r() is None for r in old), "the old cache or buffers are still alive"
    with steady_state(host_sync=False):  # the other generator's graphs were not touched by the cleanup
        assert other.generate(PROMPTS, 6) == want
    torch._dynamo.reset()


