"""Device sampling: the counter-based hash, the exponential race, temperature / top-k / top-p, reproducibility.

Pins: the int64 hash equals an independent pure-Python one bit for bit (no overflow anywhere); sampled
frequencies follow softmax(logits / T) restricted as transformers restricts them (temperature, then top-k,
then top-p) — chi-square tests on a fixed 6-token distribution with fixed seeds, each with a counterfactual
showing the statistic would catch the wrong distribution; temperature 0 and top-k 1 are greedy; the same seed
gives the same tokens, compiled or not; batch rows draw independently.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from static_decode import Generator, load_model
from static_decode.steps.sampling import MASK32, _mul32, mix32, mix32_host, probabilities, row_seed, sample, uniform
from tests.support.checkpoints import hf_llama, save

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
N = 20_000
CHI2_LIMIT = 30.0  # chi-square with <= 5 degrees of freedom exceeds 30 with probability < 2e-5


def draws(temperature=1.0, top_k=0, top_p=1.0, n=N, seed=777, step=0) -> np.ndarray:
    """n samples of LOGITS, one per row, each row with its own seed."""
    seeds = torch.tensor([row_seed(seed, b) for b in range(n)])
    tokens = sample(
        LOGITS.expand(n, -1),
        torch.full((n,), float(temperature)),
        torch.full((n,), top_k),
        torch.full((n,), float(top_p)),
        seeds,
        torch.tensor(step),
    )
    return np.bincount(tokens.numpy(), minlength=len(LOGITS))


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's statistic over the support of probs; any count outside the support is infinitely wrong."""
    support = probs > 0
    if counts[~support].any():
        return float("inf")
    expected = counts.sum() * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum())


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def restricted(probs: np.ndarray, keep: int) -> np.ndarray:
    """probs (sorted descending here) restricted to the first `keep` tokens, renormalised."""
    out = np.zeros_like(probs)
    out[:keep] = probs[:keep] / probs[:keep].sum()
    return out


L = LOGITS.double().numpy()


# ---- the hash -------------------------------------------------------------------------------------------------
def test_hash_matches_pure_python_bit_for_bit():
    rng = np.random.default_rng(0)
    xs = np.concatenate([[0, 1, MASK32, MASK32 - 1, 1 << 31], rng.integers(0, 1 << 32, 1000)])
    got = mix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [mix32_host(int(x)) for x in xs]
    assert _mul32(torch.tensor(xs), 0x846CA68B).tolist() == [(int(x) * 0x846CA68B) % (1 << 32) for x in xs]
    assert len(set(got)) == len(set(xs.tolist()))  # a bijection: no collisions


def test_uniforms_are_open_interval_and_keyed_by_seed_and_step():
    seeds = torch.tensor([row_seed(1, b) for b in range(64)])
    u = uniform(seeds, torch.tensor(3), 4096)
    assert u.min() > 0 and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.005
    assert torch.equal(u, uniform(seeds, torch.tensor(3), 4096))
    assert not torch.equal(u, uniform(seeds, torch.tensor(4), 4096))
    assert (u[0] != u[1]).float().mean() > 0.99  # two rows draw different noise


# ---- the distribution --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_scales_the_logits(temperature):
    counts = draws(temperature=temperature)
    assert chi2(counts, softmax(L / temperature)) < CHI2_LIMIT
    other = 1.0 if temperature != 1.0 else 0.5
    assert chi2(counts, softmax(L / other)) > 50 * CHI2_LIMIT  # the statistic would see a wrong temperature


def test_top_k_keeps_the_k_most_likely():
    counts = draws(top_k=3)
    assert chi2(counts, restricted(softmax(L), 3)) < CHI2_LIMIT
    assert counts[3:].sum() == 0 and chi2(counts, softmax(L)) > 50 * CHI2_LIMIT


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = softmax(L)  # cumulative mass before each token: 0, .56, .77, .89, ...
    counts = draws(top_p=0.8)
    assert chi2(counts, restricted(p, 3)) < CHI2_LIMIT
    assert counts[3:].sum() == 0


def test_top_p_applies_after_temperature():
    # At T=0.5 the mass before token 2 is .94 >= .9: only tokens 0, 1 survive (at T=1 four would).
    counts = draws(temperature=0.5, top_p=0.9)
    assert chi2(counts, restricted(softmax(L / 0.5), 2)) < CHI2_LIMIT


def test_top_p_applies_after_top_k():
    # top-k 2 renormalises to (.73, .27): top-p .7 then keeps token 0 alone. In the other order the nucleus
    # of the full distribution is {0, 1} and both would be drawn.
    counts = draws(top_k=2, top_p=0.7)
    assert counts[0] == N


def test_draws_are_independent_across_steps():
    seeds = torch.tensor([row_seed(5, b) for b in range(8)])
    counts = np.zeros(len(LOGITS), dtype=np.int64)
    for step in range(500):
        tok = sample(
            LOGITS.expand(8, -1),
            torch.ones(8),
            torch.zeros(8, dtype=torch.int64),
            torch.ones(8),
            seeds,
            torch.tensor(step),
        )
        counts += np.bincount(tok.numpy(), minlength=len(LOGITS))
    assert chi2(counts, softmax(L)) < CHI2_LIMIT


