"""Compiled steps through Generator(compile=True): same tokens as eager, one graph per kind (a symbolic read
length, the CPU default) or per (kind, bucket) (a static one), no more.

Pins:
* on the embedded default model, compiled (inductor, the CPU default settings: a symbolic read length) equals
  eager over whole greedy generations, ragged batches and EOS included, and the cache contents agree within
  float32 tolerance (rules 1-5 survive compilation);
* its warm-up over a 4-rung ladder compiles at most 2 graphs per kind (1 where torch has DynamicInt) with no
  graph break, records every (kind, bucket), and afterwards requests touching every rung compile nothing
  (`steady_state`);
* warm-up leaves the cache and every step buffer exactly as it found them;
* lazily, the graph count equals the (kind, bucket) pairs touched with a static read length, the kinds touched
  with a symbolic one; counterfactuals: with a static read length a ladder with a rung per length (the read
  length as a changing Python int) recompiles inside a warmed-up loop and the guard says so; with a symbolic
  one the same ladder compiles one graph per kind, and the guard still catches a step called over a cache of
  another batch; on a torch without DynamicInt the symbolic read length falls back to automatic dynamic shapes
  (2 graphs per kind, the batch of a regrown cache stays static);
* GPU-marked: no cudagraph skip, replay equals eager, no host sync inside a decode step, flat memory;
* on every device there is (CUDA: inductor and CUDA graphs; CPU: the eager backend, the same flow in seconds):
  live decode steps write the cache with no host sync, the sampling kinds draw what eager draws, bfloat16
  equals eager greedy (up to a rounding tie), a regrown batch captures again, lazy capture compiles at the
  first request;
* torch < 2.13 simulated (no per-compile recompile_limit / isolate_recompiles): the registries raise the
  process-wide limits for two generators in one process; without that raise the limit is hit.
Inductor compiles are slow on this CPU, so one module-scoped compiled generator (the embedded model) serves all
inductor cases; the counting cases use backend="eager" (dynamo's graphs without inductor's code generation).
"""

from __future__ import annotations

import pytest
import torch

from capture import (
    BucketLadder,
    CaptureOptions,
    CaptureReport,
    CompileCounts,
    CompileSettings,
    RecompileError,
    count_compiles,
    steady_state,
)
from capture import _dynamo_counters as dc
from static_decode import Generator, Llama, LlamaConfig, load_model
from static_decode.checkpoints.loading import default_model_path
from static_decode.steps.functions import PAD

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
MAX_LEN, CHUNK, LADDER = 64, 8, (32, 64)
EMBEDDED_LADDER = (16, 32, 48, 64)  # the inductor cases: 4 rungs, one compile per kind covers them all
GREEDY = ("prefill", "first_greedy", "decode_greedy")
PROMPTS = [[5, 9, 2, 7, 7], [3] * 11 + [4, 8], [1, 2]]  # ragged: 5, 13 and 2 tokens, 1-2 prefill chunks
EAGER_BACKEND = CompileSettings(backend="eager")  # a static read length: one graph per (kind, rung)
SYMBOLIC_EAGER = CompileSettings(backend="eager", symbolic_read_len=True)  # one graph per kind
GRAPHS_PER_SYMBOLIC_KIND = 1 if dc.has_dynamic_int() else 2  # without DynamicInt: static first rung, then symbolic




@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


@pytest.fixture(scope="module")
def eager(model: Llama) -> Generator:
    return Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])


@pytest.fixture(scope="module")
def embedded() -> Llama:
    return load_model(default_model_path())


