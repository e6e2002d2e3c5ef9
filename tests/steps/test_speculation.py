"""Speculative decoding: greedy output unchanged token for token, sampled output distributed as plain sampling.

Pins: prompt lookup and a draft model (the same model: every draft accepted; another model: most rejected)
return exactly the plain greedy tokens for ragged batches, with EOS inside an accepted run, with drafts reaching
max_len, eager and compiled; the device lengths end equal to the host mirror; every verify step reads at least
the longest row + K + 1; the device prompt lookup equals a plain-Python one; the rejection rule's first token
follows p exactly (chi-square on 40,000 rows), and end to end speculative sampling matches plain sampling's
token distribution (two-sample chi-square); the policy falls back to plain steps on low acceptance; bad
arguments are refused before anything changes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capture import CaptureOptions
from static_decode import Conversation, DraftModel, Generator, PromptLookup, load_model
from static_decode.steps.speculation import NgramIndex, SpeculationPolicy
from static_decode.steps.verify import lookup_draft, sampled_accept
from tests.support.checkpoints import VOCAB, hf_llama, save

# Repetitive prompts give prompt lookup matches; the third row is ragged and short.
PROMPTS = [[5, 17, 33, 2, 90, 61, 7, 5, 17, 33, 2], [40, 41, 40, 41, 40], [9] * 3 + [12, 13, 14, 9, 9, 9, 12]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    return load_model(save(hf_llama(seed=31), d / "target")), load_model(save(hf_llama(seed=32), d / "draft"))


def plain(model, prompts, n, **kw):
    return Generator(model, max_len=96, chunk_size=8, eos_token_ids=kw.pop("eos", [])).generate(prompts, n, **kw)


def specs(models):
    target, other = models
    return {
        "lookup": PromptLookup(tokens=4, ngram=2, min_tokens_per_step=0, skip_unmatched=False),
        "lookup-k1-n3": PromptLookup(tokens=1, ngram=3, min_tokens_per_step=0, skip_unmatched=False),
        "lookup-skip": PromptLookup(tokens=4, ngram=2, min_tokens_per_step=0, skip_unmatched=True),
        "draft-self": DraftModel(target, tokens=3, min_tokens_per_step=0),
        "draft-other": DraftModel(other, tokens=4, min_tokens_per_step=0),
    }


@pytest.mark.parametrize("name", ["lookup", "lookup-k1-n3", "lookup-skip", "draft-self", "draft-other"])
def test_greedy_equals_plain_for_ragged_batches(models, name):
    target = models[0]
    spec = specs(models)[name]
    want = plain(target, PROMPTS, 40)
    gen = Generator(target, max_len=96, chunk_size=8, eos_token_ids=[], speculate=spec, read_every=5)
    assert gen.generate(PROMPTS, 40) == want
    assert [gen.generate(p, 40) for p in PROMPTS] == want
    assert (gen.cache.lens.numpy() == gen.cache.host_lens).all()
    assert gen.stats.verify_steps > 0 and gen.stats.accepted_per_step >= 1
    if name == "draft-self":  # the target drafting for itself: every draft is accepted
        assert gen.stats.accepted_per_step > 3.5
        assert gen.stats.verify_steps <= 40 // 4 + 1


def test_eos_inside_an_accepted_run_ends_the_row_there(models):
    target = models[0]
    free = plain(target, PROMPTS, 30)
    eos = free[0][6]  # row 0 stops at its 7th token, in the middle of an accepted run (every draft is accepted)
    want = plain(target, PROMPTS, 30, eos=[eos])
    assert len(want[0]) == 7
    for spec in (DraftModel(target, tokens=4, min_tokens_per_step=0), PromptLookup(tokens=4, ngram=2)):
        gen = Generator(target, max_len=96, chunk_size=8, eos_token_ids=[eos], speculate=spec)
        assert gen.generate(PROMPTS, 30) == want
        assert (gen.cache.lens.numpy() == gen.cache.host_lens).all()


def test_drafts_reaching_max_len_and_the_refusal_past_it(models):
    target = models[0]
    prompt = PROMPTS[1]
    K, n = 4, 20
    max_len = len(prompt) + n + K  # the last verify step writes its drafts up to the very last position
    want = Generator(target, max_len=max_len, eos_token_ids=[]).generate(prompt, n)
    for spec in (PromptLookup(tokens=K, ngram=2, min_tokens_per_step=0), DraftModel(target, tokens=K)):
        gen = Generator(target, max_len=max_len, eos_token_ids=[], speculate=spec)
        assert gen.generate(prompt, n) == want
        with pytest.raises(ValueError, match=f"max_new_tokens={n + 1} and {K} draft slots of speculation"):
            gen.generate(prompt, n + 1)
        assert gen.generate(prompt, n) == want  # the refusal changed nothing


def test_every_verify_step_reads_past_its_drafts(models):
    target = models[0]
    gen = Generator(target, max_len=96, chunk_size=8, eos_token_ids=[], speculate=PromptLookup(tokens=4, ngram=2))
    gen.generate(PROMPTS, 2)  # allocate
    seen = []
    step = gen.runner.step

    def spy(kind, read_len):
        fn = step(kind, read_len)

        def run(model, cache, bufs, n):
            if kind.startswith("verify"):
                seen.append(n - int(cache.lens.max()))  # device read in the test only
            return fn(model, cache, bufs, n)

        return run

    gen.runner.step = spy
    gen.generate(PROMPTS, 40)
    assert seen and min(seen) >= 4 + 1


def ref_lookup_start(hist: list[int], n: int) -> int | None:
    L = len(hist)
    for j in range(L - n - 1, -1, -1):
        if hist[j : j + n] == hist[L - n :]:
            return j
    return None


def ref_lookup(hist: list[int], K: int, n: int) -> list[int]:
    """Prompt lookup in plain Python: the most recent earlier occurrence of the last n tokens, continued
    periodically past the known text; no match: the last token repeated."""
    L = len(hist)
    for j in range(L - n - 1, -1, -1):
        if hist[j : j + n] == hist[L - n :]:
            period = L - n - j
            return [hist[j + n + k % period] for k in range(K)]
    return [hist[-1]] * K


def test_device_prompt_lookup_equals_the_python_one():
    rng = np.random.default_rng(0)
    for trial in range(200):
        K, n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        B, S = 3, 40
        lens = rng.integers(1, S - K, size=B)
        hist = rng.integers(0, 3 + trial % 5, size=(B, S + 1))  # few symbols: many matches
        got = lookup_draft(torch.from_numpy(hist), torch.from_numpy(lens), int(lens.max()) + K, K, n)
        for b in range(B):
            assert got[b].tolist() == ref_lookup(hist[b, : lens[b]].tolist(), K, n), (trial, b)


def test_host_ngram_index_agrees_with_the_device_lookup():
    """skip_unmatched's host check says "matched" exactly where the device lookup finds an earlier occurrence."""
    rng = np.random.default_rng(1)
    for trial in range(100):
        n = int(rng.integers(1, 4))
        text = rng.integers(0, 3, size=int(rng.integers(1, 30))).tolist()
        index = NgramIndex(n, text[:1])
        for L in range(1, len(text) + 1):
            assert index.matched() == (ref_lookup_start(text[:L], n) is not None), (trial, L)
            index.extend(text[L : L + 1])


