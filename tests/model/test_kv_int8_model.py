"""Llama.kv_dtype = "int8" on the embedded model: the same model over a float32 cache whose writes round K/V through
the int8 formula is the reference (the int8 cache then holds exactly those values), the compiled steps give the eager
tokens (through the fused decode layers for batch-1 steps), the bytes are counted exactly, and the perplexity stays
close.
"""

from __future__ import annotations

import math

import pytest
import torch

import static_decode.core.cache as cache_module
from static_decode import Generator
from static_decode.checkpoints.loading import default_model_path, load_model, load_tokenizer
from static_decode.commands.perplexity import default_text_path, perplexity
from static_decode.core import kv_quant
from static_decode.generation.memory import cache_bytes
from static_decode.model import fused_decode


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_path())


@pytest.fixture
def int8(model):
    model.kv_dtype = "int8"
    try:
        yield model
    finally:
        model.kv_dtype = None


def _quantizing_writes(monkeypatch) -> dict[str, torch.Tensor]:
    """Reference writes store code * scale of what they are given; the unrounded inputs also go to float buffers
    returned here ("k", "v": made at the first write, shaped as the cache's), so a test can see how near a rounding
    boundary each stored value was."""
    real = cache_module.write_slots
    raw: dict[str, torch.Tensor] = {}

    def rounded(k, v, lens, max_len, layer, k_new, v_new, n_new, **kw):
        if not raw:
            raw.update(k=torch.zeros_like(k), v=torch.zeros_like(v))
        real(raw["k"], raw["v"], lens, max_len, layer, k_new, v_new, n_new)
        k_new, v_new = (kv_quant.dequantize(*kv_quant.quantize(x)) for x in (k_new, v_new))
        real(k, v, lens, max_len, layer, k_new, v_new, n_new, **kw)

    monkeypatch.setattr(cache_module, "write_slots", rounded)
    return raw


# How near a rounding boundary (a code + 0.5) an unrounded value x / scale may lie for its code to differ: the two
# runs' K/V inputs agree within float32 rounding (~1e-6 relative, up to 127 code steps: ~1e-4 of a step).
BOUNDARY = 1e-3


