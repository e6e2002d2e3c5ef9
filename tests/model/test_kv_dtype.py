"""Llama.kv_dtype: a K/V cache in another dtype than the model's (a bfloat16 / float16 cache for a float32 model).

The promise: K and V are rounded once, when written, and nothing else changes. So the reference is the same
float32 model whose cache writes round K/V through the cache dtype and back (float32 storage, float32 math): its
decode logits must match the half-precision cache's to float32 accuracy. A prefill chunk's SDPA runs in the
cache's dtype (queries cast to it), so prefill is compared with a bfloat16 tolerance.
"""

from __future__ import annotations

import pytest
import torch

import static_decode.core.cache as cache_module
from static_decode import Generator
from static_decode.checkpoints.loading import default_model_path, load_model
from static_decode.generation.memory import generation_bytes


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_path())


def _rounding_writes(monkeypatch, kv_dtype: torch.dtype) -> None:
    real = cache_module.write_slots

    def rounded(k, v, lens, max_len, layer, k_new, v_new, n_new):
        real(k, v, lens, max_len, layer, k_new.to(kv_dtype).float(), v_new.to(kv_dtype).float(), n_new)

    monkeypatch.setattr(cache_module, "write_slots", rounded)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_decode_equals_a_float32_cache_rounded_on_write(model, monkeypatch, kv_dtype) -> None:
    """Token-by-token steps (every one through the CPU kernel, float32 math): the half-precision cache and the
    float32 cache holding the same rounded values give bit-identical K/V in every layer and identical logits."""
    gen = torch.Generator().manual_seed(0)
    steps = torch.randint(0, model.config.vocab_size, (20, 2, 1), generator=gen)
    try:
        model.kv_dtype = kv_dtype
        half = model.new_cache(2, 64)
        assert half.dtype == kv_dtype
        got = [model(t, half, [1, 1]) for t in steps]
    finally:
        model.kv_dtype = None
    _rounding_writes(monkeypatch, kv_dtype)
    ref = model.new_cache(2, 64)
    assert ref.dtype == torch.float32
    want = [model(t, ref, [1, 1]) for t in steps]
    torch.testing.assert_close(half.k.float(), ref.k, atol=0, rtol=0)
    torch.testing.assert_close(half.v.float(), ref.v, atol=0, rtol=0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_prefill_chunk_computes_in_the_cache_dtype(model, monkeypatch) -> None:
    """A prefill chunk's attention (SDPA) runs in the cache's dtype: within bfloat16 rounding of the reference."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
    try:
        model.kv_dtype = torch.bfloat16
        got = model(prompt, model.new_cache(2, 64), [24, 17])
    finally:
        model.kv_dtype = None
    _rounding_writes(monkeypatch, torch.bfloat16)
    want = model(prompt, model.new_cache(2, 64), [24, 17])
    torch.testing.assert_close(got[0], want[0], atol=0.1, rtol=0.05)
    torch.testing.assert_close(got[1, :17], want[1, :17], atol=0.1, rtol=0.05)
    assert (got - want).abs().max() > 0  # not the float32 path in disguise


def test_compiled_greedy_equals_eager_with_a_bfloat16_cache(model) -> None:
    try:
        model.kv_dtype = torch.bfloat16
        eager = Generator(model, max_len=256, compile=False)
        compiled = Generator(model, max_len=256, compile=True)
        prompt = [[1, 5, 9, 200, 31, 7]]
        assert compiled.generate(prompt, 12, stop_at_eos=False) == eager.generate(prompt, 12, stop_at_eos=False)
        assert compiled.cache.dtype == torch.bfloat16
    finally:
        model.kv_dtype = None


def test_bad_kv_dtype_and_mismatched_cache_are_refused(model) -> None:
    with pytest.raises(ValueError, match="kv_dtype must be one of .* got torch.float64"):
        model.kv_dtype = torch.float64
    with pytest.raises(ValueError, match="got 'int4'"):
        model.kv_dtype = "int4"
    assert model.kv_dtype == model.dtype  # unchanged by the refusals
    cache = model.new_cache(1, 32)
    try:
        model.kv_dtype = "bfloat16"
        with pytest.raises(ValueError, match="use model.new_cache"):
            model(torch.zeros(1, 1, dtype=torch.int64), cache, [1])
    finally:
        model.kv_dtype = None
    assert int(cache.host_lens[0]) == 0


def test_memory_estimate_counts_the_cache_dtype(model) -> None:
    args = (model.config, 1, 4096, 64, 1, torch.float32)
    full, half = generation_bytes(*args), generation_bytes(*args, kv_dtype=torch.bfloat16)
    kv32 = 2 * model.config.num_layers * model.config.num_kv_heads * (4096 + 1) * model.config.head_dim * 4
    assert full - half == kv32 // 2