def test_skip_unmatched_launches_plain_steps_where_nothing_matches(models):
    target = models[0]
    want = plain(target, PROMPTS, 40)
    gen = Generator(target, max_len=96, chunk_size=8, eos_token_ids=[], speculate=PromptLookup(
        tokens=4, ngram=3, min_tokens_per_step=0, skip_unmatched=True))
    assert gen.generate(PROMPTS, 40) == want
    assert 0 < gen.stats.verify_steps < gen.stats.decode_steps
    assert gen.stats.accepted_per_step >= 1


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_the_rejection_rule_draws_the_first_token_from_p():
    """40,000 rows, each a verify of 2 drafts from q against p: the token at slot 0 follows p_0 exactly."""
    B, V, K = 40_000, 6, 2
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(1, K + 1, V, generator=gen) * 2, -1).expand(B, K + 1, V)
    q = torch.softmax(torch.randn(1, K, V, generator=gen) * 2, -1).expand(B, K, V)
    draft = torch.multinomial(q.reshape(-1, V)[: K], B, replacement=True, generator=gen).T  # [B, K] drafts ~ q
    seed = torch.arange(B, dtype=torch.int64) * 7919 % (1 << 32)
    tokens, count = sampled_accept(p, q, draft, seed, torch.zeros(B, dtype=torch.int64))
    first = np.bincount(tokens[:, 0].numpy(), minlength=V)
    assert chi2_pvalue(first, B * p[0, 0].numpy().astype(np.float64)) > 1e-3
    # Conditioned on accepting draft 0, the token at slot 1 follows p_1.
    second = tokens[count >= 2, 1].numpy()
    assert chi2_pvalue(np.bincount(second, minlength=V), len(second) * p[0, 1].numpy().astype(np.float64)) > 1e-3
    assert 0 < (count == 1).float().mean() < 1  # both branches taken
    # A draft equal to the target is always accepted.
    _, all_in = sampled_accept(p, p[:, :K], draft, seed, torch.zeros(B, dtype=torch.int64))
    assert (all_in == K + 1).all()


