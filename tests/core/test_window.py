"""Sliding-window attention in every formulation against the float64 numpy references.

Pins: the window's off-by-one is transformers' own (a query at i sees keys j with i - W < j <= i, checked against
transformers.masking_utils' mask function), every formulation equals `attention_vectorised` / `attention_direct`
with a window over chunks of 1, 7 and 64, ragged batches and random chunked schedules at positions well past the
window, padded slots stay exact zeros, split_key reads only the window's run of key blocks (so its cost stops
growing at W), and a compiled attention sees positions cross the window without a recompile.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from static_decode import StaticKVCache, gqa_attention
from static_decode.core.attention import IMPLS, grouped_attention
from static_decode.core.masks import chunk_mask, step_mask
from static_decode.core.reference import attention_direct, attention_vectorised
from tests.support.chunked import History, new_pair, schedule, to_torch


def test_chunk_mask_is_transformers_sliding_window() -> None:
    """Slot t of a 5-slot chunk after 9 cached tokens, window 4, against transformers' own mask function."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    W, cached, T, S = 4, 9, 5, 16
    lens, n_new = torch.tensor([cached + T]), torch.tensor([T])
    ours = chunk_mask(lens, n_new, T, S, window=W)[0]  # [T, S]
    fn = sliding_window_causal_mask_function(W)
    i = torch.tensor  # the mask functions take index tensors
    theirs = torch.tensor([[bool(fn(i(0), i(0), i(cached + t), i(s))) for s in range(S)] for t in range(T)])
    assert torch.equal(ours, theirs)
    # Exactly W keys each: the query at 9 sees 6..9, at 13 sees 10..13.
    assert ours.sum(-1).tolist() == [W] * T
    assert ours[0].nonzero().flatten().tolist() == [6, 7, 8, 9]
    assert ours[4].nonzero().flatten().tolist() == [10, 11, 12, 13]


def test_window_bad_values_are_refused() -> None:
    q = torch.zeros(1, 2, 1, 4)
    cache = StaticKVCache(1, 1, 8, 4)
    cache.append(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), [1])
    for bad in (0, -3, 2.0, True, "4"):
        with pytest.raises(ValueError, match=f"window must be None or an int >= 1.*{bad!r}"):
            gqa_attention(q, cache, [1], window=bad)
        with pytest.raises(ValueError, match="window"):
            attention_vectorised(q.numpy(), cache.k[0].numpy(), cache.v[0].numpy(), np.array([1]), np.array([1]),
                                 window=bad)


@pytest.mark.parametrize("window", [1, 2, 5, 13])
def test_references_agree_with_a_window(window: int) -> None:
    rng = np.random.default_rng(window)
    for _ in range(40):
        hkv, g = int(rng.choice([1, 2])), int(rng.integers(1, 5))
        batch, d, max_len = int(rng.integers(1, 4)), 4, 40
        finals = rng.integers(0, max_len + 1, size=batch)
        hist = History(batch, hkv, max_len, d)
        for T, n in schedule(rng, finals, 8):
            k_new, v_new = rng.standard_normal((2, batch, hkv, T, d))
            q = rng.standard_normal((batch, hkv * g, T, d)) * 2.0
            hist.append(k_new, v_new, n)
            a = attention_vectorised(q, hist.k, hist.v, hist.lens, n, window=window)
            b = attention_direct(q, hist.k, hist.v, hist.lens, n, window=window)
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)


