"""Property tests over shapes and chunkings (rules 1-3 and 6), with hypothesis choosing the cases.

Whatever the head counts, batch, chunk sizes and per-row token counts, the cache holds exactly the tokens
appended, in order, and attention equals the float64 reference; an overflowing chunk is refused without a trace.
"""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from static_decode import StaticKVCache, gqa_attention
from static_decode.core.reference import attention_vectorised
from tests.support.chunked import History


@st.composite
def plans(draw):
    hkv = draw(st.sampled_from([1, 2, 4]))
    g = draw(st.integers(1, 8))
    batch = draw(st.integers(1, 3))
    d = draw(st.sampled_from([2, 4, 8]))
    max_len = draw(st.integers(1, 24))
    calls = draw(st.lists(st.tuples(st.integers(1, 8), st.lists(st.integers(0, 8), min_size=batch, max_size=batch)),
                          min_size=1, max_size=8))
    return hkv, g, batch, d, max_len, calls


@settings(max_examples=60, deadline=None)
@given(plans(), st.sampled_from(["matmul", "sdpa"]), st.integers(0, 2**32 - 1))
def test_chunked_appends_match_reference(plan, impl: str, seed: int) -> None:
    hkv, g, batch, d, max_len, calls = plan
    rng = np.random.default_rng(seed)
    cache = StaticKVCache(batch, hkv, max_len, d, dtype=torch.float64)
    hist = History(batch, hkv, max_len, d)
    ptr = cache.k.data_ptr()
    for T, wanted in calls:
        n = np.minimum(np.array(wanted), T)
        k_new, v_new = rng.standard_normal((2, batch, hkv, T, d))
        if (hist.lens + n > max_len).any():
            before = cache.k.clone(), cache.lens.clone(), cache.host_lens.copy()
            try:
                cache.append(torch.from_numpy(k_new), torch.from_numpy(v_new), n)
            except ValueError as err:
                assert "would overflow" in str(err)
            else:
                raise AssertionError("overflow accepted")
            assert torch.equal(cache.k, before[0]) and torch.equal(cache.lens, before[1])
            assert np.array_equal(cache.host_lens, before[2])
            continue
        cache.append(torch.from_numpy(k_new), torch.from_numpy(v_new), n)
        hist.append(k_new, v_new, n)
        q = rng.standard_normal((batch, hkv * g, T, d))
        out = gqa_attention(torch.from_numpy(q), cache, n, impl=impl).numpy()
        np.testing.assert_allclose(out, attention_vectorised(q, hist.k, hist.v, hist.lens, n), atol=1e-10, rtol=0)
    assert cache.k.data_ptr() == ptr
    np.testing.assert_array_equal(cache.lens.numpy(), hist.lens)
    for b in range(batch):  # exactly the appended tokens, in order, and nothing written past them
        L = int(hist.lens[b])
        np.testing.assert_array_equal(cache.k[0, b, :, :L].numpy(), hist.k[b, :, :L])
        np.testing.assert_array_equal(cache.v[0, b, :, :L].numpy(), hist.v[b, :, :L])
        assert not cache.k[0, b, :, L:max_len].any()
