"""The fused decode layers (csrc/decode_layers.cpp) of a model mixing windowed and full layers, against the unfused
layers, and with the keys before each windowed layer's window poisoned (never read).

bfloat16: bit for bit the eager layers (the same decode kernel with the same window, the same roundings); float32:
within rounding of the eager layers with the "matmul" attention (nothing shared with the kernel).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from static_decode.kernels import cpu_kernel
from static_decode.model import rope
from static_decode.model.blocks import layer_windows, run_blocks, step_attention
from static_decode.model.fused_decode import FusedLayers, unsupported
from static_decode.model.llama import Llama
from tests.model.test_fused_decode import CFG, cache_pair, random_model

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")
needs_bf16_rows = pytest.mark.skipif(not cpu_kernel.bf16_rows(), reason="this CPU has neither AVX512-BF16 nor AVX2")

W = 40
MIXED = dataclasses.replace(CFG, sliding_window=W, sliding_layers=(True, False, True))  # windowed, full, windowed
CASES = [(600, 1, 1024), (37, 1, 48), (W - 1, 1, 64), (W, 1, 64), (600, 0, 1024)]  # (cached, n_new, read_len)


def decode_layers(model: Llama, cache, token: int, n_new: int, read_len: int, *, fused: bool) -> torch.Tensor:
    """x after every layer for one decode slot: the fused call, or the eager blocks with one mask per window."""
    n = torch.tensor([n_new])
    cos, sin = rope.cos_sin(model.inv_freq, cache.lens[:, None], model.dtype)  # [1, 1, 1, d/2]
    lens_after = cache.lens + n
    with torch.no_grad():
        x = model.embed_tokens(torch.tensor([[token]]))  # [1, 1, D]
        if fused:
            return FusedLayers(model, 0, len(model.layers))(x, cos, sin, cache.k, cache.v, cache.lens, n, lens_after,
                                                            read_len)
        groups = model.config.num_heads // model.config.num_kv_heads
        impl, masks = step_attention(model.attn_impl, groups, cache.kv_heads, lens_after, n, 1, read_len,
                                     cache.head_dim, cache.dtype, windows=layer_windows(model.layers))
        return run_blocks(model.layers, x, cos, sin, cache, n, lens_after, read_len, impl, masks)


def test_the_fused_layers_take_a_windowed_model() -> None:
    model = random_model(torch.float32, cfg=MIXED)
    assert unsupported(model, model.new_cache(1, 64)) is None
    assert FusedLayers(model, 0, 3).windows == [W, 0, W]
    assert FusedLayers(model, 1, 2).windows == []  # the full layer alone: no window argument at all
    assert FusedLayers(random_model(torch.float32), 0, 3).windows == []


@pytest.mark.parametrize(("cached", "n_new", "read_len"), CASES)
def test_float32_windowed_layers_match_an_independent_eager_step(cached, n_new, read_len) -> None:
    model = random_model(torch.float32, cfg=MIXED)
    ref_cache, cache = cache_pair(model, cached)
    model.attn_impl = "matmul"
    want = decode_layers(model, ref_cache, 17, n_new, read_len, fused=False)
    model.attn_impl = "auto"
    got = decode_layers(model, cache, 17, n_new, read_len, fused=True)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(cache.k, ref_cache.k, rtol=2e-5, atol=2e-5)
    assert torch.isfinite(got).all()


@needs_bf16_rows
@pytest.mark.parametrize(("cached", "n_new", "read_len"), CASES)
def test_bfloat16_windowed_layers_are_eager_bit_for_bit(cached, n_new, read_len) -> None:
    model = random_model(torch.bfloat16, cfg=MIXED)
    ref_cache, cache = cache_pair(model, cached)
    want = decode_layers(model, ref_cache, 17, n_new, read_len, fused=False)
    got = decode_layers(model, cache, 17, n_new, read_len, fused=True)
    assert torch.equal(got, want)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)


def test_keys_before_the_window_are_never_read() -> None:
    """NaN in the windowed layers' K/V before the new token's window: the same output, no NaN; the full layer reads
    all of its keys (NaN there does reach the output)."""
    model = random_model(torch.float32, cfg=MIXED)
    cached = 600
    ref_cache, cache = cache_pair(model, cached)
    want = decode_layers(model, ref_cache, 17, 1, 1024, fused=True)
    first = cached - W + 1  # the new token at position 600 sees 561..600
    for layer in (0, 2):
        cache.k[layer, :, :, :first] = cache.v[layer, :, :, :first] = float("nan")
    got = decode_layers(model, cache, 17, 1, 1024, fused=True)
    assert torch.equal(got, want)
    cache.k[1, :, :, :first] = float("nan")
    assert torch.isnan(decode_layers(model, cache, 17, 1, 1024, fused=True)).any()
