"""The fused decode layers (static_decode/model/fused_decode.py, csrc/decode_layers.cpp) against the unfused layers.

bfloat16: bit for bit what the eager layers give (same kernels for the products and the attention, the same
roundings), the whole K/V cache included. float32: within rounding of the eager layers run with the "matmul"
attention (MKL's products, torch's softmax: nothing shared with the kernel). Then what capture.regions does with it:
a compiled batch-1 Generator decodes through it, with eager's tokens, the cache written in place, and no region
compiled for a one-token step.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from capture import CaptureOptions, CompileSettings, count_compiles
from static_decode import Generator, Llama, LlamaConfig, load_model
from static_decode.checkpoints.loading import default_model_path
from static_decode.core import kv_quant
from static_decode.kernels import cpu_kernel
from static_decode.model import rope
from static_decode.model.blocks import run_blocks, step_attention
from static_decode.model.fused_decode import FusedLayers, unsupported
from static_decode.steps.functions import GREEDY_KINDS

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")
needs_bf16_rows = pytest.mark.skipif(not cpu_kernel.bf16_rows(), reason="this CPU has neither AVX512-BF16 nor AVX2")

CFG = LlamaConfig(vocab_size=300, hidden_size=192, intermediate_size=400, num_layers=3, num_heads=6, num_kv_heads=2,
                  head_dim=32)


def random_model(dtype: torch.dtype, kv_dtype: torch.dtype | None = None, cfg: LlamaConfig = CFG) -> Llama:
    torch.manual_seed(0)
    model = Llama(cfg, dtype=dtype, kv_dtype=kv_dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # large enough that every layer moves x
    return model


def decode_layers(model: Llama, cache, token: int, n_new: int, read_len: int, *, fused: bool) -> torch.Tensor:
    """x after every layer for one decode slot (what Llama.hidden_states runs before its final norm)."""
    n = torch.tensor([n_new])
    positions = cache.lens[:, None] + torch.arange(1)  # [1, 1]
    cos, sin = rope.cos_sin(model.inv_freq, positions, model.dtype)  # [1, 1, 1, d/2]
    lens_after = cache.lens + n
    with torch.no_grad():
        x = model.embed_tokens(torch.tensor([[token]]))  # [1, 1, D]
        if fused:
            layers = FusedLayers(model, 0, len(model.layers))
            scales = (cache.k_scale, cache.v_scale) if cache.quantized else None
            return layers(x, cos, sin, cache.k, cache.v, cache.lens, n, lens_after, read_len, scales)
        groups = model.config.num_heads // model.config.num_kv_heads
        impl, mask = step_attention(model.attn_impl, groups, cache.kv_heads, lens_after, n, 1, read_len,
                                    cache.head_dim, cache.dtype)
        return run_blocks(model.layers, x, cos, sin, cache, n, lens_after, read_len, impl, mask)


def filled_cache(model: Llama, length: int, max_len: int = 1200):
    cache = model.new_cache(1, max_len)
    if length:
        with torch.no_grad():
            model(torch.randint(0, CFG.vocab_size, (1, length), generator=torch.Generator().manual_seed(1)), cache,
                  [length])
    return cache


def cache_pair(model: Llama, cached: int):
    """A cache holding `cached` tokens and an identical copy: one for the reference layers, one for the fused ones."""
    ref_cache = filled_cache(model, cached)
    return ref_cache, copy.deepcopy(ref_cache)


CASES = [(37, 1, 48), (37, 1, 37 + 1), (600, 1, 1024), (37, 0, 48), (0, 1, 16)]  # (cached, n_new, read_len)


@needs_bf16_rows
@pytest.mark.parametrize("kv_dtype", [None, torch.float32])
@pytest.mark.parametrize(("cached", "n_new", "read_len"), CASES)
def test_bfloat16_layers_are_eager_bit_for_bit(kv_dtype, cached, n_new, read_len) -> None:
    model = random_model(torch.bfloat16, kv_dtype)
    ref_cache, cache = cache_pair(model, cached)
    want = decode_layers(model, ref_cache, 17, n_new, read_len, fused=False)
    got = decode_layers(model, cache, 17, n_new, read_len, fused=True)
    assert torch.equal(got, want)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)  # the slot, and nothing else
    assert torch.equal(cache.lens, ref_cache.lens)  # the layers never advance the lengths


@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize(("cached", "n_new", "read_len"), CASES)
def test_float32_layers_match_an_independent_eager_step(kv_dtype, cached, n_new, read_len) -> None:
    model = random_model(torch.float32, kv_dtype)
    ref_cache, cache = cache_pair(model, cached)
    before_k = cache.k.clone()
    # The reference shares no kernel with the fused call where the formulations compute in float32 (a bfloat16
    # cache makes "matmul" compute in bfloat16: that reference takes the decode kernel, tested apart).
    model.attn_impl = "matmul" if kv_dtype is None else "auto"
    want = decode_layers(model, ref_cache, 17, n_new, read_len, fused=False)
    model.attn_impl = "auto"
    got = decode_layers(model, cache, 17, n_new, read_len, fused=True)
    assert want.abs().max() > 1.0  # the layers did move x
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(cache.k, ref_cache.k, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(cache.v, ref_cache.v, rtol=2e-5, atol=2e-5)
    pos = cached if n_new else cache.max_len  # a padded slot goes to the spare row
    changed = (cache.k != before_k).any(dim=-1).nonzero()[:, 3].unique().tolist()  # positions written
    assert changed == [pos]
    assert torch.isfinite(got).all()  # a padded slot's attention is zeros, not NaN


def _held(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache's K and V as the values they hold (code * scale), float32."""
    return kv_quant.dequantize(cache.k, cache.k_scale), kv_quant.dequantize(cache.v, cache.v_scale)