def test_window_changes_the_answer() -> None:
    """The references with a window differ from the full causal ones once positions pass it, and agree before."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 1, 4)), *rng.standard_normal((2, 1, 1, 20, 4))
    for lens, same in ((np.array([4]), True), (np.array([5]), False), (np.array([20]), False)):
        full = attention_vectorised(q, k, v, lens, np.array([1]))
        windowed = attention_vectorised(q, k, v, lens, np.array([1]), window=4)
        assert np.allclose(full, windowed) == same
    np.testing.assert_allclose(  # window 4 at position 19: exactly plain attention over keys 16..19
        attention_vectorised(q, k, v, np.array([20]), np.array([1]), window=4),
        attention_vectorised(q, k[:, :, 16:], v[:, :, 16:], np.array([4]), np.array([1])), atol=1e-12)


def run_trial(rng: np.random.Generator, impl: str, window: int, dtype: torch.dtype, atol: float, *,
              max_len: int = 96, max_chunk: int = 8) -> int:
    """Random chunked ragged trial through `impl` with a sliding window; returns the calls checked."""
    hkv, g = int(rng.choice([1, 2])), int(rng.integers(1, 5))
    batch, d = int(rng.integers(1, 4)), 16
    cache, hist = new_pair(batch, hkv, max_len, d, dtype)
    finals = rng.integers(max_len // 2, max_len + 1, size=batch)
    calls = 0
    for T, n in schedule(rng, finals, max_chunk):
        k_new, v_new = rng.standard_normal((2, batch, hkv, T, d))
        q = rng.standard_normal((batch, hkv * g, T, d)) * 2.0
        cache.append(to_torch(k_new, dtype), to_torch(v_new, dtype), n)
        hist.append(k_new, v_new, n)
        kr = cache.k[0, :, :, :max_len].double().numpy()
        vr = cache.v[0, :, :, :max_len].double().numpy()
        qt = to_torch(q, dtype)
        expected = attention_vectorised(qt.double().numpy(), kr, vr, hist.lens, n, window=window)
        out = gqa_attention(qt, cache, n, impl=impl, window=window)
        np.testing.assert_allclose(out.double().numpy(), expected, atol=atol, rtol=0)
        for b in range(batch):
            assert not out[b, :, n[b]:].any(), "padded slots must be exact zeros"
        calls += 1
    return calls


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [1, 7, 16])
def test_every_formulation_matches_the_reference(impl: str, window: int) -> None:
    rng = np.random.default_rng(window)
    assert sum(run_trial(rng, impl, window, torch.float64, 1e-10) for _ in range(6)) > 6


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_fixed_chunks_ragged_batch_past_the_window(impl: str, chunk: int) -> None:
    """Three ragged rows (150, 97 and 3 tokens) fed in chunks of `chunk`, window 16: every call against both
    references, the later ones at positions many windows past W."""
    rng = np.random.default_rng(chunk)
    W, hkv, g, d, max_len = 16, 2, 3, 16, 160
    finals = np.array([150, 97, 3])
    cache = StaticKVCache(3, hkv, max_len, d, dtype=torch.float64)
    hist = History(3, hkv, max_len, d)
    for start in range(0, int(finals.max()), chunk):
        n = np.clip(finals - start, 0, chunk)
        k_new, v_new = rng.standard_normal((2, 3, hkv, chunk, d))
        q = rng.standard_normal((3, hkv * g, chunk, d))
        cache.append(to_torch(k_new, torch.float64), to_torch(v_new, torch.float64), n)
        hist.append(k_new, v_new, n)
        out = gqa_attention(to_torch(q, torch.float64), cache, n, impl=impl, window=W).numpy()
        np.testing.assert_allclose(out, attention_vectorised(q, hist.k, hist.v, hist.lens, n, window=W), atol=1e-10)
        np.testing.assert_allclose(out, attention_direct(q, hist.k, hist.v, hist.lens, n, window=W), atol=1e-10)
        assert not np.isnan(out).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_with_a_window(dtype: torch.dtype) -> None:
    """The decode kernel's float32 math (the default on the CPU for decode steps) over float32 and bfloat16 caches."""
    rng = np.random.default_rng(5)
    atol = 2e-5 if dtype == torch.float32 else 8e-2
    for impl in ("auto", "decode_kernel", "sdpa_folded"):
        assert run_trial(rng, impl, 9, dtype, atol, max_chunk=3) > 0