@pytest.fixture(scope="module")
def compiled(embedded: Llama):
    """One inductor-compiled generator over the embedded model (the CPU default settings, greedy kinds warmed up
    front over a 4-rung ladder), the counts of its warm-up, and an eager generator over the same model."""
    torch._dynamo.reset()
    opts = CaptureOptions(buckets=EMBEDDED_LADDER, kinds=GREEDY, progress=False)
    with count_compiles() as c:
        gen = Generator(embedded, max_len=MAX_LEN, chunk_size=CHUNK, batch=3, compile=True, eos_token_ids=[],
                        capture=opts)
    yield gen, c.counts, Generator(embedded, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
    torch._dynamo.reset()


def _state(gen: Generator) -> dict[str, torch.Tensor]:
    return {"lens": gen.cache.lens, "k": gen.cache.k, "v": gen.cache.v} | gen.bufs.tensors()


def _per_kind(gen: Generator) -> dict[str, tuple[int, int]]:
    """kind -> (graphs, buckets) over the runner's records."""
    return CaptureReport(records=gen.capture_records, seconds=0.0).graphs_per_kind()


def test_warm_up_compiles_at_most_two_graphs_per_kind_over_every_bucket(compiled) -> None:
    gen, counts, _ = compiled
    assert gen.runner.settings.symbolic_read_len  # the CPU default
    n = GRAPHS_PER_SYMBOLIC_KIND
    assert gen.runner.regions is not None  # the CPU default: the blocks compile apart (capture.regions)
    assert _per_kind(gen) == {"prefill": (n, 4), "first_greedy": (1, 1), "decode_greedy": (n, 4)}
    # The layer regions: one graph per chunk shape (prefill's chunk, decode's one token), paid by the first pair
    # of each shape and reported apart; every dynamo graph is one of the two kinds.
    regions = {p: r.region_graphs for p, r in gen.runner.records.items() if r.region_graphs}
    top = max(EMBEDDED_LADDER)  # warm-up runs the largest rung first
    assert regions == {("prefill", top): n, ("decode_greedy", top): n}, regions
    assert counts.graphs == 2 * n + 1 + 2 * n <= 2 * len(GREEDY) + 2  # at most 2 per kind, + 1 per region shape
    assert (counts.graph_breaks, counts.cudagraph_skips) == (0, 0)
    records = gen.runner.records
    pairs = [("first_greedy", 0)] + [(k, b) for k in ("prefill", "decode_greedy") for b in EMBEDDED_LADDER]
    assert sorted(records) == sorted(pairs)  # still one record per (kind, bucket): every rung was called
    assert all(r.graph_breaks == 0 and r.graphs in (0, 1) for r in records.values())


def test_compiled_equals_eager_over_whole_ragged_generations(compiled) -> None:
    gen, _, eager = compiled
    with steady_state():
        got = gen.generate(PROMPTS, 40, stop_at_eos=False)
    want = eager.generate(PROMPTS, 40, stop_at_eos=False)
    assert got == want and [len(r) for r in got] == [40, 40, 40]
    # The cache the compiled steps wrote (all rows, every live position) agrees with the eager one.
    assert gen.cache.host_lens.tolist() == eager.cache.host_lens.tolist()
    for b, n in enumerate(gen.cache.host_lens):
        for name in ("k", "v"):
            a, e = getattr(gen.cache, name)[:, b, :, :n], getattr(eager.cache, name)[:, b, :, :n]
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_any_length_after_warm_up_compiles_nothing(compiled, monkeypatch) -> None:
    """Requests touching every rung, prefill and decode alike, run on the graphs of the warm-up."""
    gen, _, eager = compiled
    called: set[tuple[str, int]] = set()
    step = gen.runner.step

    def spy(kind: str, read_len: int):
        called.add((kind, read_len))
        return step(kind, read_len)

    monkeypatch.setattr(gen.runner, "step", spy)
    requests = [([7], 63), ([2] * 50, 14), ([9] * 31 + [1], 1), ([4, 4], 30), ([1] * 33, 20)]
    with steady_state(host_sync=False) as c:
        got = [gen.generate(p, n, stop_at_eos=False) for p, n in requests]
    assert c.counts == CompileCounts(0, 0, 0, 0)
    assert got == [eager.generate(p, n, stop_at_eos=False) for p, n in requests]
    assert called == set(gen.runner.records)  # every (kind, rung) of the ladder was run


def test_rows_stop_at_eos_like_eager(compiled) -> None:
    gen, _, eager = compiled
    full = eager.generate(PROMPTS, 24, stop_at_eos=False)
    eos = full[1][6]  # row 1 emits it at its 7th token (maybe other rows earlier or never)
    saved = gen.eos_token_ids, eager.eos_token_ids
    gen.eos_token_ids = eager.eos_token_ids = (eos,)
    try:
        with steady_state():
            got = gen.generate(PROMPTS, 24)
        want = eager.generate(PROMPTS, 24)
    finally:
        gen.eos_token_ids, eager.eos_token_ids = saved
    assert got == want
    # each row ends at its first EOS (included), or runs to max_new_tokens
    assert got == [row[: row.index(eos) + 1] if eos in row else row for row in full]
    assert got[1][-1] == eos and len(got[1]) <= 7


def _lazy(model: Llama, ladder, settings: CompileSettings = EAGER_BACKEND, **kw) -> Generator:
    opts = CaptureOptions(buckets=ladder, settings=settings, warm_up="lazy", progress=False)
    return Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, compile=True, eos_token_ids=[], capture=opts, **kw)