@needs_bf16_rows
@pytest.mark.parametrize(("cached", "n_new", "read_len"), CASES)
def test_bfloat16_layers_over_an_int8_cache_are_eager_bit_for_bit(cached, n_new, read_len) -> None:
    """The kernel quantizes the new row as core/kv_quant does (codes and scales exactly eager's) and reads the codes
    with the int8 attention, as the unfused decode step does."""
    model = random_model(torch.bfloat16, torch.int8)
    ref_cache, cache = cache_pair(model, cached)
    assert cache.quantized
    want = decode_layers(model, ref_cache, 17, n_new, read_len, fused=False)
    got = decode_layers(model, cache, 17, n_new, read_len, fused=True)
    assert torch.equal(got, want)
    for name in ("k", "v", "k_scale", "v_scale", "lens"):
        assert torch.equal(getattr(cache, name), getattr(ref_cache, name)), name


@pytest.mark.parametrize(("cached", "n_new", "read_len"), CASES)
def test_float32_layers_over_an_int8_cache_match_eager(cached, n_new, read_len) -> None:
    model = random_model(torch.float32, torch.int8)
    ref_cache, cache = cache_pair(model, cached)
    before = cache.k.clone(), cache.k_scale.clone()
    want = decode_layers(model, ref_cache, 17, n_new, read_len, fused=False)
    got = decode_layers(model, cache, 17, n_new, read_len, fused=True)
    # The products' summation order (MKL's against ours) can move a K/V value across a code's rounding boundary:
    # the values held agree within one step of their row's scale.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for held, ref, scale in zip(_held(cache), _held(ref_cache), (ref_cache.k_scale, ref_cache.v_scale), strict=True):
        assert ((held - ref).abs() <= scale[..., None] * 1.001 + 1e-7).all()
    pos = cached if n_new else cache.max_len  # a padded slot goes to the spare row
    changed = ((cache.k != before[0]).any(dim=-1) | (cache.k_scale != before[1])).nonzero()[:, 3].unique().tolist()
    assert changed == [pos]
    assert torch.isfinite(got).all()


