"""Fuzzing the core's public entry points with broadly drawn arguments (hypothesis): `StaticKVCache.append` and
`gqa_attention` get n_new of any type, range, length and dtype, and q/k/v tensors of wrong rank, shape or dtype.
Property: every call succeeds or raises ValueError/TypeError (nothing else), and a refused call leaves the K/V, the
device lengths and the host lengths bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from static_decode import StaticKVCache, gqa_attention
from static_decode.core.attention import IMPLS
from tests.support.fuzz_values import HUGE, INT64_MAX, corrupted, floats, fuzz, scalars

# ---- StaticKVCache.append ----------------------------------------------------------------------------------
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
          torch.bool]


def _tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def bad_tensors(good: tuple[int, ...], variants: list[tuple[int, ...]]):
    """Tensors of a wrong shape (any rank, or one dimension off) or dtype, arrays and non-tensors."""
    shapes = st.one_of(st.lists(st.integers(0, 5), max_size=6).map(tuple), st.sampled_from(variants))
    return st.one_of(
        st.builds(_tensor, shapes, st.sampled_from(DTYPES), st.integers(0, 2**16)),
        st.builds(_tensor, st.just(good), st.sampled_from(DTYPES[1:])),  # right shape, wrong dtype
        st.just(np.zeros(good, dtype=np.float32)),
        st.just(_tensor(good).tolist()),
        scalars,
    )


def n_news(B: int, T: int):
    """Bad n_new for a batch of B rows and a chunk of T slots: out of range, wrong length, wrong type."""
    within = st.lists(st.integers(0, T), min_size=B, max_size=B)
    return st.one_of(
        st.lists(st.one_of(st.integers(-3, T + 3), st.sampled_from(HUGE)), min_size=B, max_size=B),
        st.lists(st.integers(0, T), max_size=B + 3),  # wrong length
        st.lists(st.integers(-(2**63), INT64_MAX).map(np.int64), min_size=B, max_size=B).map(np.array),
        st.lists(st.integers(0, 2**64 - 1), min_size=B, max_size=B).map(lambda n: np.array(n, dtype=np.uint64)),
        st.lists(st.integers(0, 2**64 - 1), min_size=B, max_size=B).map(
            lambda n: torch.tensor([x % 2**63 for x in n], dtype=torch.int64).to(torch.uint64)),
        st.lists(floats, min_size=B, max_size=B),  # floats
        within.map(lambda n: [float(x) for x in n]),
        within.map(lambda n: np.array(n, dtype=np.float32)),
        within.map(lambda n: torch.tensor(n, dtype=torch.float32)),
        within.map(lambda n: torch.tensor(n, dtype=torch.bool)),
        within.map(lambda n: [True] * len(n)),
        within.map(lambda n: [n]),  # 2-D
        within.map(lambda n: torch.tensor([n])),
        st.lists(st.lists(st.integers(0, T), max_size=3), min_size=1, max_size=3),  # ragged
        st.lists(scalars, min_size=B, max_size=B),
        scalars,  # a scalar, None, a string, ...
    )


def good_n_news(highs: list[int]):
    """Valid n_new (row b takes 0..highs[b]) as a list, tuple, numpy array or integer tensor."""
    n = st.tuples(*(st.integers(0, max(h, 0)) for h in highs)).map(list)
    return st.one_of(
        n, n.map(tuple), n.map(np.array), n.map(lambda x: np.array(x, dtype=np.int8)),
        n.map(lambda x: [np.int64(v) for v in x]),
        *(n.map(lambda x, dt=dt: torch.tensor(x, dtype=dt)) for dt in (torch.int64, torch.int32, torch.uint8)),
    )


@st.composite
def append_cases(draw):
    """(cache shape, lens, {k_new, v_new, n_new}): a valid append with 0-2 arguments corrupted."""
    B, H, L, d = draw(st.integers(0, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 8)), draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(0, L), min_size=B, max_size=B))
    T = draw(st.integers(0, 10))
    seed = draw(st.integers(0, 2**16))
    good = (B, H, T, d)
    off = [(B + 1, H, T, d), (B, H + 1, T, d), (B, H, T, d + 1), (B, H, T), (1, B, H, T, d)]
    valid = {
        "k_new": st.just(_tensor(good, seed=seed)),
        "v_new": st.just(_tensor(good, seed=seed + 1)),
        "n_new": good_n_news([min(T, L - n) for n in lens]),
    }
    bad = {
        "k_new": bad_tensors(good, off),
        "v_new": st.one_of(bad_tensors(good, off), st.just(_tensor((B, H, T + 1, d)))),  # T differs from k_new's
        "n_new": st.one_of(n_news(B, T), good_n_news([T] * B)),  # the second: may overflow a row
    }
    return (B, H, L, d), lens, draw(corrupted(valid, bad))


def _filled_cache(B: int, H: int, L: int, d: int, lens: list[int], layers: int = 1) -> StaticKVCache:
    """A cache whose rows hold `lens` tokens of random K/V, in every layer."""
    cache = StaticKVCache(B, H, L, d, layers=layers)
    g = torch.Generator().manual_seed(sum(lens) + 7 * B)
    k, v = torch.randn((2, B, H, L, d), generator=g)
    n = cache.validate(lens, L)
    n_dev = cache.device_ints(n)
    for layer in range(layers):
        cache.write(layer, k + layer, v - layer, n_dev)
    cache.advance(n_dev)
    cache.commit(n)
    return cache


@fuzz(1500)
@given(case=append_cases())
def test_append_succeeds_or_refuses_without_a_trace(case) -> None:
    (B, H, L, d), lens, args = case
    cache = _filled_cache(B, H, L, d, lens)
    before = {"k": cache.k.clone(), "v": cache.v.clone(), "lens": cache.lens.clone()}
    host = cache.host_lens.copy()
    ptr = cache.k.data_ptr(), cache.v.data_ptr()
    try:
        cache.append(**args)
    except (ValueError, TypeError) as err:
        event(f"refused: {type(err).__name__}")
        for name in before:
            assert torch.equal(getattr(cache, name), before[name]), f"a refused append changed {name}"
        assert np.array_equal(cache.host_lens, host)
        return
    event("appended")
    k_new, v_new = args["k_new"], args["v_new"]
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == ptr
    n = [int(x) for x in args["n_new"]]
    assert cache.host_lens.tolist() == [a + b for a, b in zip(host.tolist(), n, strict=True)]
    assert cache.lens.tolist() == cache.host_lens.tolist()
    for b in range(B):
        old, new = int(host[b]), int(cache.host_lens[b])
        assert 0 <= new - old <= k_new.shape[2] and new <= L
        for name, x in (("k", k_new), ("v", v_new)):
            got = getattr(cache, name)[0, b]
            assert torch.equal(got[:, old:new], x[b, :, : new - old]), f"row {b}: the appended {name} differs"
            assert torch.equal(got[:, :old], before[name][0, b, :, :old]), f"row {b}: cached {name} moved"
            assert torch.equal(got[:, new:L], before[name][0, b, :, new:L]), f"row {b}: {name} written past len"


# ---- gqa_attention -----------------------------------------------------------------------------------------
ATT_B, ATT_H, ATT_L, ATT_D, ATT_LAYERS = 2, 2, 8, 4, 2
ATT_LENS = [5, 2]


@st.composite
def attention_cases(draw):
    """(q, n_new, keywords): a valid call over the 2-layer cache with 0-2 arguments corrupted."""
    T = draw(st.integers(0, 6))
    Hq = draw(st.sampled_from([ATT_H, 2 * ATT_H, 3 * ATT_H]))
    good = (ATT_B, Hq, T, ATT_D)
    off = [(ATT_B + 1, Hq, T, ATT_D), (ATT_B, 3, T, ATT_D), (ATT_B, 0, T, ATT_D), (ATT_B, Hq, T, ATT_D + 1),
           (1, Hq, T, ATT_D), (ATT_B, Hq, T), (1, ATT_B, Hq, T, ATT_D)]
    valid = {
        "q": st.builds(_tensor, st.just(good), st.just(torch.float32), st.integers(0, 2**16)),
        "n_new": good_n_news([min(T, n) for n in ATT_LENS]),
        "layer": st.integers(0, ATT_LAYERS - 1),
        "read_len": st.one_of(st.none(), st.integers(max(ATT_LENS), ATT_L), st.integers(5, 8).map(np.int64)),
        "impl": st.sampled_from(IMPLS),
    }
    bad = {
        "q": bad_tensors(good, off),
        "n_new": st.one_of(n_news(ATT_B, T), good_n_news([T] * ATT_B)),  # the second: past a row's length
        "layer": st.one_of(st.integers(-2, 3), scalars),
        "read_len": st.one_of(st.integers(-2, 10), scalars),
        "impl": st.one_of(st.text(max_size=5), scalars),
    }
    return draw(corrupted(valid, bad))


@pytest.fixture(scope="module")
def att_cache() -> StaticKVCache:
    return _filled_cache(ATT_B, ATT_H, ATT_L, ATT_D, ATT_LENS, layers=ATT_LAYERS)


@fuzz(1500)
@given(args=attention_cases())
def test_gqa_attention_succeeds_or_refuses_and_never_writes(att_cache, args) -> None:
    before = {"k": att_cache.k.clone(), "v": att_cache.v.clone(), "lens": att_cache.lens.clone()}
    try:
        out = gqa_attention(args["q"], att_cache, args["n_new"], layer=args["layer"], read_len=args["read_len"],
                            impl=args["impl"])
    except (ValueError, TypeError) as err:
        event(f"refused: {type(err).__name__}")
        out = None
    for name in before:
        assert torch.equal(getattr(att_cache, name), before[name]), f"gqa_attention changed {name}"
    assert att_cache.host_lens.tolist() == ATT_LENS
    if out is None:
        return
    q = args["q"]
    event("attended" if q.numel() else f"attended an empty q of shape {tuple(q.shape)}")
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    for b, n in enumerate(int(x) for x in args["n_new"]):
        assert not out[b, :, n:].any(), f"row {b}: padded slots past n_new={n} are not zero"


