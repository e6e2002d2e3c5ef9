"""Speculative decoding: greedy output unchanged token for token.

Pins: prompt lookup and a draft model (the same model: every draft accepted; another model: most rejected) return
exactly the plain greedy tokens for ragged batches, with EOS inside an accepted run, with drafts reaching max_len,
eager and compiled; the device lengths end equal to the host mirror; every verify step reads at least the longest
row + K + 1; the policy falls back to plain steps on low acceptance; bad arguments are refused before anything
changes. The lookup references and the sampling statistics are in test_speculation_draws.py, the ragged and
compiled rows in test_speculation_ragged.py.
"""

from __future__ import annotations

import pytest

from capture import CaptureOptions
from static_decode import Conversation, DraftModel, Generator, PromptLookup, load_model
from static_decode.steps.speculation import SpeculationPolicy
from tests.support.checkpoints import VOCAB, hf_llama, save
from tests.support.speculation_cases import PROMPTS, plain, specs


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
    import static_decode.generation.host_loop

    monkeypatch.setattr(static_decode.generation.host_loop, "SpeculationPolicy", AlternatingPolicy)
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