def test_warm_up_leaves_cache_and_buffers_untouched(model: Llama, eager: Generator) -> None:
    torch._dynamo.reset()
    gen = _lazy(model, LADDER, batch=3)
    first = gen.generate(PROMPTS, 10, stop_at_eos=False)  # live, non-trivial state
    before = {k: t.clone() for k, t in _state(gen).items()}
    host = gen.cache.host_lens.copy()
    report = gen.warm_up(progress=False)  # every remaining pair, sampling kinds included
    assert len(report.records) == len(gen.runner.pairs()) - 3  # 3 pairs ran lazily in the request
    for name, t in _state(gen).items():
        if name in ("k", "v"):  # padded K/V goes to the spare row max_len; every real position is as it was
            t, before[name] = t[..., :MAX_LEN, :], before[name][..., :MAX_LEN, :]
        assert torch.equal(t, before[name]), name
    assert (gen.cache.host_lens == host).all()
    assert gen.generate(PROMPTS, 10, stop_at_eos=False) == first == eager.generate(PROMPTS, 10, stop_at_eos=False)
    torch._dynamo.reset()


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_lazy_graph_count_follows_the_pairs_or_kinds_touched(model: Llama, eager: Generator, symbolic: bool) -> None:
    """Static read length: one graph per (kind, rung) touched. Symbolic: one per kind touched (at most 2 without
    DynamicInt), the pairs after a kind's first recorded with 0 graphs."""
    torch._dynamo.reset()
    ladder = BucketLadder((16, 32, 48, 64))
    gen = _lazy(model, ladder, settings=SYMBOLIC_EAGER if symbolic else EAGER_BACKEND)
    with count_compiles() as c:
        gen.generate([3] * 5, 8, stop_at_eos=False)  # prefill reads 5 -> 16; decode up to 5 + 8 -> 16
    assert c.counts.graphs == 3 and set(gen.runner.records) == {
        ("prefill", 16), ("first_greedy", 0), ("decode_greedy", 16)}
    with count_compiles() as c:
        got = gen.generate([3] * 20, 20, stop_at_eos=False)  # prefill chunks end at 8, 16, 20; decode up to 40
    touched = {("prefill", b) for b in ladder.touched([8, 16, 20])} | {
        ("decode_greedy", b) for b in ladder.touched(range(21, 40))}
    assert touched == {("prefill", 16), ("prefill", 32), ("decode_greedy", 32), ("decode_greedy", 48)}
    new_pairs = touched - {("prefill", 16)}
    if symbolic:  # prefill 32 and decode 32 reuse their kind's graph; decode 48 too, once the kind is symbolic
        assert c.counts.graphs == {1: 0, 2: 2}[GRAPHS_PER_SYMBOLIC_KIND]
        assert all(gen.runner.records[p].graphs == 0 for p in new_pairs) or not dc.has_dynamic_int()
        assert all(g <= 2 for g, _ in _per_kind(gen).values())
    else:
        assert c.counts.graphs == len(new_pairs) == 3
    assert len(gen.runner.records) == 6
    assert got == eager.generate([3] * 20, 20, stop_at_eos=False)
    torch._dynamo.reset()


