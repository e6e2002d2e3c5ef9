"""min_p, the presence and frequency penalties and the logit bias as functions, on random logits.

Pins: `sampling.bias` and `sampling.penalize_counts` equal their formulas in numpy (OpenAI's logit_bias added at
its ids; logit[t] - presence * (count[t] > 0) - frequency * count[t]), exactly, eager and compiled (inductor);
`sampling.probabilities` with min_p equals a numpy reference of vLLM's order (temperature, min-p, top-k, top-p
over the renormalised rest) on random logits, eager and compiled, and draws follow it (chi-square); with
min_p 0.5 every sampled token has at least half the top token's probability, and min_p off changes no draw; a
logit bias of -100 on the likeliest token keeps it out of 1,000 seeded samples (and the token is likely without
it). Through the Generator: tests/steps/test_samplers_generator.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from static_decode.steps import functions as steps
from static_decode.steps import sampling
from tests.support.sampler_refs import ref_bias, ref_counts, ref_kept, ref_probs, softmax


# ---- the functions on random logits --------------------------------------------------------------------------
def random_case(B: int = 6, V: int = 200, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 3  # [B, V]
    ids = torch.stack([torch.randperm(V, generator=g)[:steps.LOGIT_BIAS_SLOTS] for _ in range(B)])  # [B, M]
    values = (torch.rand(B, steps.LOGIT_BIAS_SLOTS, generator=g) * 200 - 100)  # [B, M]
    values[:, 40:] = 0  # unused entries ...
    ids[:, 40:] = 0  # ... at id 0
    counts = torch.randint(0, 4, (B, V), generator=g, dtype=torch.int32) * (torch.rand(B, V, generator=g) < 0.3)
    presence = torch.tensor([0.0, 1.5, -2.0, 0.7, 0.0, 2.0])[:B]
    frequency = torch.tensor([0.0, 0.5, 1.0, -0.3, 2.0, -2.0])[:B]
    return logits, ids, values, counts.to(torch.int32), presence, frequency


def adjusted(logits, ids, values, counts, presence, frequency):
    return sampling.penalize_counts(sampling.bias(logits, ids, values), counts, presence, frequency)


@pytest.mark.parametrize("compiled", [False, True])
def test_bias_and_count_penalties_equal_their_formulas(compiled):
    logits, ids, values, counts, presence, frequency = random_case()
    fn = torch.compile(adjusted, fullgraph=True, dynamic=False) if compiled else adjusted
    got = fn(logits, ids, values, counts, presence, frequency).numpy()
    for b in range(logits.shape[0]):
        used = {int(t): float(v) for t, v in zip(ids[b, :40], values[b, :40], strict=True)}
        biased = ref_bias(logits[b].numpy(), used)
        want = ref_counts(biased, counts[b].numpy(), float(presence[b]), float(frequency[b]))
        np.testing.assert_allclose(got[b], want, rtol=0, atol=2e-5)  # float32 sums in another order at most
    # Off is exactly the identity: no entry, no penalty.
    zeros = torch.zeros_like(values)
    same = fn(logits, torch.zeros_like(ids), zeros, counts, torch.zeros(6), torch.zeros(6))
    assert torch.equal(same, logits)


@pytest.mark.parametrize("compiled", [False, True])
def test_min_p_probabilities_equal_the_reference(compiled):
    g = torch.Generator().manual_seed(1)
    B, V = 8, 300
    logits = torch.randn(B, V, generator=g) * 2  # [B, V]
    temperature = torch.tensor([1.0, 0.7, 1.5, 1.0, 0.5, 2.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.05, 0.1, 0.3, 0.02, 0.5, 1.0, 0.05])
    top_k = torch.tensor([0, 0, 20, 0, 5, 0, 0, 0])
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.6, 0.9, 1.0, 1.0, 0.5])
    fn = sampling.probabilities
    if compiled:
        fn = torch.compile(fn, fullgraph=True, dynamic=False)
    got = fn(logits, temperature, top_k, top_p, min_p).double().numpy()
    for b in range(B):
        want = ref_probs(logits[b].numpy(), float(temperature[b]), float(min_p[b]), int(top_k[b]), float(top_p[b]))
        assert np.array_equal(got[b] > 0, want > 0), b  # the same kept set
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-7)
    assert (got[6] > 0).sum() == 1  # min_p 1 keeps the top token alone
    # The order is vLLM's: top-p over what min-p kept. Row 7 keeps fewer tokens than top-p over the full softmax
    # would, so the test sees the other order.
    full = ref_kept(logits[7].numpy(), 1.0, 0.0, 0, 0.5) & ref_kept(logits[7].numpy(), 1.0, 0.05)
    assert (got[7] > 0).sum() != full.sum()


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])  # [V]
N = 20_000


def draws(n: int = N, temperature: float = 1.0, min_p: float = 0.0, logits: torch.Tensor = LOGITS,
          bias: dict[int, float] | None = None, seed: int = 777, compiled: bool = False) -> np.ndarray:
    """n samples of `logits` (biased by `bias`), one per row, each with its own seed: the sampled ids."""
    V = logits.shape[-1]
    ids = torch.zeros(n, steps.LOGIT_BIAS_SLOTS, dtype=torch.int64)
    values = torch.zeros(n, steps.LOGIT_BIAS_SLOTS)
    for j, (t, b) in enumerate((bias or {}).items()):
        ids[:, j], values[:, j] = t, b

    def choose(logits, ids, values, temperature, top_k, top_p, seeds, step, min_p):
        return sampling.sample(sampling.bias(logits, ids, values), temperature, top_k, top_p, seeds, step, min_p)

    fn = torch.compile(choose, fullgraph=True, dynamic=False) if compiled else choose
    seeds = torch.tensor([sampling.row_seed(seed, b) for b in range(n)])
    return fn(logits.expand(n, V), ids, values, torch.full((n,), temperature), torch.zeros(n, dtype=torch.int64),
              torch.ones(n), seeds, torch.tensor(0), torch.full((n,), min_p)).numpy()


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    if counts[~support].any():
        return float("inf")
    expected = counts.sum() * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(("temperature", "min_p"), [(1.0, 0.1), (0.7, 0.2), (2.0, 0.5)])
def test_min_p_draws_follow_the_reference(temperature, min_p):
    counts = np.bincount(draws(temperature=temperature, min_p=min_p), minlength=6)
    want = ref_probs(LOGITS.numpy(), temperature, min_p)
    assert chi2(counts, want) < 30.0  # <= 5 degrees of freedom: exceeded with probability < 2e-5
    assert chi2(counts, softmax(LOGITS.double().numpy() / temperature)) > 300  # min_p changed the distribution


def test_min_p_half_keeps_every_draw_above_half_the_top_probability():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(50, generator=g) * 1.5  # [V]
    for temperature in (0.8, 1.0, 3.0):
        p = softmax(logits.double().numpy() / temperature)
        got = draws(n=2000, temperature=temperature, min_p=0.5, logits=logits)
        assert (p[got] >= 0.5 * p.max()).all()
        assert len(set(got.tolist())) > 1  # more than the top token is drawn: the bound is not met by greedy
        off = draws(n=2000, temperature=temperature, min_p=0.0, logits=logits)
        assert (p[off] < 0.5 * p.max()).any()  # without min_p some draws fall below: the check can fail


def test_min_p_off_changes_no_draw():
    n = 2000
    plain = sampling.sample(LOGITS.expand(n, 6), torch.ones(n), torch.zeros(n, dtype=torch.int64), torch.ones(n),
                            torch.tensor([sampling.row_seed(3, b) for b in range(n)]), torch.tensor(0))  # no min_p
    assert np.array_equal(plain.numpy(), draws(n=n, seed=3, min_p=0.0))
    assert not np.array_equal(plain.numpy(), draws(n=n, seed=3, min_p=0.2))


@pytest.mark.parametrize("compiled", [False, True])
def test_a_bias_of_minus_100_bans_the_likeliest_token(compiled):
    got = draws(n=1000, bias={0: -100.0}, compiled=compiled)
    assert 0 not in got
    assert (draws(n=1000, compiled=compiled) == 0).sum() > 400  # without the bias it is drawn over half the time
    counts = np.bincount(got, minlength=6)
    assert chi2(counts, softmax(np.array([-98.0, 1.0, 0.5, 0.0, -1.0, -3.0]))) < 30.0  # the rest: renormalised
    assert (draws(n=1000, bias={5: 100.0}, compiled=compiled) == 5).all()  # +100 all but forces one
