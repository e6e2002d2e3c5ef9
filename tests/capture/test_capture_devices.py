"""Compiled steps on every device there is: CUDA (inductor and CUDA graphs: no cudagraph skip, replay equals eager,
no host sync inside a decode step, flat memory; GPU-marked) and the CPU (the eager backend, the same flow in
seconds): live decode steps write the cache with no host sync, the sampling kinds draw what eager draws, bfloat16
equals eager greedy (up to a rounding tie), a regrown batch captures again, lazy capture compiles at the first
request."""

from __future__ import annotations

import pytest
import torch

from capture import (
    CaptureOptions,
    CompileSettings,
    count_compiles,
    steady_state,
)
from static_decode import Generator, Llama
from static_decode.steps.functions import PAD
from tests.support.compiled_cases import (
    CFG,
    CHUNK,
    EAGER_BACKEND,
    GREEDY,
    LADDER,
    MAX_LEN,
    PROMPTS,
    lazy,
)

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
    return lazy(request.getfixturevalue("model"), LADDER, batch=3), request.getfixturevalue("eager")


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