def test_counterfactual_static_rung_per_length_recompiles_and_guard_catches_it(model: Llama) -> None:
    """A static read length that is exactly the live length (a new Python int each step) is a new graph per
    token."""
    torch._dynamo.reset()
    gen = _lazy(model, BucketLadder(tuple(range(1, MAX_LEN + 1))))
    gen.generate([3] * 5, 4, stop_at_eos=False)  # "warm": lengths 5..8
    with pytest.raises(RecompileError), steady_state():
        gen.generate([3] * 5, 6, stop_at_eos=False)  # reaches length 9, 10: not compiled yet
    torch._dynamo.reset()


@pytest.mark.skipif(not dc.has_dynamic_int(), reason="needs torch's DynamicInt (torch >= 2.9)")
def test_symbolic_rung_per_length_compiles_once_per_kind_and_guard_still_catches_a_new_batch(
    model: Llama, eager: Generator
) -> None:
    """With a symbolic read length the same rung-per-length ladder is one graph per kind: lengths never seen before
    compile nothing. What the guard still catches: a warmed-up step called over a cache and buffers of another
    batch (another shape, as a regrown cache would have) recompiles, and steady_state raises."""
    torch._dynamo.reset()
    gen = _lazy(model, BucketLadder(tuple(range(1, MAX_LEN + 1))), settings=SYMBOLIC_EAGER)
    gen.generate([3] * 5, 4, stop_at_eos=False)  # prefill at 5, decode at 6..8
    assert _per_kind(gen) == {"prefill": (1, 1), "first_greedy": (1, 1), "decode_greedy": (1, 3)}
    with steady_state(host_sync=False) as c:
        got = gen.generate([3] * 5, 40, stop_at_eos=False)  # lengths 9..45: new rungs, no new graph
    assert (c.counts.graphs, c.counts.recompiles) == (0, 0)
    assert got == eager.generate([3] * 5, 40, stop_at_eos=False)
    other = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, batch=2, eos_token_ids=[])
    other.generate([[3] * 5, [4] * 5], 2, stop_at_eos=False)
    step = gen.step_fn("decode_greedy", 16)
    with pytest.raises(RecompileError), steady_state(host_sync=False):
        step(model, other.cache, other.bufs, 16)
    torch._dynamo.reset()


def test_without_dynamic_int_symbolic_falls_back_to_two_graphs_per_kind_and_a_static_batch(
    model: Llama, eager: Generator, monkeypatch
) -> None:
    """torch < 2.9 simulated (no DynamicInt): automatic dynamic shapes make the read length symbolic at a kind's
    second rung. Every tensor is marked static, so a regrown cache (batch 1 -> 3: shapes that changed between two
    compiles of the same step code) compiles static shapes again rather than a symbolic batch."""
    monkeypatch.setattr(dc, "dynamic_int_type", lambda: None)
    torch._dynamo.reset()
    ladder = BucketLadder((16, 32, 48, 64))
    gen = _lazy(model, ladder, settings=SYMBOLIC_EAGER)
    requests = [([3] * 40, 20), ([[3] * 5, [4] * 30, [1, 2]], 30), ([[3] * 50, [4] * 3], 14)]
    with count_compiles() as c:
        for prompts, n in requests[:2]:
            assert gen.generate(prompts, n, stop_at_eos=False) == eager.generate(prompts, n, stop_at_eos=False)
    assert gen.cache.batch == 3 and all(g <= 2 for g, _ in _per_kind(gen).values())  # the regrown runner's
    assert c.counts.graphs <= 2 * 2 * len(GREEDY)  # two runners, at most 2 graphs per kind each
    with steady_state(host_sync=False):
        assert gen.generate(*requests[2], stop_at_eos=False) == eager.generate(*requests[2], stop_at_eos=False)
    # The regrown runner's graphs are static in the batch: buffers of batch 2 (past the 0/1 specialisation, so a
    # symbolic batch would take them) fail a guard.
    other = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, batch=2, eos_token_ids=[])
    other.generate([[3] * 5, [4] * 5], 2, stop_at_eos=False)
    for kind in ("prefill", "decode_greedy"):
        with pytest.raises(RecompileError), steady_state(host_sync=False):
            gen.step_fn(kind, 64)(model, other.cache, other.bufs, 64)
    torch._dynamo.reset()


