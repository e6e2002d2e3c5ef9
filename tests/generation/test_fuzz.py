"""Fuzzing the public entry points with broadly drawn arguments (hypothesis).

`Generator.generate`, `Generator.stream`, `StaticKVCache.append` and `gqa_attention` get arguments of any type
and range: ints (negative, huge like 2**70, numpy ints of every width), floats (nan, inf, denormals), bools,
None, strings, bytes, nested and ragged lists, empty rows, too many rows for a fixed-batch generator, prompts
longer than max_len, bad temperature/top_k/top_p/seed/read_every, bad n_new (wrong length, negative, too big,
float, 2-D, tensors of any dtype) and q/k/v tensors of wrong rank, shape or dtype. Property: every call either
succeeds (and then its result is well formed) or raises ValueError/TypeError (nothing else), and a refused call
leaves the cache K/V, the device lengths, the host lengths and every step buffer bit-identical. A stream is
checked when `stream()` is called: once it returns, iterating it must not raise.

A defect this fuzz found, now fixed and pinned below: a top_k past int64 (>= 2**63) passed the request check and
failed later, in `Generator._prepare` (`bufs.top_k.fill_`), after the cache was reset. A top_k at or past the
vocabulary now means "every token" (it is clamped to the vocabulary size when checked).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from static_decode import Generator, Llama, LlamaConfig, StaticKVCache, gqa_attention
from static_decode.core.attention import IMPLS

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
V = CFG.vocab_size
MAX_LEN, CHUNK, FIXED_BATCH, EOS = 24, 8, 2, 5
INT64_MAX = 2**63 - 1


def fuzz(examples: int) -> settings:
    """Hypothesis settings of a fuzz test: `examples` cases, no per-case deadline (the CPU is shared)."""
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---- strategies ------------------------------------------------------------------------------------------
HUGE = [2**31, 2**32, INT64_MAX, 2**63, 2**64 - 1, 2**64, 2**70, 10**30, -(2**63), -(2**70)]
ints = st.one_of(st.integers(-3, 100), st.sampled_from(HUGE), st.integers())
np_ints = st.one_of(
    st.integers(-128, 127).map(np.int8),
    st.integers(0, 255).map(np.uint8),
    st.integers(-(2**31), 2**31 - 1).map(np.int32),
    st.integers(-(2**63), INT64_MAX).map(np.int64),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.integers(0, V + 4).map(np.int64),
)
floats = st.one_of(
    st.floats(),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 1e-45, 1e-310, 1e29, 1e30, 1e300, math.nan, math.inf, -math.inf]),
    st.floats(-2, 2).map(np.float32),
    st.floats(-2, 2).map(np.float64),
)
junk = st.one_of(
    st.none(), st.booleans(), st.text(max_size=3), st.binary(max_size=3), st.just(object()), st.just({}),
    st.just(()), st.just([]), st.just(range(3)), st.just(torch.tensor(3)), st.complex_numbers(max_magnitude=3),
)
scalars = st.one_of(ints, np_ints, floats, junk)

token = st.one_of(st.integers(0, V - 1), st.integers(0, V - 1), scalars)
row = st.lists(st.integers(0, V - 1), min_size=1, max_size=10)  # with max_new <= 12: fits max_len 24
long_row = st.lists(st.integers(0, V - 1), min_size=18, max_size=40)  # near or past max_len
any_row = st.one_of(
    row, long_row,
    st.lists(token, max_size=12),  # empty rows, bad ids, wrong types
    row.map(tuple), row.map(np.array), long_row.map(np.array),
    st.lists(st.integers(0, V - 1).map(np.int64), min_size=1, max_size=8),
    st.lists(scalars, max_size=4),
)

# Each call gets valid arguments with 0, 1 or 2 of them replaced by a broadly drawn value (`corrupted`): a
# refusal then usually has one cause, and a third of the calls run for real.
VALID_REQUEST = {
    "prompt": st.one_of(
        row,  # one prompt
        st.lists(row, min_size=1, max_size=3),  # a ragged batch (3 rows: too many for the fixed generator)
        row.map(tuple), row.map(np.array),
        st.lists(st.integers(0, V - 1).map(np.int64), min_size=1, max_size=8),
        st.lists(st.integers(0, V - 1), min_size=1, max_size=8).map(lambda r: np.array([r, r[::-1]])),  # 2-D
    ),
    "max_new_tokens": st.one_of(st.integers(1, 12), st.integers(1, 12).map(np.int64)),
    "temperature": st.one_of(st.just(0.0), st.just(0), st.floats(0.05, 2.0), st.floats(0.05, 2.0).map(np.float64)),
    "top_k": st.one_of(st.none(), st.integers(1, V + 20), st.integers(1, V).map(np.int32)),
    "top_p": st.one_of(st.none(), st.floats(0.01, 1.0), st.just(1)),
    "seed": st.one_of(st.none(), st.integers(0, 2**70), st.integers(0, 2**64 - 1).map(np.uint64)),
    "stop_at_eos": st.booleans(),
}


BAD_REQUEST = {
    "prompt": st.one_of(
        any_row,
        st.lists(any_row, max_size=4),  # [] and [[]] included
        st.lists(row, min_size=3, max_size=5),  # too many rows for the fixed generator
        st.lists(st.lists(any_row, max_size=2), max_size=2),  # nested too deep
        st.lists(st.integers(0, V - 1), min_size=1, max_size=6).map(torch.tensor),
        scalars,
    ),
    "max_new_tokens": st.one_of(scalars, st.integers(13, 40)),  # 13..40: past max_len with most prompts
    "temperature": scalars,
    "top_k": scalars,
    "top_p": scalars,
    "seed": scalars,
}
READ_EVERY = (st.one_of(st.none(), st.integers(1, 20), st.integers(1, 20).map(np.int8)), scalars)


@st.composite
def corrupted(draw, valid: dict, bad: dict) -> dict:
    """`valid`'s arguments with 0, 1 or 2 of those named in `bad` drawn from `bad` instead."""
    n = draw(st.integers(0, 2))
    names = draw(st.permutations(sorted(bad)))[:n]
    event(f"corrupted arguments: {n}")
    return {k: draw(bad[k] if k in names else s) for k, s in valid.items()}