@pytest.mark.parametrize("block", [4, 8])
def test_split_key_reads_only_the_window_blocks(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    """With blocks of `block` keys and a window of 10, a decode step at any length reads the same few blocks per
    row (the window's run, a fixed count), never the read's; and the answer is the reference's."""
    import static_decode.core.split_attention as split

    monkeypatch.setattr(split, "SPLIT_BLOCK", block)
    seen: list[tuple[int, ...]] = []
    real = split.block_partials

    def spy(q, k, v, bias, scale):
        seen.append(tuple(k.shape))
        return real(q, k, v, bias, scale)

    monkeypatch.setattr(split, "block_partials", spy)
    rng = np.random.default_rng(block)
    W, hkv, d = 10, 2, 8
    _, nw = split.window_blocks(128, 1, W, block)
    assert nw == (W - 1) // block + 2
    for lens in ([40, 128, 7], [128, 100, 90], [11, 12, 13]):
        cache = StaticKVCache(3, hkv, 128, d, dtype=torch.float64)
        k, v = rng.standard_normal((2, 3, hkv, 128, d))
        cache.append(to_torch(k, torch.float64), to_torch(v, torch.float64), lens)
        q = rng.standard_normal((3, hkv * 2, 1, d))
        seen.clear()
        out = gqa_attention(to_torch(q, torch.float64), cache, [1, 1, 1], read_len=128, impl="split_key", window=W)
        assert seen == [(3 * hkv, nw, block, d)], seen  # nw blocks, not the read's 128 / block
        want = attention_vectorised(q, k, v, np.array(lens), np.array([1, 1, 1]), window=W)
        np.testing.assert_allclose(out.numpy(), want, atol=1e-10)


def test_split_key_window_covering_the_read_reads_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A window whose run covers every block of the read: the blocks stay strided views of the cache."""
    import static_decode.core.split_attention as split

    monkeypatch.setattr(split, "SPLIT_BLOCK", 8)
    ptrs = []
    real = split.block_partials
    monkeypatch.setattr(split, "block_partials",
                        lambda q, k, v, b, s: (ptrs.append(k.data_ptr()), real(q, k, v, b, s))[1])
    cache = StaticKVCache(1, 2, 64, 8, dtype=torch.float64)
    cache.append(torch.randn(1, 2, 30, 8, dtype=torch.float64), torch.randn(1, 2, 30, 8, dtype=torch.float64), [30])
    q = torch.randn(1, 4, 1, 8, dtype=torch.float64)
    out = gqa_attention(q, cache, [1], read_len=32, impl="split_key", window=20)  # 4 blocks, the run is 4
    assert ptrs == [cache.k.data_ptr()]
    torch.testing.assert_close(out, gqa_attention(q, cache, [1], read_len=32, impl="matmul", window=20))


def test_step_mask_of_a_window_is_checked_against_the_layer() -> None:
    lens, n = torch.tensor([5]), torch.tensor([1])
    mask = step_mask(lens, n, 1, 8, groups=2, dtype=torch.float32, impl="sdpa_folded", window=4)
    q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="built for window 4, this layer's is None"):
        grouped_attention(q, k, k, lens, n, impl="sdpa_folded", mask=mask)


def test_fresh_chunk_longer_than_the_window() -> None:
    """A fresh chunk (StepMask.causal) through a window shorter than it takes the window's mask; within it, the
    causal kernel, exactly the reference either way."""
    from static_decode.core.masks import FRESH

    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((1, 4, 24, 8)), *rng.standard_normal((2, 1, 2, 24, 8))
    lens = torch.tensor([24])
    for W in (5, 24, 100):
        out = grouped_attention(*(to_torch(x, torch.float64) for x in (q, k, v)), lens, lens, mask=FRESH, window=W)
        want = attention_vectorised(q, k, v, np.array([24]), np.array([24]), window=W)
        np.testing.assert_allclose(out.numpy(), want, atol=1e-10)


@pytest.mark.parametrize("impl", ["sdpa_folded", "matmul", "split_key", "decode_kernel"])
def test_compiled_attention_crosses_the_window_without_recompiling(impl: str) -> None:
    """One compiled graph (fullgraph, dynamic=False) for decode steps before, at and far past the window."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    fn = torch.compile(lambda q, k, v, lens, n: grouped_attention(q, k, v, lens, n, impl=impl, window=6),
                       backend=counter, fullgraph=True, dynamic=False)
    rng = np.random.default_rng(4)
    k, v = rng.standard_normal((2, 2, 2, 64, 16))
    for lengths in ([1, 3], [5, 6], [7, 12], [40, 63], [64, 2]):
        q = rng.standard_normal((2, 4, 1, 16))
        out = fn(*(to_torch(x, torch.float32) for x in (q, k, v)), torch.tensor(lengths), torch.tensor([1, 1]))
        want = attention_vectorised(q, k, v, np.array(lengths), np.array([1, 1]), window=6)
        np.testing.assert_allclose(out.double().numpy(), want, atol=2e-5)
    assert counter.frame_count == 1