def test_registry_refuses_a_read_length_that_is_not_a_bucket(model: Llama) -> None:
    gen = _lazy(model, LADDER, batch=1)
    match = r"read_len=33 for step 'decode_greedy' is not a bucket of the ladder \(32, 64\)"
    with pytest.raises(ValueError, match=match):
        gen.runner.step("decode_greedy", 33)
    with pytest.raises(KeyError, match="no step kind 'decode_fast'"):
        gen.runner.step("decode_fast", 32)
    with pytest.raises(ValueError, match="length 65 exceeds the cache capacity max_len=64"):
        gen.read_len(65)


def test_generator_warm_up_takes_kinds_and_buckets(model: Llama) -> None:
    """The public capture accessors: warm up chosen (kind, bucket) pairs now; records list what exists."""
    torch._dynamo.reset()
    gen = _lazy(model, BucketLadder((16, 32, 48, 64)))
    assert gen.capture_records == []
    with count_compiles() as c:
        report = gen.warm_up(["decode_greedy", "first_greedy"], buckets=[20, 30, 64], progress=False)
    pairs = [(r.kind, r.read_len) for r in report.records]
    assert pairs == [("decode_greedy", 64), ("decode_greedy", 32), ("first_greedy", 0)]  # 20, 30 -> rung 32
    assert c.counts.graphs == 3 and sorted(pairs) == sorted((r.kind, r.read_len) for r in gen.capture_records)
    assert gen.warm_up(["decode_greedy"], buckets=[32], progress=False).records == []  # already captured
    with pytest.raises(ValueError, match="needs Generator"):
        Generator(model, max_len=MAX_LEN).warm_up()
    assert Generator(model, max_len=MAX_LEN, batch=1).capture_records == []
    torch._dynamo.reset()


def test_warm_up_with_the_cuda_graph_call_count_stays_inside_the_buffers(model: Llama, monkeypatch) -> None:
    """Under CUDA graphs each pair is called 3 times in one scratch context. With max_len 4 (a 2-token prompt,
    2 new tokens) every kind at every bucket makes 12 emitting calls into a 4-column output: without a reset of
    the output index they scatter past its end (a device-side assert on CUDA). Simulated on the CPU."""
    from capture.registry import CUDAGRAPH_WARMUP_CALLS, StepRegistry

    monkeypatch.setattr(StepRegistry, "warm_up_calls", property(lambda self: CUDAGRAPH_WARMUP_CALLS))
    torch._dynamo.reset()
    opts = CaptureOptions(settings=EAGER_BACKEND, progress=False)  # warm_up="all": every kind, every bucket
    gen = Generator(model, max_len=4, chunk_size=2, batch=1, compile=True, eos_token_ids=[], capture=opts)
    assert len(gen.capture_records) == len(gen.runner.pairs()) >= 5
    assert not gen.bufs.step.any() and (gen.bufs.out == 0).all()  # warm-up left no trace
    ref = Generator(model, max_len=4, chunk_size=2, eos_token_ids=[])
    assert gen.generate([1, 2], 2) == ref.generate([1, 2], 2)
    assert gen.generate([1, 2], 2, temperature=0.9, seed=1) == ref.generate([1, 2], 2, temperature=0.9, seed=1)
    torch._dynamo.reset()


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
    from capture import _dynamo_counters as dc
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
    from capture import _dynamo_counters as dc

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