def two_sample_pvalue(a: np.ndarray, b: np.ndarray, V: int) -> float:
    """Chi-square test that two samples of ids come from one distribution (pooled expected counts)."""
    ca, cb = np.bincount(a, minlength=V).astype(float), np.bincount(b, minlength=V).astype(float)
    keep = (ca + cb) > 0
    pooled = (ca + cb)[keep] / (ca.sum() + cb.sum())
    ea, eb = pooled * ca.sum(), pooled * cb.sum()
    stat = (((ca[keep] - ea) ** 2) / ea).sum() + (((cb[keep] - eb) ** 2) / eb).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


@pytest.mark.parametrize("kind", ["lookup", "draft"])
def test_sampled_speculation_matches_plain_sampling(models, kind):
    """800 rows of one repetitive prompt: the tokens at positions 1..4 (each after verify steps that accept and
    reject) have the distribution of plain sampling's, position by position."""
    target, other = models
    rows, n = 800, 5
    prompt = [[40, 41] * 4] * rows
    # Lookup drafts are accepted with probability p(draft): a low temperature makes that likely enough here.
    kw = dict(temperature=0.2 if kind == "lookup" else 0.7, top_k=40, seed=11)
    want = np.array(Generator(target, max_len=32, eos_token_ids=[]).generate(prompt, n, **kw))
    if kind == "lookup":
        spec = PromptLookup(tokens=3, ngram=1, min_tokens_per_step=0, skip_unmatched=False)
    else:
        spec = DraftModel(other, tokens=3, min_tokens_per_step=0)
    gen = Generator(target, max_len=32, eos_token_ids=[], speculate=spec)
    got = np.array(gen.generate(prompt, n, **{**kw, "seed": 12}))
    assert 1.1 < gen.stats.accepted_per_step < 3.9, gen.stats  # drafts both accepted and rejected
    for pos in range(1, n):
        assert two_sample_pvalue(got[:, pos], want[:, pos], VOCAB) > 1e-3, pos
    assert (got == np.array(gen.generate(prompt, n, **{**kw, "seed": 12}))).all()  # a seed reproduces


def test_low_acceptance_falls_back_to_plain_steps(models):
    target = models[0]
    want = plain(target, PROMPTS, 40)
    # Nothing can reach K + 1 tokens per step on every row: every verify window is followed by a plain pause.
    spec = PromptLookup(tokens=2, ngram=2, min_tokens_per_step=3, pause_steps=6, skip_unmatched=False)
    gen = Generator(target, max_len=96, chunk_size=8, eos_token_ids=[], speculate=spec, read_every=4)
    assert gen.generate(PROMPTS, 40) == want
    s = gen.stats
    assert 0 < s.verify_steps < s.decode_steps  # both kinds ran
    policy = SpeculationPolicy(spec, window=4)
    assert policy.speculate()
    policy.observe(tokens=5, row_steps=2)  # the window is not full yet: no decision
    assert policy.speculate()
    policy.observe(tokens=5, row_steps=2)  # 2.5 per step < 3: pause
    assert not policy.speculate() and policy.plain_left == 6
    policy.ran_plain(4)
    assert not policy.speculate()
    policy.ran_plain(4)
    assert policy.speculate()
    policy.observe(tokens=12, row_steps=4)
    assert policy.speculate() and policy.accepted_per_step == 22 / 8


class AlternatingPolicy(SpeculationPolicy):
    """Pause after every verify window, whatever its acceptance."""

    def observe(self, tokens: int, row_steps: int) -> None:
        super().observe(tokens, row_steps)
        self.plain_left = self.spec.pause_steps


def test_draft_model_keeps_its_cache_through_plain_pauses(models, monkeypatch):
    """While speculation pauses, draft_follow feeds the draft each token: with the target as its own draft,
    every verify step after a pause still accepts everything (a stale draft cache would not)."""
    import static_decode.generation.generator

    monkeypatch.setattr(static_decode.generation.generator, "SpeculationPolicy", AlternatingPolicy)
    target = models[0]
    spec = DraftModel(target, tokens=3, pause_steps=3)
    gen = Generator(target, max_len=96, chunk_size=8, eos_token_ids=[], speculate=spec, read_every=2)
    assert gen.generate(PROMPTS[0], 40) == plain(target, PROMPTS[0], 40)
    assert 0 < gen.stats.verify_steps < gen.stats.decode_steps
    assert gen.stats.accepted_per_step > 3.5  # 4 but where the last step hits max_new_tokens