def test_an_all_zero_row_is_written_as_scale_zero() -> None:
    """Layer 0's K/V projections zeroed: the new rows are all zeros, written as scale 0 and codes 0 (kv_quant's
    convention), and the attention over them stays finite."""
    model = random_model(torch.float32, torch.int8)
    with torch.no_grad():
        for w in (model.layers[0].self_attn.qkv_proj.weight,):
            w[CFG.num_heads * CFG.head_dim:] = 0.0  # the k and v rows of the joined projection
    cache = filled_cache(model, 5, max_len=64)
    got = decode_layers(model, cache, 17, 1, 32, fused=True)
    assert torch.isfinite(got).all()
    assert (cache.k[0, 0, :, 5] == 0).all() and (cache.v[0, 0, :, 5] == 0).all()
    assert (cache.k_scale[0, 0, :, 5] == 0).all() and (cache.v_scale[0, 0, :, 5] == 0).all()
    assert (cache.k_scale[1, 0, :, 5] > 0).all()  # the next layer's rows are not


def test_bad_calls_raise_before_writing() -> None:
    model = random_model(torch.float32)
    cache = filled_cache(model, 20, max_len=64)
    layers = FusedLayers(model, 0, len(model.layers))
    k, v = cache.k.clone(), cache.v.clone()
    n, lens_after = torch.tensor([1]), cache.lens + 1
    x = torch.randn(1, 1, CFG.hidden_size)
    cos, sin = rope.cos_sin(model.inv_freq, cache.lens[:, None], model.dtype)
    op = torch.ops.static_decode_cpu.decode_layers
    with pytest.raises(RuntimeError, match="read_len 65 outside 1..64"):
        layers(x, cos, sin, cache.k, cache.v, cache.lens, n, lens_after, 65)
    with pytest.raises(RuntimeError, match="26 weights for 3 layers"):
        op(x, cos, sin, cache.k, cache.v, cache.lens, n, lens_after, 32, layers.weights[:-1], 1e-5)
    with pytest.raises(RuntimeError, match=r"x must be one contiguous row \[1, 1, D\], got \[2, 1, 192\]"):
        layers(x.expand(2, 1, -1), cos, sin, cache.k, cache.v, cache.lens, n, lens_after, 32)
    bad = list(layers.weights)
    bad[4 + 9] = bad[4 + 9].t()  # layer 1's o_proj transposed
    with pytest.raises(RuntimeError, match="layer 1 weight 4"):
        op(x, cos, sin, cache.k, cache.v, cache.lens, n, lens_after, 32, bad, 1e-5)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_unsupported_names_what_keeps_a_model_off_the_kernel() -> None:
    model = random_model(torch.float32)
    assert unsupported(model, model.new_cache(1, 64)) is None
    assert "batch 2" in unsupported(model, model.new_cache(2, 64))
    assert "float16" in unsupported(random_model(torch.float16), random_model(torch.float16).new_cache(1, 64))
    for switch, why in (("mlp_bias", "biases"), ("qkv_bias", "biases"), ("qk_norm", "q/k norms")):
        other = random_model(torch.float32, cfg=dataclasses.replace(CFG, **{switch: True}))
        assert why in unsupported(other, other.new_cache(1, 64))
    # A head size this CPU's build has no code for (8 on AVX-512, 12 on AVX2 and the portable build): the sizes are
    # the ISA's, pinned for each ISA in tests/kernels/test_native_boundary.py.
    odd = next(d for d in range(8, 64, 4) if d not in cpu_kernel.head_dims())
    narrow = random_model(torch.float32, cfg=dataclasses.replace(CFG, head_dim=odd))
    assert f"head_dim {odd}" in unsupported(narrow, narrow.new_cache(1, 64))
    fits = random_model(torch.float32, cfg=dataclasses.replace(CFG, head_dim=cpu_kernel.head_dims()[0]))
    assert unsupported(fits, fits.new_cache(1, 64)) is None
    model.attn_impl = "sdpa"
    assert "'sdpa'" in unsupported(model, model.new_cache(1, 64))


