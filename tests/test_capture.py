"""Compiled steps through Generator(compile=True): same tokens as eager, one graph per (kind, bucket), no more.

Pins:
* compiled (inductor, the CPU default settings) equals eager over whole greedy generations, ragged batches
  and EOS included, and the cache contents agree within float32 tolerance (rules 1-5 survive compilation);
* warm-up compiles exactly kinds x buckets graphs with no graph break, and afterwards requests of any length up
  to max_len compile nothing (`steady_state`);
* warm-up leaves the cache and every step buffer exactly as it found them;
* lazily, the graph count equals the (kind, bucket) pairs touched; the counterfactual: a ladder with a rung per
  length (the read length as a changing Python int) recompiles inside a warmed-up loop and the guard says so;
* GPU-marked: no cudagraph skip, replay equals eager, no host sync inside a decode step, flat memory.
Inductor compiles are slow on this CPU, so one module-scoped compiled generator serves all inductor cases;
the counting cases use backend="eager" (dynamo's graphs without inductor's code generation).
"""

from __future__ import annotations

import logging

import pytest
import torch

from capture import (
    BucketLadder,
    CaptureOptions,
    CompileCounts,
    CompileSettings,
    RecompileError,
    count_compiles,
    steady_state,
)
from static_decode import Generator, Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
MAX_LEN, CHUNK, LADDER = 64, 8, (32, 64)
GREEDY = ("prefill", "first_greedy", "decode_greedy")
PROMPTS = [[5, 9, 2, 7, 7], [3] * 11 + [4, 8], [1, 2]]  # ragged: 5, 13 and 2 tokens, 1-2 prefill chunks
EAGER_BACKEND = CompileSettings(backend="eager")


@pytest.fixture(scope="module", autouse=True)
def _no_trace_log_capture():
    """pytest's log capture makes torch build its structured compile trace (graph dumps): ~2x compile time."""
    log = logging.getLogger("torch.__trace")
    saved, log.propagate = log.propagate, False
    yield
    log.propagate = saved


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


@pytest.fixture(scope="module")
def eager(model: Llama) -> Generator:
    return Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[])


@pytest.fixture(scope="module")
def compiled(model: Llama):
    """One inductor-compiled generator (greedy kinds warmed up front) and the counts of its warm-up."""
    torch._dynamo.reset()
    opts = CaptureOptions(buckets=LADDER, kinds=GREEDY, progress=False)
    with count_compiles() as c:
        gen = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, batch=3, compile=True, eos_token_ids=[], capture=opts)
    yield gen, c.counts
    torch._dynamo.reset()


def _state(gen: Generator) -> dict[str, torch.Tensor]:
    return {"lens": gen.cache.lens, "k": gen.cache.k, "v": gen.cache.v} | gen.bufs.tensors()


def test_warm_up_compiles_one_graph_per_kind_and_bucket(compiled) -> None:
    gen, counts = compiled
    assert counts.graphs == 2 * len(LADDER) + 1  # prefill and decode_greedy per bucket, first_greedy once
    assert (counts.graph_breaks, counts.cudagraph_skips) == (0, 0)
    records = gen.runner.records
    pairs = [("first_greedy", 0)] + [(k, b) for k in ("prefill", "decode_greedy") for b in LADDER]
    assert sorted(records) == sorted(pairs)
    assert all(r.graphs == 1 and r.graph_breaks == 0 for r in records.values())


def test_compiled_equals_eager_over_whole_ragged_generations(compiled, eager: Generator) -> None:
    gen, _ = compiled
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


def test_any_length_after_warm_up_compiles_nothing(compiled, eager: Generator) -> None:
    gen, _ = compiled
    requests = [([7], 63), ([2] * 50, 14), ([9] * 31 + [1], 1), ([4, 4], 30), ([1] * 33, 20)]
    with steady_state() as c:
        got = [gen.generate(p, n, stop_at_eos=False) for p, n in requests]
    assert c.counts == CompileCounts(0, 0, 0, 0)
    assert got == [eager.generate(p, n, stop_at_eos=False) for p, n in requests]


def test_rows_stop_at_eos_like_eager(compiled, eager: Generator) -> None:
    gen, _ = compiled
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


def _lazy(model: Llama, ladder, **kw) -> Generator:
    opts = CaptureOptions(buckets=ladder, settings=EAGER_BACKEND, warm_up="lazy", progress=False)
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


def test_lazy_graph_count_equals_pairs_touched(model: Llama) -> None:
    torch._dynamo.reset()
    ladder = BucketLadder((16, 32, 48, 64))
    gen = _lazy(model, ladder)
    with count_compiles() as c:
        gen.generate([3] * 5, 8, stop_at_eos=False)  # prefill reads 5 -> 16; decode up to 5 + 8 -> 16
    assert c.counts.graphs == 3 and set(gen.runner.records) == {
        ("prefill", 16), ("first_greedy", 0), ("decode_greedy", 16)}
    with count_compiles() as c:
        gen.generate([3] * 20, 20, stop_at_eos=False)  # prefill chunks end at 8, 16, 20; decode up to 40
    touched = {("prefill", b) for b in ladder.touched([8, 16, 20])} | {
        ("decode_greedy", b) for b in ladder.touched(range(21, 40))}
    assert touched == {("prefill", 16), ("prefill", 32), ("decode_greedy", 32), ("decode_greedy", 48)}
    assert c.counts.graphs == len(touched - {("prefill", 16)}) == 3
    assert len(gen.runner.records) == 6
    torch._dynamo.reset()


def test_counterfactual_rung_per_length_recompiles_and_guard_catches_it(model: Llama) -> None:
    """Reading exactly the live length (a new Python int each step) is a new graph per token."""
    torch._dynamo.reset()
    gen = _lazy(model, BucketLadder(tuple(range(1, MAX_LEN + 1))))
    gen.generate([3] * 5, 4, stop_at_eos=False)  # "warm": lengths 5..8
    with pytest.raises(RecompileError), steady_state():
        gen.generate([3] * 5, 6, stop_at_eos=False)  # reaches length 9, 10: not compiled yet
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