# ---- generators and their state ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gens() -> dict[str, Generator]:
    """A fixed-batch generator (refuses > 2 rows) and a free one (regrows; EOS on), both holding live state."""
    torch.manual_seed(0)
    model = Llama(CFG)
    fixed = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, batch=FIXED_BATCH, eos_token_ids=[])
    free = Generator(model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=[EOS])
    for gen in (fixed, free):
        gen.generate([[1, 2, 3], [4]], 5, temperature=0.7, seed=1)
    return {"fixed": fixed, "free": free}


def _state(gen: Generator) -> dict[str, torch.Tensor]:
    return {"k": gen.cache.k, "v": gen.cache.v, "lens": gen.cache.lens} | gen.bufs.tensors()


def _snapshot(gen: Generator) -> tuple:
    return gen.cache, gen.bufs, {n: t.clone() for n, t in _state(gen).items()}, gen.cache.host_lens.copy()


def _assert_unchanged(gen: Generator, snap: tuple) -> None:
    cache, bufs, tensors, host = snap
    assert gen.cache is cache and gen.bufs is bufs, "a refused request reallocated the cache or the buffers"
    for name, t in _state(gen).items():
        assert torch.equal(t, tensors[name]), f"a refused request changed {name}"
    assert np.array_equal(gen.cache.host_lens, host), "a refused request changed the host lengths"


def _assert_consistent(gen: Generator) -> None:
    assert gen.cache.host_lens.tolist() == gen.cache.lens.tolist()


