"""Fuzzing the generator's public entry points with broadly drawn arguments (hypothesis).

`Generator.generate` and `Generator.stream` get arguments of any type and range (tests/support/fuzz_values.py):
ints (negative, huge like 2**70, numpy ints of every width), floats (nan, inf, denormals), bools, None, strings,
bytes, nested and ragged lists, empty rows, too many rows for a fixed-batch generator, prompts longer than max_len,
bad temperature/top_k/top_p/seed/read_every. Property: every call either succeeds (and then its result is well
formed) or raises ValueError/TypeError (nothing else), and a refused call leaves the cache K/V, the device lengths,
the host lengths and every step buffer bit-identical. A stream is checked when `stream()` is called: once it
returns, iterating it must not raise. tests/core/test_fuzz_core.py fuzzes `StaticKVCache.append` and
`gqa_attention` alike.

A defect this fuzz found, now fixed and pinned below: a top_k past int64 (>= 2**63) passed the request check and
failed later, in `Generator._prepare` (`bufs.top_k.fill_`), after the cache was reset. A top_k at or past the
vocabulary now means "every token" (it is clamped to the vocabulary size when checked).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from static_decode import Generator, Llama, LlamaConfig
from tests.support.fuzz_values import V, corrupted, fuzz, scalars

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
assert CFG.vocab_size == V
MAX_LEN, CHUNK, FIXED_BATCH, EOS = 24, 8, 2, 5




# ---- strategies ------------------------------------------------------------------------------------------
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


# ---- after all that --------------------------------------------------------------------------------------
def test_fuzzed_generators_still_equal_a_fresh_one(gens) -> None:
    for gen in gens.values():
        fresh = Generator(gen.model, max_len=MAX_LEN, chunk_size=CHUNK, eos_token_ids=gen.eos_token_ids)
        for args, kw in [(([[7, 8, 9], [1]], 10), {}), (([3] * 12, 12), {"temperature": 0.9, "seed": 4})]:
            assert gen.generate(*args, **kw) == fresh.generate(*args, **kw)
            _assert_consistent(gen)
