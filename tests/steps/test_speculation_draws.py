"""Speculative decoding's drafts and draws: the device prompt lookup equals a plain-Python one and the host n-gram
index agrees with it; unmatched rows launch plain steps; the rejection rule's first token follows p exactly
(chi-square on 40,000 rows), and end to end speculative sampling matches plain sampling's token distribution
(two-sample chi-square)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from static_decode import DraftModel, Generator, PromptLookup
from static_decode.steps.speculation import NgramIndex
from static_decode.steps.verify import lookup_draft, sampled_accept
from tests.support.checkpoints import VOCAB
from tests.support.speculation_cases import PROMPTS, plain


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


