"""The int8 KV cache (core/kv_quant.py): the quantization formula, the in-place writes, and every formulation over it.

References: the formula written out in numpy float32 (the round trip must equal it bit for bit), and the float64 numpy
attention references (core/reference.py) over the dequantized K/V the cache holds: every formulation reads those
values, so it must agree with them to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from static_decode.core import kv_quant
from static_decode.core.attention import IMPLS, gqa_attention
from static_decode.core.cache import StaticKVCache
from static_decode.core.reference import attention_direct, attention_vectorised


def _formula(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scale = max |x| / 127 and code = round(x / scale) (half to even, clipped to +-127; 0 where scale is 0)."""
    x = x.astype(np.float32)
    scale = (np.abs(x).max(axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    codes = np.clip(np.round(x / safe[..., None]), -127, 127).astype(np.int8)
    return codes, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exactly_the_formula(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 4, 17, 64, generator=gen) * torch.rand(3, 4, 17, 1, generator=gen) * 10).to(dtype)
    x[0, 0, 0] = 0  # an all-zero row: scale 0, codes 0, exact zeros back
    codes, scales = kv_quant.quantize(x)
    want_codes, want_scales = _formula(x.float().numpy())
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    np.testing.assert_array_equal(scales.numpy(), want_scales)
    back = kv_quant.dequantize(codes, scales)
    np.testing.assert_array_equal(back.numpy(), want_codes.astype(np.float32) * want_scales[..., None])
    assert not back[0, 0, 0].any() and int(codes.abs().max()) == 127
    # Each value within half a step of its row's scale, the row's absmax exactly representable as +-127 steps.
    err = (back - x.float()).abs()
    assert bool((err <= scales[..., None] * (0.5 + 1e-4)).all())  # + the float32 rounding of code * scale


def test_writes_land_in_place_with_their_scales() -> None:
    cache = StaticKVCache(2, 2, 16, 8, layers=2, dtype=torch.int8)
    ptrs = [t.data_ptr() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale)]
    assert cache.k_scale.shape == (2, 2, 2, 17) and cache.k_scale.dtype == torch.float32
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 2, 5, 8, generator=gen)  # two [B, Hkv, T, d] chunks
    n = cache.validate([5, 3], 5)
    n_dev = cache.device_ints(n)
    cache.write(1, k, v, n_dev)
    cache.advance(n_dev)
    cache.commit(n)
    codes, scales = kv_quant.quantize(k)
    torch.testing.assert_close(cache.k[1, 0, :, :5], codes[0], rtol=0, atol=0)
    torch.testing.assert_close(cache.k_scale[1, 1, :, :3], scales[1, :, :3], rtol=0, atol=0)
    assert not cache.k_scale[1, 1, :, 3:16].any() and not cache.k[0].any()  # padded slots: the spare row only
    assert [t.data_ptr() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale)] == ptrs
    assert StaticKVCache(1, 1, 4, 8).k_scale is None


def test_refusals_name_the_value() -> None:
    with pytest.raises(TypeError, match=r"floating torch.dtype or torch.int8, got torch.int16"):
        StaticKVCache(1, 1, 4, 8, dtype=torch.int16)
    cache = StaticKVCache(1, 1, 4, 8, dtype=torch.int8)
    with pytest.raises(TypeError, match="k_new has dtype torch.int64"):
        cache.append(torch.zeros(1, 1, 1, 8, dtype=torch.int64), torch.zeros(1, 1, 1, 8, dtype=torch.int64), [1])
    with pytest.raises(TypeError, match="q has dtype torch.int8"):
        gqa_attention(torch.zeros(1, 1, 1, 8, dtype=torch.int8), cache, [0])
    assert int(cache.host_lens[0]) == 0


def _filled(B: int, hkv: int, d: int, max_len: int, chunks: list[list[int]], T: int, seed: int):
    """An int8 cache filled by chunks of T slots carrying n_new[b] tokens each; the last chunk's n_new."""
    gen = torch.Generator().manual_seed(seed)
    cache = StaticKVCache(B, hkv, max_len, d, dtype=torch.int8)
    for n_new in chunks:
        k, v = (torch.randn(B, hkv, T, d, generator=gen) * 2 for _ in range(2))
        cache.append(k, v, n_new)
    return cache, chunks[-1]


def _dequantized(cache: StaticKVCache, read: int) -> tuple[np.ndarray, np.ndarray]:
    k = cache.k[0, :, :, :read].double() * cache.k_scale[0, :, :, :read, None].double()
    v = cache.v[0, :, :, :read].double() * cache.v_scale[0, :, :, :read, None].double()
    return k.numpy(), v.numpy()


CASES = {  # name: (T, the chunks' n_new per row, window)
    "decode": (1, [[5, 7, 1], [5, 7, 1], [1, 1, 0]], None),
    "chunk7": (7, [[7, 3, 7], [7, 7, 2], [4, 7, 0]], None),
    "chunk64": (64, [[64, 20, 64], [33, 64, 1]], None),
    "window": (7, [[7, 7, 7], [7, 5, 7], [7, 7, 3]], 6),
    "decode_window": (1, [[7, 7, 7], [7, 5, 7], [1, 1, 1]], 4),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_formulation_reads_the_dequantized_cache(impl: str, case: str) -> None:
    """Ragged rows (one appending nothing in the last chunk: every slot padded, exact zeros), GQA 2, head_dim 16:
    the output equals the float64 reference over the values the cache holds."""
    T, chunks, window = CASES[case]
    if T == 1:  # decode cases: a chunk of 7 before the one-token steps
        cache, _ = _filled(3, 2, 16, 160, [c for c in chunks[:-1]], 7, seed=len(case))
        gen = torch.Generator().manual_seed(5)
        n_new = chunks[-1]
        cache.append(*(torch.randn(3, 2, 1, 16, generator=gen) for _ in range(2)), n_new)
    else:
        cache, n_new = _filled(3, 2, 16, 160, chunks, T, seed=len(case))
    read = cache.longest() + 3  # a read past the longest row, as a bucket is
    q = torch.randn(3, 4, T, 16, generator=torch.Generator().manual_seed(7)) * 2
    out = gqa_attention(q, cache, n_new, read_len=read, impl=impl, window=window)
    k, v = _dequantized(cache, read)
    lens, n = cache.host_lens, np.asarray(n_new)
    want = attention_vectorised(q.double().numpy(), k, v, lens, n, window)
    np.testing.assert_allclose(out.double().numpy(), want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(want, attention_direct(q.double().numpy(), k, v, lens, n, window), atol=1e-10)
    padded = [b for b in range(3) if n_new[b] < T]
    for b in padded:
        assert not out[b, :, n_new[b]:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_queries_over_an_int8_cache(dtype: torch.dtype) -> None:
    """A 16-bit model's queries: the SDPA formulations compute in float32 over the dequantized copy, the output
    returns in the queries' dtype."""
    cache, n_new = _filled(2, 2, 16, 64, [[7, 4], [3, 7]], 7, seed=3)
    q = torch.randn(2, 4, 7, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    for impl in ("sdpa_folded", "split_key", "decode_kernel"):
        out = gqa_attention(q, cache, n_new, impl=impl)
        assert out.dtype == dtype
        k, v = _dequantized(cache, cache.longest())
        want = attention_vectorised(q.double().numpy(), k, v, cache.host_lens, np.asarray(n_new))
        np.testing.assert_allclose(out.double().numpy(), want, atol=2e-2, rtol=2e-2)
