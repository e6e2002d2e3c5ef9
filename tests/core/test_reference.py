"""The two numpy references agree (rule 2 and 3 stated twice, independently).

`attention_vectorised` uses the grouped view and an offset causal mask; `attention_direct` repeats KV heads and
loops over rows and real queries. If either had the chunk offset wrong (a T x T triangle mask) or mapped query
head h to the wrong KV head, they would disagree on these trials.
"""

import numpy as np
import pytest

from static_decode.core.reference import attention_direct, attention_vectorised
from tests.support.chunked import History, schedule


def test_references_agree_on_200_chunked_trials() -> None:
    rng = np.random.default_rng(1234)
    calls_checked = zero_rows_seen = 0
    gs = set()
    for _trial in range(200):
        hkv = int(rng.choice([1, 2, 4]))
        g = int(rng.integers(1, 9))
        gs.add(g)
        batch, d, max_len = int(rng.integers(1, 4)), int(rng.choice([4, 8, 16])), 40
        finals = rng.integers(0, max_len + 1, size=batch)
        hist = History(batch, hkv, max_len, d)
        for T, n in schedule(rng, finals, 8):
            k_new, v_new = rng.standard_normal((2, batch, hkv, T, d))
            q = rng.standard_normal((batch, hkv * g, T, d)) * 2.0
            hist.append(k_new, v_new, n)
            a = attention_vectorised(q, hist.k, hist.v, hist.lens, n)
            b = attention_direct(q, hist.k, hist.v, hist.lens, n)
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)
            for bi in range(batch):
                assert not a[bi, :, n[bi]:].any(), "padded slots must be exact zeros"
            calls_checked += 1
            zero_rows_seen += int((n == 0).any())
    assert calls_checked > 200 and zero_rows_seen > 20
    assert gs == set(range(1, 9))


def test_reference_known_values() -> None:
    """One key: the output is that key's value. Two equal keys: the mean of their values."""
    q = np.ones((1, 2, 1, 2))
    k = np.zeros((1, 1, 3, 2))
    v = np.array([[[[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]]])
    for fn in (attention_vectorised, attention_direct):
        np.testing.assert_array_equal(fn(q, k, v, np.array([1]), np.array([1]))[0, :, 0], [[1, 2], [1, 2]])
        np.testing.assert_allclose(fn(q, k, v, np.array([2]), np.array([1]))[0, :, 0], [[2, 3], [2, 3]])


@pytest.mark.parametrize("fn", [attention_vectorised, attention_direct])
def test_reference_rejects_bad_lengths(fn) -> None:
    q, k = np.zeros((1, 2, 2, 4)), np.zeros((1, 1, 5, 4))
    with pytest.raises(ValueError):
        fn(q, k, k, np.array([1]), np.array([2]))  # more new tokens than the row holds
    with pytest.raises(ValueError):
        k2 = np.zeros((1, 2, 5, 4))
        fn(np.zeros((1, 3, 2, 4)), k2, k2, np.array([1]), np.array([1]))  # Hq=3 not a multiple of Hkv=2