def test_temperature_zero_and_top_k_one_are_greedy():
    assert draws(temperature=0.0, top_k=4, top_p=0.5)[0] == N
    assert draws(top_k=1)[0] == N
    mixed = sample(
        LOGITS.expand(4, -1),
        torch.tensor([0.0, 1.0, 0.0, 1.0]),
        torch.zeros(4, dtype=torch.int64),
        torch.ones(4),
        torch.tensor([row_seed(3, b) for b in range(4)]),
        torch.tensor(0),
    )
    assert mixed[0] == 0 and mixed[2] == 0  # greedy rows, whatever the others do


def test_off_values_change_nothing():
    assert np.array_equal(draws(top_k=0, top_p=1.0), draws(top_k=len(LOGITS), top_p=1.0))


@pytest.mark.slow
def test_compiled_sampling_draws_the_same_tokens():
    torch._dynamo.reset()
    n = 512
    args = (
        torch.randn(n, 50),
        torch.rand(n) + 0.2,
        torch.randint(0, 8, (n,)),
        torch.rand(n) * 0.5 + 0.5,
        torch.tensor([row_seed(11, b) for b in range(n)]),
        torch.tensor(17),
    )
    eager = sample(*args)
    compiled = torch.compile(sample, fullgraph=True, dynamic=False)(*args)
    assert torch.equal(eager, compiled)


# ---- through the Generator -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(save(hf_llama(seed=21), tmp_path_factory.mktemp("sampling")))


PROMPT = [4, 8, 15, 16, 23, 42]


def test_same_seed_same_tokens_other_seed_other_tokens(model):
    gen = Generator(model, max_len=64, chunk_size=4, eos_token_ids=[])
    a = gen.generate(PROMPT, 24, temperature=1.0, seed=123)
    assert gen.generate(PROMPT, 24, temperature=1.0, seed=123) == a
    assert (
        Generator(model, max_len=40, chunk_size=16, eos_token_ids=[]).generate(PROMPT, 24, temperature=1.0, seed=123)
        == a
    )  # another generator, cache size and chunking: the draw depends on (seed, step, token) only
    assert gen.generate(PROMPT, 24, temperature=1.0, seed=124) != a
    assert gen.generate(PROMPT, 24, temperature=1.0, seed=123, top_p=0.5) != a  # top-p is applied


def test_top_k_one_equals_greedy(model):
    gen = Generator(model, max_len=64, eos_token_ids=[])
    assert gen.generate(PROMPT, 20, temperature=1.5, top_k=1, seed=1) == gen.generate(PROMPT, 20)


def test_batch_rows_draw_independently(model):
    gen = Generator(model, max_len=64, eos_token_ids=[])
    rows = gen.generate([PROMPT, PROMPT, PROMPT], 24, temperature=1.0, seed=9)
    assert rows[0] != rows[1] and rows[1] != rows[2] and rows[0] != rows[2]
    assert gen.generate([PROMPT, PROMPT, PROMPT], 24, temperature=1.0, seed=9) == rows


def test_stream_draws_what_generate_draws(model):
    gen = Generator(model, max_len=64, eos_token_ids=[])
    expected = gen.generate(PROMPT, 20, temperature=0.9, top_k=20, seed=77)
    assert list(gen.stream(PROMPT, 20, temperature=0.9, top_k=20, seed=77, read_every=3)) == expected


def test_a_tiny_temperature_is_its_limit_the_argmax():
    """Down to float32's smallest normal temperature the draw is the argmax (logits / T would overflow to inf and
    the draw would be arbitrary); a tie is split between the tied tokens only."""
    from static_decode.generation.request import TINIEST_TEMPERATURE

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 96, generator=g) * 20  # [B, V]
    best = logits.argmax(dim=-1)
    for t in (TINIEST_TEMPERATURE, 1.2e-38, 1e-30, 1e-12):
        temp = torch.full((64,), t)
        for step in range(4):
            picked = sample(logits, temp, torch.zeros(64, dtype=torch.int64), torch.ones(64), torch.arange(64),
                            torch.tensor(step))
            assert torch.equal(picked, best), t
        p = probabilities(logits, temp, torch.zeros(64, dtype=torch.int64), torch.ones(64))
        assert not p.isnan().any() and torch.equal(p.argmax(dim=-1), best) and (p.max(dim=-1).values == 1).all()
    tied = torch.zeros(1, 8)
    tied[0, 2] = tied[0, 5] = 3.0
    draws = {int(sample(tied, torch.tensor([1e-38]), torch.zeros(1, dtype=torch.int64), torch.ones(1),
                        torch.tensor([s]), torch.tensor(0))) for s in range(40)}
    assert draws == {2, 5}