# ---- GPU ------------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def cuda_pair():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = Llama(CFG, device="cuda")
    opts = CaptureOptions(buckets=LADDER, kinds=GREEDY, progress=False)
    with count_compiles() as c:
        gen = Generator(m, max_len=MAX_LEN, chunk_size=CHUNK, batch=3, compile=True, eos_token_ids=[], capture=opts)
    yield gen, Generator(m, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[]), c.counts
    torch._dynamo.reset()


@pytest.mark.gpu
@cuda
def test_gpu_cuda_graphs_replay_equals_eager_without_skips(cuda_pair) -> None:
    gen, eager, counts = cuda_pair
    assert gen.runner.cudagraphs and counts.cudagraph_skips == 0 and counts.graph_breaks == 0
    with steady_state(host_sync=False) as c:  # generate reads tokens back: those syncs are by design
        got = gen.generate(PROMPTS, 40, stop_at_eos=False)
    assert c.counts.cudagraph_skips == 0
    assert got == eager.generate(PROMPTS, 40, stop_at_eos=False)


@pytest.mark.gpu
@cuda
def test_gpu_decode_step_has_no_host_sync_and_flat_memory(cuda_pair) -> None:
    gen, _, _ = cuda_pair
    gen.generate(PROMPTS, 4, stop_at_eos=False)
    step = gen.step_fn("decode_greedy", LADDER[0])
    args = (gen.model, gen.cache, gen.bufs, LADDER[0])
    gen.bufs.done.fill_(True)  # nothing appended, so 1,000 steps stay inside the cache
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with steady_state():  # includes no_host_sync(): any synchronising call in a step raises
        for i in range(1000):
            if i % 50 == 0:
                gen.bufs.step.zero_()  # keep the output index inside bufs.out (a device write, no sync)
            step(*args)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


# ---- the same checks on every device there is: CUDA (inductor, CUDA graphs) and the CPU (the flow, fast) ----------
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])]


def _settings(device: str) -> CompileSettings | None:
    """CUDA: the device default (reduce-overhead: inductor kernels replayed as CUDA graphs). CPU: dynamo's graphs
    without inductor, so each check runs in seconds here (the CPU inductor numerics are pinned further up)."""
    return None if device == "cuda" else EAGER_BACKEND


@pytest.fixture
def device_pair(request):
    """(compiled, eager) generators over one model: on CUDA the module's `cuda_pair`; on the CPU a lazily compiled
    one. No torch._dynamo.reset() here: it would drop the graphs `cuda_pair` captured for the CUDA cases."""
    if request.param == "cuda":
        gen, eager, _ = request.getfixturevalue("cuda_pair")
        return gen, eager
    return _lazy(request.getfixturevalue("model"), LADDER, batch=3), request.getfixturevalue("eager")


def _equal_up_to_near_ties(model: Llama, prompts, got, want, *, ulps: int = 4) -> None:
    """Each row of `got` equals `want`, or equals it up to a first difference where the two tokens are a near tie
    of the eager logits there (within `ulps` of the model dtype at the logits' scale, both at the top): inductor's
    fused kernels round low-precision intermediates in another order than eager, which may flip such a tie;
    after it the continuations differ and are not compared. A real difference (a token well below the best) fails.
    """
    for b, (p, g, w) in enumerate(zip(prompts, got, want, strict=True)):
        assert len(g) == len(w), (b, g, w)
        if g == w:
            continue
        i = next(j for j, (x, y) in enumerate(zip(g, w, strict=True)) if x != y)
        tokens = list(p) + list(w[:i])
        with torch.no_grad():
            logits = model(torch.tensor([tokens], device=model.device), model.new_cache(1, len(tokens)),
                           [len(tokens)])[0, -1].float()
        tol = ulps * torch.finfo(model.dtype).eps * max(1.0, logits.abs().max().item())
        top = logits.max().item()
        gaps = [top - logits[g[i]].item(), top - logits[w[i]].item()]
        assert max(gaps) <= tol, f"row {b} differs at token {i}: {g[i]} vs {w[i]}, {gaps} below the best > {tol}"