@pytest.mark.parametrize("kind", ["lookup", "draft"])
def test_conversation_and_stream_with_speculation(models, kind):
    target = models[0]
    spec = PromptLookup(tokens=3, ngram=2, min_tokens_per_step=0) if kind == "lookup" else DraftModel(models[1])
    ref = Conversation(Generator(target, max_len=96, chunk_size=8, eos_token_ids=[]))
    conv = Conversation(Generator(target, max_len=96, chunk_size=8, eos_token_ids=[], speculate=spec))
    for turn in (PROMPTS[0], PROMPTS[1]):
        assert list(conv.send(turn, 12)) == list(ref.send(turn, 12))
    gen = Generator(target, max_len=96, chunk_size=8, eos_token_ids=[], speculate=spec, read_every=2)
    assert list(gen.stream(PROMPTS[0], 25)) == plain(target, PROMPTS[0], 25)
    # A turn counts the draft slots too: it fits exactly, one more token is refused before anything changes.
    conv = Conversation(Generator(target, max_len=40, chunk_size=8, eos_token_ids=[], speculate=spec))
    K = spec.tokens
    first = list(conv.send(PROMPTS[0], 40 - len(PROMPTS[0]) - K))
    assert first == plain(target, PROMPTS[0], 40 - len(PROMPTS[0]) - K)
    conv = Conversation(Generator(target, max_len=40, chunk_size=8, eos_token_ids=[], speculate=spec))
    with pytest.raises(ValueError, match=f"\\+ {K} draft slots = 41 > max_len=40"):
        conv.send(PROMPTS[0], 40 - len(PROMPTS[0]) - K + 1)


def test_compiled_speculation_equals_eager(models):
    target = models[0]
    want = plain(target, PROMPTS, 24)
    opts = CaptureOptions(warm_up="lazy")
    for spec in (PromptLookup(tokens=3, ngram=2, min_tokens_per_step=0), DraftModel(target, tokens=2)):
        gen = Generator(target, max_len=64, chunk_size=8, eos_token_ids=[], speculate=spec, compile=True,
                        capture=opts)
        assert gen.generate(PROMPTS, 24) == want
        eager = Generator(target, max_len=64, chunk_size=8, eos_token_ids=[], speculate=spec)
        kw = dict(temperature=0.9, seed=5)
        assert gen.generate(PROMPTS, 12, **kw) == eager.generate(PROMPTS, 12, **kw)
        assert not any(r.recompiles for r in gen.capture_records if r.graphs == 0)


def test_bad_arguments_are_refused(models, tmp_path):
    target, other = models
    with pytest.raises(ValueError, match="tokens must be"):
        PromptLookup(tokens=0)
    with pytest.raises(ValueError, match="ngram must be"):
        PromptLookup(ngram=0)
    with pytest.raises(ValueError, match="min_tokens_per_step=9 must lie in 0..tokens \\+ 1 = 5"):
        PromptLookup(tokens=4, min_tokens_per_step=9)
    with pytest.raises(TypeError, match="DraftModel.model must be a static_decode.Llama, got str"):
        DraftModel("small")
    with pytest.raises(TypeError, match="speculate must be a PromptLookup or a DraftModel, got int"):
        Generator(target, max_len=32, speculate=4)
    small_vocab = load_model(save(hf_llama(seed=3, vocab=64), tmp_path / "v64"))
    with pytest.raises(ValueError, match=r"vocabulary \(64\) differs from the target's \(96\)"):
        Generator(target, max_len=32, speculate=DraftModel(small_vocab))


def test_a_long_row_done_early_beside_a_short_live_row(models):
    """A long row that hit EOS beside a short live row: the read length still covers the finished row's length
    (every formulation reads up to it; the CPU kernel refuses a longer row), and the lookup never indexes past it."""
    target = models[0]
    rows = [[(7 * i) % VOCAB for i in range(60)], [40, 41]]
    eos = plain(target, [rows[0]], 3)[0][0]  # the long row ends at its first token
    want = plain(target, rows, 20, eos=[eos])
    assert len(want[0]) == 1 and len(want[1]) > 10
    gen = Generator(target, max_len=96, chunk_size=8, eos_token_ids=[eos], speculate=PromptLookup(tokens=4, ngram=1))
    assert gen.generate(rows, 20) == want


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