def _codes_agree_but_at_boundaries(codes, scales, raw) -> None:
    """codes/scales (an int8 cache's, [L, B, H, S(, d)]) against the codes the reference quantizes its unrounded
    inputs `raw` to: scales within float32 rounding; a code may differ only by one step, and only where the
    reference's unrounded value lay within BOUNDARY of the boundary between the two codes (float32 rounding of the
    inputs moved it across)."""
    want_codes, want_scales = kv_quant.quantize(raw)
    torch.testing.assert_close(scales, want_scales, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(codes[0], want_codes[0], atol=0, rtol=0)  # the first layer's inputs are the same
    off = codes.to(torch.int32) != want_codes.to(torch.int32)
    if off.any():
        ratio = raw / torch.where(want_scales > 0, want_scales, 1.0)[..., None]
        step = (codes.to(torch.int32) - want_codes.to(torch.int32))[off]
        boundary = (codes.float() + want_codes.float())[off] / 2  # halfway between the two codes
        assert (step.abs() == 1).all(), step[step.abs() != 1]
        assert ((ratio[off] - boundary).abs() < BOUNDARY).all(), (ratio[off], boundary)


def test_steps_equal_a_float_cache_holding_the_dequantized_values(model, monkeypatch) -> None:
    """A prefill chunk (dequantized copy, SDPA) and token steps (the CPU kernel reading the codes): logits within
    float32 rounding of the float32 cache holding code * scale. A code of a later layer may be one step off where
    its value lay at a rounding boundary (which codes do depends on the ISA's float32 summation order)."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (2, 12), generator=gen)
    steps = torch.randint(0, model.config.vocab_size, (6, 2, 1), generator=gen)
    try:
        model.kv_dtype = "int8"
        cache = model.new_cache(2, 64)
        assert cache.quantized and cache.dtype == torch.int8
        got = [model(prompt, cache, [12, 9])] + [model(t, cache, [1, 1]) for t in steps]
    finally:
        model.kv_dtype = None
    raw = _quantizing_writes(monkeypatch)
    ref = model.new_cache(2, 64)
    want = [model(prompt, ref, [12, 9])] + [model(t, ref, [1, 1]) for t in steps]
    torch.testing.assert_close(kv_quant.dequantize(*kv_quant.quantize(raw["k"])), ref.k, atol=0, rtol=0)
    _codes_agree_but_at_boundaries(cache.k, cache.k_scale, raw["k"])
    _codes_agree_but_at_boundaries(cache.v, cache.v_scale, raw["v"])
    torch.testing.assert_close(got[0][0], want[0][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[0][1, :9], want[0][1, :9], atol=1e-4, rtol=1e-4)
    for g, w in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_the_boundary_check_refuses_a_code_off_away_from_a_boundary() -> None:
    """The check above is not loose: in a later layer, a code one step off where its value lay at a boundary passes;
    one step off a quarter step from the boundary fails, as does a code two steps off and any code off in layer 0."""
    raw = torch.tensor([1.27, 0.105, 0.2025, -0.5]).repeat(2, 1, 1, 1, 1)  # [L, B, H, S, d]; x / scale 127, 10.5, 20.25
    codes, scales = kv_quant.quantize(raw)
    _codes_agree_but_at_boundaries(codes, scales, raw)
    for layer, index, step, ok in ((1, 1, 1 if codes[1, 0, 0, 0, 1] == 10 else -1, True), (1, 2, 1, False),
                                   (1, 1, 2, False), (0, 1, 1, False)):
        bumped = codes.clone()
        bumped[layer, 0, 0, 0, index] += step
        if ok:
            _codes_agree_but_at_boundaries(bumped, scales, raw)
        else:
            with pytest.raises(AssertionError):
                _codes_agree_but_at_boundaries(bumped, scales, raw)


def test_compiled_greedy_equals_eager_with_an_int8_cache(int8) -> None:
    eager = Generator(int8, max_len=256, compile=False)
    compiled = Generator(int8, max_len=256, compile=True)
    prompt = [[1, 5, 9, 200, 31, 7]]
    assert compiled.generate(prompt, 12, stop_at_eos=False) == eager.generate(prompt, 12, stop_at_eos=False)
    assert compiled.cache.quantized


def test_compiled_steps_run_the_fused_layers_over_an_int8_cache(int8) -> None:
    """Batch-1 one-token steps take the fused decode layers (csrc/decode_layers.cpp), which quantize the new rows in
    place and read the codes; the tokens stay eager's and the cache holds what eager's holds."""
    assert fused_decode.unsupported(int8, int8.new_cache(1, 32)) is None
    eager = Generator(int8, max_len=128, batch=1, compile=False)
    compiled = Generator(int8, max_len=128, batch=1, compile=True)
    assert compiled.runner.regions.fused is not None
    prompt = [1, 5, 9, 200, 31, 7]
    assert compiled.generate(prompt, 16, stop_at_eos=False) == eager.generate(prompt, 16, stop_at_eos=False)
    with torch.profiler.profile() as prof:
        compiled.generate(prompt, 3, stop_at_eos=False)
    assert sum(1 for e in prof.events() if "decode_layers_kv8" in e.name) == 2  # the steps after the first token
    compiled.generate(prompt, 16, stop_at_eos=False)
    n = int(compiled.cache.lens[0])
    # The compiled and fused layers sum in another order than eager's: float32 rounding apart, which a code's
    # rounding can turn into a code one off (and later layers see those codes). Layer 0's inputs are the same.
    for name in ("k_scale", "v_scale"):
        got, want = getattr(compiled.cache, name)[..., :n], getattr(eager.cache, name)[..., :n]  # [L, 1, Hkv, n]
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-6)
    for name in ("k", "v"):
        got, want = (getattr(c.cache, name)[..., :n, :].int() for c in (compiled, eager))  # [L, 1, Hkv, n, d]
        assert (got[0] - want[0]).abs().max() <= 1 and (got - want).abs().max() <= 1
        assert (got != want).float().mean() < 0.03, f"{name}: {(got != want).sum()} codes of {got.numel()} differ"


def test_kv_bytes_are_exact_and_about_half_of_bfloat16(int8) -> None:
    c = int8.config
    cache = int8.new_cache(2, 300)
    held = sum(t.nbytes for t in (cache.k, cache.v, cache.k_scale, cache.v_scale, cache.lens))
    assert cache_bytes(c, 2, 300, torch.int8) == held
    rows = 2 * c.num_layers * 2 * c.num_kv_heads * 301  # K and V rows of every layer, batch 2, max_len + spare
    assert held == rows * (c.head_dim + 4) + 2 * 8
    bf16 = cache_bytes(c, 2, 300, torch.bfloat16)
    assert (held - 16) / (bf16 - 16) == (c.head_dim + 4) / (2 * c.head_dim)  # 0.53 at head_dim 64


def test_perplexity_close_to_the_float_cache(model) -> None:
    """512 tokens of the shipped text in chunks of 64 (prefill through the dequantized copy) and, for the last 48,
    one token a step (the CPU kernel). The bound: an int8 code is off by at most scale / 2 = absmax / 254 (0.4% of
    a row's largest value); for K that perturbs each score by about that fraction of its spread and for V each
    output the same, so the mean NLL should move by well under 1% of itself: 1% is allowed."""
    text = default_text_path().read_text()
    ids = load_tokenizer(default_model_path()).encode(text, add_special_tokens=False).ids[:512]
    base = perplexity(model, ids, 64)
    try:
        model.kv_dtype = "int8"
        prefill = perplexity(model, ids, 64)
        decode = perplexity(model, ids[:48], 1)
    finally:
        model.kv_dtype = None
    base_decode = perplexity(model, ids[:48], 1)
    assert math.isfinite(prefill.nll) and prefill.nll != base.nll
    assert abs(prefill.nll - base.nll) < 0.01 * base.nll, (prefill.nll, base.nll)
    assert abs(decode.nll - base_decode.nll) < 0.01 * base_decode.nll, (decode.nll, base_decode.nll)
