"""csrc/sample_keys.cpp's top-k and top-p thresholds against the bisection they replace on the CPU
(static_decode.steps.sampling._largest_key, the pure-torch path every other device runs): equal on random rows,
rows with ties at the threshold, rows cut to -inf, and every edge of k and p."""

from __future__ import annotations

import pytest
import torch

from static_decode.kernels import cpu_kernel
from static_decode.steps import sampling

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")
OPS = torch.ops.static_decode_cpu


def bisect_k(keys: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return sampling._largest_key(lambda b: (keys < b[:, None]).sum(dim=-1, dtype=torch.int32) < k, keys.shape[0],
                                 keys.device)


def bisect_p(keys: torch.Tensor, probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    # the mass below b in float64, as the op sums it: the two then agree exactly, ties and boundaries included
    return sampling._largest_key(lambda b: (probs.double() * (keys < b[:, None])).sum(dim=-1) < p.double(),
                                 keys.shape[0], keys.device)


def rows(seed: int, B: int = 4, V: int = 3000, *, ties: bool = False, cut: float = 0.0) -> torch.Tensor:
    """Scaled logits as _kept has them (<= 0, the best at 0, some -inf), and their order keys."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 3
    if ties:
        x = (x * 2).round() / 2  # many exact ties
    x = x - x.amax(dim=-1, keepdim=True)
    if cut:
        x = x.masked_fill(torch.rand(B, V, generator=g) < cut, -torch.inf)
    return x


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("cut", [0.0, 0.5])
def test_top_k_key_is_the_bisections(ties, cut) -> None:
    scaled = rows(1, ties=ties, cut=cut)
    keys = sampling._order_keys(scaled)
    V = scaled.shape[1]
    for k in ([0, 0, 0, 0], [1, 2, 3, 40], [100, 1499, 1500, 1501], [V - 1, V, V + 1, 10**9], [-3, 7, 2999, 1]):
        kt = torch.tensor(k, dtype=torch.int64)
        got, want = OPS.top_k_key(keys, kt), bisect_k(keys, kt)
        assert got.dtype == torch.int32 and torch.equal(got, want), (k, got, want)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("cut", [0.0, 0.5])
def test_top_p_key_is_the_bisections(ties, cut) -> None:
    scaled = rows(2, ties=ties, cut=cut)
    keys = sampling._order_keys(scaled)
    probs = scaled.softmax(dim=-1)
    for p in ([0.9, 0.5, 0.95, 0.99], [1e-9, 1.0, 0.3, 0.7], [0.0, -1.0, float("nan"), 2.0]):
        pt = torch.tensor(p, dtype=torch.float32)
        got, want = OPS.top_p_key(keys, probs, pt), bisect_p(keys, probs, pt)
        off = pt >= 1  # top-p off: every key kept, whatever a float sum of the whole row comes to
        want = torch.where(off, torch.tensor(0x7F800000, dtype=torch.int32), want)
        assert torch.equal(got, want), (p, got, want)


def test_a_nan_key_is_never_below_a_threshold() -> None:
    scaled = rows(3, B=1, V=50)
    scaled[0, :5] = torch.nan
    keys = sampling._order_keys(scaled)
    probs = scaled.nan_to_num(nan=-torch.inf).softmax(dim=-1)
    for k in (1, 10, 45, 46, 50):
        kt = torch.tensor([k])
        assert torch.equal(OPS.top_k_key(keys, kt), bisect_k(keys, kt)), k
    pt = torch.tensor([0.8])
    assert torch.equal(OPS.top_p_key(keys, probs, pt), bisect_p(keys, probs, pt))


def test_sample_takes_the_ops_on_the_cpu_with_the_bisections_tokens(monkeypatch) -> None:
    """The sampled tokens with the ops and with the bisection (the kernels switched off) agree on random rows."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 5000, generator=g) * 4
    args = (torch.tensor([0.8, 1.0, 0.5, 1.3, 0.7, 1.0]), torch.tensor([0, 40, 5, 0, 1000, 1]),
            torch.tensor([0.95, 1.0, 0.9, 0.5, 0.8, 1.0]), torch.arange(6) + 11, torch.tensor(3),
            torch.tensor([0.0, 0.05, 0.0, 0.1, 0.0, 0.0]))
    with_ops = sampling.sample(logits, *args)
    monkeypatch.setattr(cpu_kernel, "available", lambda: False)
    assert torch.equal(sampling.sample(logits, *args), with_ops)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: OPS.top_k_key(torch.zeros(2, 5, dtype=torch.int64), torch.ones(2, dtype=torch.int64)),
     r"keys must be contiguous int32 \[B, V\]"),
    (lambda: OPS.top_k_key(torch.zeros(2, 0, dtype=torch.int32), torch.ones(2, dtype=torch.int64)), r"V > 0"),
    (lambda: OPS.top_k_key(torch.zeros(2, 5, dtype=torch.int32), torch.ones(3, dtype=torch.int64)),
     r"k must be Long \[2\]"),
    (lambda: OPS.top_k_key(torch.zeros(5, 2, dtype=torch.int32).t(), torch.ones(2, dtype=torch.int64)),
     r"keys must be contiguous"),
    (lambda: OPS.top_p_key(torch.zeros(2, 5, dtype=torch.int32), torch.zeros(2, 4), torch.ones(2)),
     r"probs must be contiguous float32 \[2, 5\]"),
    (lambda: OPS.top_p_key(torch.zeros(2, 5, dtype=torch.int32), torch.zeros(2, 5), torch.ones(2).double()),
     r"p must be Float \[2\]"),
])
def test_bad_calls_are_refused_by_name(call, match) -> None:
    with pytest.raises(RuntimeError, match=match):
        call()