def test_settings_switch() -> None:
    assert CompileSettings.for_device("cpu").fused_decode
    assert "fused decode" in CompileSettings.for_device("cpu").describe()
    assert not CompileSettings.for_device("cuda").fused_decode
    with pytest.raises(ValueError, match="needs layer_regions > 0"):
        CompileSettings(fused_decode=True)
    with pytest.raises(TypeError, match="fused_decode must be a bool"):
        CompileSettings(layer_regions=2, fused_decode=1)


PROMPTS = [[5, 9, 2, 7, 7, 1, 3], list(range(1, 40)), [4]]


def test_compiled_batch1_generator_decodes_through_the_kernel_with_eager_tokens() -> None:
    """The CPU default on the embedded model: one-token steps run the fused layers (no region compiled for them),
    tokens equal eager's, and the cache is written in place (no copy of a whole K/V buffer)."""
    torch._dynamo.reset()
    model = load_model(default_model_path())
    eager = Generator(model, max_len=128, chunk_size=16, batch=1)
    with count_compiles() as c:
        gen = Generator(model, max_len=128, chunk_size=16, batch=1, compile=True,
                        capture=CaptureOptions(buckets=(64, 128), kinds=GREEDY_KINDS, progress=False))
    regions = gen.runner.regions
    assert regions.fused is not None and regions.fused_why is None
    region_graphs: dict[str, int] = {}
    for r in gen.capture_records:
        region_graphs[r.kind] = region_graphs.get(r.kind, 0) + r.region_graphs
    # Only the prefill chunk compiles a region; the one-token kinds (first token, decode) run the kernel.
    assert region_graphs == {"prefill": 1, "first_greedy": 0, "decode_greedy": 0}
    assert c.counts.graphs == 3 + 1 and c.counts.graph_breaks == 0  # a graph per kind, and the prefill region
    for prompt in PROMPTS:
        assert gen.generate(prompt, 24, stop_at_eos=False) == eager.generate(prompt, 24, stop_at_eos=False)
    assert gen.generate(PROMPTS[1], 12, temperature=0.8, seed=5, stop_at_eos=False) == eager.generate(
        PROMPTS[1], 12, temperature=0.8, seed=5, stop_at_eos=False)
    whole = list(gen.cache.k.shape)
    with torch.profiler.profile(record_shapes=True) as prof:
        gen.generate(PROMPTS[0], 4, stop_at_eos=False)
    events = list(prof.events())
    assert any("decode_layers" in e.name and any(list(s) == whole for s in e.input_shapes) for e in events)
    # Each layer is a profiler range of its own inside the opaque op: 3 decode steps (the first token comes from
    # the prefill's hidden state) x 4 layers.
    calls = sum(1 for e in events if "decode_layers" in e.name)
    assert calls == 3 and sum(1 for e in events if e.name == "static_decode::decode_layer") == 4 * calls
    copies = [e.name for e in events if e.name.startswith("aten::") and any(list(s) == whole for s in e.input_shapes)]
    assert not [n for n in copies if n in ("aten::copy_", "aten::clone", "aten::index_put", "aten::empty_like")]
    gen.runner.close()

    off = dataclasses.replace(CompileSettings.for_device("cpu"), fused_decode=False)
    gen = Generator(model, max_len=128, chunk_size=16, batch=1, compile=True,
                    capture=CaptureOptions(settings=off, kinds=GREEDY_KINDS, warm_up="lazy", progress=False))
    assert gen.runner.regions.fused is None and gen.runner.regions.fused_why == "fused_decode=False"
    gen.runner.close()
    torch._dynamo.reset()