def test_near_tie_comparison_refuses_a_real_difference(model: Llama, eager: Generator) -> None:
    want = eager.generate(PROMPTS, 6, stop_at_eos=False)
    _equal_up_to_near_ties(model, PROMPTS, want, want)
    bad = [list(row) for row in want]
    bad[1][2] = (bad[1][2] + 1) % CFG.vocab_size  # float32: another token is never within 4 ulps of the best
    with pytest.raises(AssertionError, match="row 1 differs at token 2"):
        _equal_up_to_near_ties(model, PROMPTS, bad, want)


@pytest.mark.parametrize("device_pair", DEVICES, indirect=True)
def test_live_decode_steps_write_the_cache_without_host_sync(device_pair) -> None:
    """Every row live (not done): each captured decode step appends one token per row (the cache write inside the
    graph), reads its bucket and emits. Every 20 steps the lengths, the output index and `done` are reset by
    device writes (no host sync), so the rows stay inside the bucket: 8 -> 28 of 32. On CUDA no step syncs with
    the host and memory stays flat over 1,000 steps."""
    gen, _ = device_pair
    gen.generate(PROMPTS, 4, stop_at_eos=False)  # compiles what it needs (lazily on the CPU); fills the cache
    cache, bufs = gen.cache, gen.bufs
    read_len, base, span = LADDER[0], 8, 20
    step = gen.step_fn("decode_greedy", read_len)
    args = (gen.model, cache, bufs, read_len)
    for t in (cache.k, cache.v):
        t[..., base : base + span, :] = 0  # the positions the steps write: all of them must change
    on_cuda = cache.device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    with steady_state():  # includes no_host_sync() on CUDA: any synchronising call in a step raises
        for i in range(1000 if on_cuda else 100):
            if i % span == 0:
                cache.lens.fill_(base)
                bufs.step.zero_()
                bufs.limit.fill_(span + 1)  # the last request's max_new_tokens (4) would end the rows early
                bufs.done.fill_(False)
            step(*args)
    if on_cuda:
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
    assert cache.lens.tolist() == [base + span] * cache.batch  # every row appended at every step
    for t in (cache.k, cache.v):  # every layer, row, head and position written since the last reset
        assert (t[..., base : base + span, :] != 0).any(dim=-1).all()
    assert (bufs.out[:, :span] != PAD).all() and not bufs.done.any()
    cache.reset()  # the host mirror no longer matches the device lengths