def _check_rows(gen: Generator, rows: list[list[int]], max_new: int, stop_at_eos: bool) -> None:
    eos = set(gen.eos_token_ids) if stop_at_eos else set()
    for row in rows:
        assert 1 <= len(row) <= max_new and all(isinstance(t, int) and 0 <= t < V for t in row)
        hit = [i for i, t in enumerate(row) if t in eos]
        assert hit in ([], [len(row) - 1]), "a row went on after its EOS"
        if not hit:
            assert len(row) == max_new, "a row without EOS stopped early"


def _check_output(gen: Generator, args: dict, out: list) -> None:
    """A list of new ids for a flat prompt, else one list per prompt row; EOS and max_new_tokens respected."""
    assert isinstance(out, list) and out
    flat = isinstance(out[0], int)
    if not flat:
        assert len(out) == len(args["prompt"])
    _check_rows(gen, [out] if flat else out, int(args["max_new_tokens"]), bool(args["stop_at_eos"]))


# ---- Generator.generate / Generator.stream -------------------------------------------------------------------
@fuzz(800)
@given(which=st.sampled_from(["fixed", "free"]), args=corrupted(VALID_REQUEST, BAD_REQUEST))
def test_generate_succeeds_or_refuses_without_a_trace(gens, which, args) -> None:
    gen = gens[which]
    snap = _snapshot(gen)
    try:
        out = gen.generate(**args)
    except (ValueError, TypeError) as err:
        event(f"refused: {type(err).__name__}")
        _assert_unchanged(gen, snap)
        return
    event("generated")
    _check_output(gen, args, out)
    _assert_consistent(gen)


@fuzz(500)
@given(
    which=st.sampled_from(["fixed", "free"]),
    args=corrupted(VALID_REQUEST | {"read_every": READ_EVERY[0]}, BAD_REQUEST | {"read_every": READ_EVERY[1]}),
)
def test_stream_is_checked_when_called_and_never_fails_later(gens, which, args) -> None:
    gen = gens[which]
    snap = _snapshot(gen)
    try:
        it = gen.stream(**args)
    except (ValueError, TypeError) as err:
        event(f"refused: {type(err).__name__}")
        _assert_unchanged(gen, snap)
        return
    event("streamed")
    _assert_unchanged(gen, snap)  # nothing runs before the first next()
    pieces = list(it)  # any exception here is a request that stream() should have refused
    assert pieces
    if isinstance(pieces[0], int):
        out = pieces
    else:
        out = [[t for piece in pieces for t in piece[b]] for b in range(len(pieces[0]))]
    _check_output(gen, args, out)
    _assert_consistent(gen)


TOP_K_PAST_INT64 = [2**63, 2**70, np.uint64(2**64 - 1)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("top_k", TOP_K_PAST_INT64, ids=["2**63", "2**70", "uint64_max"])
def test_a_top_k_past_int64_means_every_token(gens, top_k, temperature) -> None:
    """Found by this fuzz: such a top_k used to pass the check and fail in _prepare after the cache was reset."""
    gen = Generator(gens["fixed"].model, max_len=MAX_LEN, chunk_size=CHUNK, batch=FIXED_BATCH, eos_token_ids=[])
    want = gen.generate([1, 2, 3], 4, temperature=temperature, seed=0)
    assert gen.generate([1, 2, 3], 4, temperature=temperature, top_k=top_k, seed=0) == want
    assert list(gen.stream([1, 2, 3], 4, temperature=temperature, top_k=top_k, seed=0)) == want
    _assert_consistent(gen)


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


# ---- after all that --------------------------------------------------------------------------------------
def test_fuzzed_generators_still_equal_a_fresh_one(gens) -> None:
    for gen in gens.values():
        fresh = Generator(gen.model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=gen.eos_token_ids)
        for args, kw in [(([[7, 8, 9], [1]], 10), {}), (([3] * 12, 12), {"temperature": 0.9, "seed": 4})]:
            assert gen.generate(*args, **kw) == fresh.generate(*args, **kw)
            _assert_consistent(gen)
