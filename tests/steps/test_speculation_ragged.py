"""Speculative decoding over ragged rows that finish at different steps (the embedded model), compiled and eager,
with CUDA-graph verify steps simulated, a warm-up of every speculative kind that leaves no trace, and seeded
lookup that draws the same whatever prefix was cached."""

from __future__ import annotations

import pytest
import torch

from capture import CaptureOptions
from static_decode import Conversation, DraftModel, Generator, PromptLookup, load_model
from tests.support.checkpoints import hf_llama, save
from tests.support.speculation_cases import PROMPTS, plain

RAGGED = [b"def foo(x):\n    return foo(x)\ndef foo(x):\n", b"import os\nimport os\nimport", b"aaaa aaaa aaaa aaaa"]


@pytest.fixture(scope="module")
def embedded():
    from static_decode.checkpoints.loading import default_model_path

    return load_model(default_model_path())


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "no-kernel"])
@pytest.mark.parametrize("spec", ["lookup", "lookup-skip", "draft"])
def test_ragged_rows_finishing_at_different_steps_equal_plain_decode(embedded, spec, kernel, monkeypatch):
    """Rows of different lengths that finish at different steps (by EOS, or at max_new_tokens with read_every 3):
    the tokens equal plain decode's on the CPU kernel path and off it, with every speculation kind."""
    from static_decode.kernels import cpu_kernel

    if kernel and not cpu_kernel.available():
        pytest.skip("the CPU kernels are not built here")
    monkeypatch.setattr(cpu_kernel, "_state", {"ok": kernel})
    rows = [list(r) for r in RAGGED]
    make = {"lookup": lambda: PromptLookup(tokens=4, ngram=2, skip_unmatched=False),
            "lookup-skip": lambda: PromptLookup(tokens=4, ngram=2, skip_unmatched=True),
            "draft": lambda: DraftModel(embedded, tokens=3)}[spec]
    for eos, every in (([32], 1), ([32], 3), ([], 3)):
        want = Generator(embedded, max_len=120, eos_token_ids=eos).generate(rows, 40)
        gen = Generator(embedded, max_len=120, eos_token_ids=eos, speculate=make(), read_every=every)
        assert gen.generate(rows, 40) == want, (eos, every)
        assert (gen.cache.lens.numpy() == gen.cache.host_lens).all()
    if eos:
        assert len({len(w) for w in want}) > 1  # the rows did finish at different steps


def test_ragged_rows_compiled_equal_plain_decode(embedded):
    want = Generator(embedded, max_len=120, eos_token_ids=[32]).generate([list(r) for r in RAGGED], 40)
    opts = CaptureOptions(warm_up="lazy")
    for spec in (PromptLookup(tokens=4, ngram=2, skip_unmatched=False), DraftModel(embedded, tokens=3)):
        gen = Generator(embedded, max_len=120, eos_token_ids=[32], speculate=spec, read_every=3, compile=True,
                        capture=opts)
        assert gen.generate([list(r) for r in RAGGED], 40) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_verify_steps_equal_eager(models, tmp_path):
    """On CUDA (reduce-overhead: the verify and draft steps replayed as CUDA graphs): greedy equals plain decode,
    seeded sampling equals the eager speculative run, no cudagraph skip, no graph break."""
    from capture.guards import count_compiles

    target = load_model(save(hf_llama(seed=31), tmp_path / "t"), device="cuda")
    want = Generator(target, max_len=64, chunk_size=8, eos_token_ids=[]).generate(PROMPTS, 24)
    lazy = CaptureOptions(warm_up="lazy")  # only the kinds these requests launch: GPU minutes are scarce
    for spec, sampled in ((PromptLookup(tokens=3, ngram=2, min_tokens_per_step=0), True), (DraftModel(target), False)):
        gen = Generator(target, max_len=64, chunk_size=8, eos_token_ids=[], speculate=spec, compile=True, capture=lazy)
        with count_compiles() as c:
            assert gen.generate(PROMPTS, 24) == want
            if sampled:
                eager = Generator(target, max_len=64, chunk_size=8, eos_token_ids=[], speculate=spec)
                kw = dict(temperature=0.9, seed=5)
                assert gen.generate(PROMPTS, 12, **kw) == eager.generate(PROMPTS, 12, **kw)
        assert (c.counts.graph_breaks, c.counts.cudagraph_skips) == (0, 0) and not gen.runner.fallbacks


def test_warm_up_of_every_speculative_kind_leaves_no_trace(models):
    """warm_up="all" runs every kind (verify, draft_prefill, draft, draft_follow, ...) on scratch state: the
    cache, the draft cache and the buffers are as before, and requests then equal plain decode (dynamo graphs
    without inductor, so this stays fast; the inductor path is the compiled test above)."""
    from capture import CompileSettings

    target = models[0]
    want = plain(target, PROMPTS, 20)
    opts = CaptureOptions(settings=CompileSettings(backend="eager"), progress=False)
    for spec in (PromptLookup(tokens=3, ngram=2), DraftModel(models[1], tokens=2)):
        gen = Generator(target, max_len=64, chunk_size=8, eos_token_ids=[], speculate=spec, compile=True,
                        capture=opts, batch=3)
        kinds = {r.kind for r in gen.capture_records}
        assert {"verify", "verify_greedy"} <= kinds
        if isinstance(spec, DraftModel):
            assert {"draft_prefill", "draft", "draft_greedy", "draft_follow"} <= kinds
            assert not gen.draft_cache.lens.any()
        assert not gen.cache.lens.any() and not gen.bufs.step.any() and not gen.bufs.done.any()
        assert gen.generate(PROMPTS, 20) == want


@pytest.mark.parametrize("skip", [False, True], ids=["device-lookup", "skip-unmatched"])
def test_seeded_lookup_draws_the_same_whatever_prefix_was_cached(embedded, skip):
    """Prompt lookup searches the whole sequence, the reused prefix too: a seeded request through PrefixCache, or a
    conversation's turn, draws exactly what the same tokens sent to a fresh generator draw (the drafts, hence the
    draws and the steps, depend on what the lookup searched)."""
    from static_decode.generation.prefix_cache import PrefixCache

    spec = PromptLookup(tokens=4, ngram=2, min_tokens_per_step=0, skip_unmatched=skip)
    prompt = list(b"def foo(x):\n    return foo(x) + 1\n\n\ndef foo(x):\n    ret")
    kw = dict(temperature=0.7, seed=11)

    def new():
        return Generator(embedded, max_len=160, eos_token_ids=[], speculate=spec)

    fresh = new()
    want = fresh.generate(prompt, 24, **kw)
    steps = (fresh.stats.decode_steps, fresh.stats.verify_steps)
    for cached in (3, 30, len(prompt) - 1):
        pc = PrefixCache(new())
        _, first = pc.stream(prompt[:cached], 1)
        list(first)
        reuse, pieces = pc.stream(prompt, 24, **kw)
        assert reuse.cached == cached
        assert ([t for p in pieces for t in p], pc.gen.stats.decode_steps, pc.gen.stats.verify_steps) == (
            want, *steps), cached
    conv = Conversation(new())
    reply = list(conv.send(prompt[:30], 5))
    turn = prompt[30:]
    fresh = new()
    assert list(conv.send(turn, 24, **kw)) == fresh.generate(prompt[:30] + reply + turn, 24, **kw)
    assert (conv.gen.stats.decode_steps, conv.gen.stats.verify_steps) == (
        fresh.stats.decode_steps, fresh.stats.verify_steps)
