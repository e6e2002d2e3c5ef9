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
* the devices (CUDA and the CPU flow) are in test_capture_devices.py, the limits without torch's per-compile
  limits and the regrowth in test_compile_limits.py.
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
    RecompileError,
    count_compiles,
    steady_state,
)
from capture import _dynamo_counters as dc
from static_decode import Generator, Llama, load_model
from static_decode.checkpoints.loading import default_model_path
from tests.support.compiled_cases import (
    CHUNK,
    EAGER_BACKEND,
    EMBEDDED_LADDER,
    GRAPHS_PER_SYMBOLIC_KIND,
    GREEDY,
    LADDER,
    MAX_LEN,
    PROMPTS,
    SYMBOLIC_EAGER,
    lazy,
)


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


def test_warm_up_leaves_cache_and_buffers_untouched(model: Llama, eager: Generator) -> None:
    torch._dynamo.reset()
    gen = lazy(model, LADDER, batch=3)
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
    gen = lazy(model, ladder, settings=SYMBOLIC_EAGER if symbolic else EAGER_BACKEND)
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
    gen = lazy(model, BucketLadder(tuple(range(1, MAX_LEN + 1))))
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
    gen = lazy(model, BucketLadder(tuple(range(1, MAX_LEN + 1))), settings=SYMBOLIC_EAGER)
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
    gen = lazy(model, ladder, settings=SYMBOLIC_EAGER)
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
    gen = lazy(model, LADDER, batch=1)
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
    gen = lazy(model, BucketLadder((16, 32, 48, 64)))
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