@pytest.mark.parametrize("device_pair", DEVICES, indirect=True)
def test_sampling_kinds_compiled_equal_eager_token_for_token(device_pair) -> None:
    """temperature > 0 with a seed (top-k and top-p on): the `first` and `decode` graphs draw what eager draws."""
    gen, eager = device_pair
    kw = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 1234, "stop_at_eos": False}
    with count_compiles() as c:  # on CUDA prefill is captured already; the CPU generator compiles lazily
        gen.warm_up(["prefill", "first", "decode"], progress=False)
    assert (c.counts.graph_breaks, c.counts.cudagraph_skips) == (0, 0) and not gen.runner.fallbacks
    with steady_state(host_sync=False):
        got = gen.generate(PROMPTS, 40, **kw)
        other = gen.generate(PROMPTS, 40, **{**kw, "seed": 4321})
    assert got == eager.generate(PROMPTS, 40, **kw)
    assert other == eager.generate(PROMPTS, 40, **{**kw, "seed": 4321}) and other != got  # the seed is used
    assert got != eager.generate(PROMPTS, 40, stop_at_eos=False)  # and it is not greedy


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_compiled_equals_eager_greedy(device: str) -> None:
    torch.manual_seed(0)
    m = Llama(CFG, dtype=torch.bfloat16, device=device)
    opts = CaptureOptions(buckets=(MAX_LEN,), settings=_settings(device), kinds=GREEDY, progress=False)
    with count_compiles() as c:
        gen = Generator(m, max_len=MAX_LEN, chunk_size=CHUNK, batch=3, compile=True, eos_token_ids=[], capture=opts)
    assert (c.counts.graphs, c.counts.graph_breaks, c.counts.cudagraph_skips) == (3, 0, 0)
    assert gen.runner.cudagraphs == (device == "cuda") and not gen.runner.fallbacks
    eager = Generator(m, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
    with steady_state(host_sync=False):
        got = gen.generate(PROMPTS, 24, stop_at_eos=False)
    _equal_up_to_near_ties(m, PROMPTS, got, eager.generate(PROMPTS, 24, stop_at_eos=False))


@pytest.mark.parametrize("device", DEVICES)
def test_regrowth_captures_for_the_bigger_batch_and_still_equals_eager(device: str) -> None:
    """No fixed batch: a 1-row request allocates (and captures) for 1 row; a 3-row request regrows the cache and
    captures again over the new buffers (no cudagraph skip, no fallback); a 2-row request then fits: nothing
    compiles."""
    torch.manual_seed(0)
    m = Llama(CFG, device=device)
    opts = CaptureOptions(buckets=(MAX_LEN,), settings=_settings(device), kinds=GREEDY, progress=False)
    gen = Generator(m, max_len=MAX_LEN, chunk_size=CHUNK, compile=True, eos_token_ids=[], capture=opts)
    eager = Generator(m, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
    with count_compiles() as c:
        one = gen.generate(PROMPTS[1], 20, stop_at_eos=False)
        small, small_fallbacks = gen.runner, gen.runner.fallbacks  # the regrowth closes this runner
        assert gen.cache.batch == 1 and len(gen.capture_records) == 3
        three = gen.generate(PROMPTS, 20, stop_at_eos=False)
    assert gen.cache.batch == 3 and gen.runner is not small
    assert (c.counts.graphs, c.counts.graph_breaks, c.counts.cudagraph_skips) == (6, 0, 0)
    assert not small_fallbacks and not gen.runner.fallbacks and gen.runner.cudagraphs == (device == "cuda")
    assert len(gen.capture_records) == 3  # the new runner's own (kind, rung) pairs, captured over the new cache
    assert one == eager.generate(PROMPTS[1], 20, stop_at_eos=False)
    assert three == eager.generate(PROMPTS, 20, stop_at_eos=False)
    with steady_state(host_sync=False):
        two = gen.generate(PROMPTS[:2], 20, stop_at_eos=False)
    assert gen.cache.batch == 3 and two == eager.generate(PROMPTS[:2], 20, stop_at_eos=False)


@pytest.mark.parametrize("device", DEVICES)
def test_lazy_capture_compiles_at_the_first_request_and_equals_eager(device: str) -> None:
    torch.manual_seed(0)
    m = Llama(CFG, device=device)
    opts = CaptureOptions(buckets=LADDER, settings=_settings(device), warm_up="lazy", progress=False)
    gen = Generator(m, max_len=MAX_LEN, chunk_size=CHUNK, batch=3, compile=True, eos_token_ids=[], capture=opts)
    eager = Generator(m, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])
    assert gen.capture_records == []
    with count_compiles() as c:
        got = gen.generate(PROMPTS, 24, stop_at_eos=False)  # prefill chunks end at 8, 13; decode: 14..36
    touched = {("prefill", 32), ("first_greedy", 0), ("decode_greedy", 32), ("decode_greedy", 64)}
    assert set(gen.runner.records) == touched and c.counts.graphs == len(touched)
    assert (c.counts.graph_breaks, c.counts.cudagraph_skips) == (0, 0) and not gen.runner.fallbacks
    assert got == eager.generate(PROMPTS, 24, stop_at_eos=False)
    with steady_state(host_sync=False):  # the same pairs: nothing compiles (CUDA graphs record, then replay)
        assert gen.generate(PROMPTS, 24, stop_at_eos=False) == got
