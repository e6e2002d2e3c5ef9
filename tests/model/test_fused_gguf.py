"""The fused decode layers over GGUF blocks (`decode_layers_gguf`): a layer's projections in any mix of block types,
against the eager layers, whose one-row products call the same `gemv_gguf` (so they differ only where the fused
layers round or sum in another order); and every bad call refused before the cache is written."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from static_decode.kernels import cpu_kernel
from static_decode.model import quant, rope
from static_decode.model.fused_decode import FusedLayers, unsupported
from static_decode.model.gguf_quant import BlockLinear, BlockWeight
from static_decode.model.gguf_quantize import quantize_blocks
from tests.model.test_fused_decode import CFG, cache_pair, decode_layers, random_model

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")
# every K a multiple of 256: each K-quant takes each projection
GCFG = dataclasses.replace(CFG, hidden_size=256, intermediate_size=512, num_heads=8, head_dim=32)
MIXED = {"o_proj": "Q6_K", "down_proj": "Q8_0"}  # beside q4_k's Q4_K elsewhere, as a Q4_K_M file mixes them


def _dtypes() -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] if cpu_kernel.bf16_rows() else [torch.float32]


def _model(dtype: torch.dtype, kind: str):
    model = quant.quantize_model(random_model(dtype, cfg=GCFG), kind)
    if kind == "q4_k":  # some projections in other types
        for block in model.layers:
            for part in (block.self_attn, block.mlp):
                for name, t in MIXED.items():
                    if hasattr(part, name):
                        old = getattr(part, name).weight
                        w = old.dequantize(torch.float32)  # the Q4_K values, quantized again
                        setattr(part, name, BlockLinear(BlockWeight(quantize_blocks(w, t), t, w.shape[1], dtype), None))
    return model


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q8_0", "q5_k"])
@pytest.mark.parametrize(("cached", "n_new", "read_len"), [(37, 1, 48), (0, 1, 16), (37, 0, 48)])
def test_fused_gguf_layers_match_the_eager_ones(kind, dtype, cached, n_new, read_len):
    model = _model(dtype, kind)
    assert unsupported(model, model.new_cache(1, 64)) is None
    layers = FusedLayers(model, 0, len(model.layers))
    assert len(layers.types) == 7 * GCFG.num_layers and not layers.scales
    if kind == "q4_k":
        assert {12, 14, 8} == set(layers.types)  # Q4_K, Q6_K, Q8_0 in one call
    ref_cache, cache = cache_pair(model, cached)
    want = decode_layers(model, ref_cache, 17, n_new, read_len, fused=False)
    got = decode_layers(model, cache, 17, n_new, read_len, fused=True)
    assert want.abs().max() > 1.0  # the layers did move x
    # Every product quantizes its row to int8 codes (float32 models too): a last-bit difference in a norm (the two
    # sides sum in another order) can move a code by one step, 1/254 of its block's largest value, and bfloat16's
    # roundings grow through the random layers. Both sides agree where no code moved (AVX-512 here: to 1e-5).
    for a, b in ((got, want), (cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        err = (a.float() - b.float()).abs()
        limit = 0.03 if dtype == torch.bfloat16 else 0.01
        torch.testing.assert_close(a, b, rtol=limit, atol=limit * b.abs().max().item())
        assert err.mean() <= limit / 3 * b.float().abs().mean()


def test_an_int8_cache_or_a_mix_with_our_formats_stays_off_the_kernel():
    model = _model(torch.float32, "q8_0")
    model.kv_dtype = "int8"
    assert "an int8 cache with GGUF blocks" in unsupported(model, model.new_cache(1, 64))
    model.kv_dtype = None
    model.layers[0].mlp.down_proj = quant.QuantLinear(torch.randn(256, 512), None, quant.Scheme(8))
    assert "projections both GGUF blocks and int8" in unsupported(model, model.new_cache(1, 64))


def test_fused_gguf_layers_refuse_bad_calls_before_writing():
    model = _model(torch.float32, "q4_k")
    cache = model.new_cache(1, 64)
    layers = FusedLayers(model, 0, len(model.layers))
    k, v = cache.k.clone(), cache.v.clone()
    x = torch.randn(1, 1, GCFG.hidden_size)
    cos, sin = rope.cos_sin(model.inv_freq, cache.lens[:, None], model.dtype)
    args = (x, cos, sin, cache.k, cache.v, cache.lens, torch.tensor([1]), cache.lens + 1, 32)
    op = torch.ops.static_decode_cpu.decode_layers_gguf
    with pytest.raises(RuntimeError, match=f"20 GGUF types for {GCFG.num_layers} layers"):
        op(*args, layers.weights, layers.types[:-1], 1e-5)
    types = list(layers.types)
    types[0] = 5
    with pytest.raises(RuntimeError, match="layer 0 weight 1's GGUF type 5 is not one the kernels read"):
        op(*args, layers.weights, types, 1e-5)
    types = list(layers.types)
    types[0] = 8  # Q8_0: the Q4_K bytes of q_proj are not its row's bytes
    with pytest.raises(RuntimeError, match=r"layer 0 weight 1 is Byte \[256, 144\]; Q8_0 blocks of a \[256, 256\]"):
        op(*args, layers.weights, types, 1e-5)
    floats = list(layers.weights)
    floats[4] = torch.randn(256, 256)  # a float weight where layer 0's o_proj blocks belong
    with pytest.raises(RuntimeError, match="layer 0 weight 4 is Float"):
        op(*args, floats, layers.types, 1e-5)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)
