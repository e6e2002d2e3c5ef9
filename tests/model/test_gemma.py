"""Gemma2ForCausalLM and Gemma3ForCausalLM (text), loaded from checkpoints written by transformers' own classes
(eager attention: its path for softcapped scores) and checked against them.

Pins:
* what config.json says is read: (1 + weight) norms, four a layer, gelu-tanh, sqrt(hidden) embeddings, the score
  scale from query_pre_attn_scalar, interleaved windows (Gemma 2's alternation, Gemma 3's layer_types and
  sliding_window_pattern), Gemma 2's softcaps, Gemma 3's q/k norms and the sliding layers' own rope (5.x
  rope_parameters per layer type, 4.x rope_local_base_freq with a scaled global rope);
* float32 logits equal transformers' within 1e-4 fed in chunks of 1, 7 and 64 and as a ragged batch, windows of 16
  over a 64-token cache (prompts of 40: past the window), head_dim 256 and a small one;
* greedy tokens equal transformers' `generate`, eager and compiled (dynamo, eager backend);
* softcapping bites (a small cap gives other logits than none) and runs only through the formulations that take it
  ("auto" picks matmul; sdpa_folded, split_key, decode_kernel are refused naming the formulation); the fused
  decode layers refuse Gemma with a reason; Gemma 3 runs through every formulation.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from capture import BucketLadder, CaptureOptions, CompileSettings
from static_decode import Generator, load_model
from static_decode.model.fused_decode import unsupported
from static_decode.model.llama import Llama
from tests.support.checkpoints import feed, hf_family, hf_greedy, hf_logits, prompt, rewrite_config, save, to_4x_style

TOL = 1e-4
W = 16
MAX_LEN = 64
GREEDY = ("prefill", "first_greedy", "decode_greedy")
G3_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]

# name -> (family, hf_family kwargs, our per-layer windows)
VARIANTS = {
    "gemma2-256": ("gemma2", {"head_dim": 256, "sliding_window": W, "tied": True}, (W, None)),
    "gemma2-cap": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": W, "layers": 3,
                              "attn_logit_softcapping": 3.0, "final_logit_softcapping": 8.0, "attention_bias": True},
                   (W, None, W)),
    "gemma3": ("gemma3", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": W, "layers": 3,
                          "sliding_window_pattern": 2, "rope_local_base_freq": 1e4, "tied": True}, (W, None, W)),
    "gemma3-256": ("gemma3", {"head_dim": 256, "sliding_window": W, "layers": 3, "layer_types": G3_TYPES,
                              "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, (W, None, W)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, transformers model, its save_pretrained directory, our model loaded from it)."""
    family, kwargs, _ = VARIANTS[request.param]
    hf = hf_family(family, seed=3 + len(request.param), **kwargs)
    path = save(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, path, load_model(path)


def test_config_is_read(variant):
    name, hf, _, ours = variant
    c, h = ours.config, hf.config
    assert c.layer_windows == VARIANTS[name][2]
    assert (c.norm_plus_one, c.sandwich_norms, c.embed_scale, c.hidden_act) == (True, True, True, "gelu_pytorch_tanh")
    assert c.query_scale == pytest.approx(h.query_pre_attn_scalar**-0.5)
    assert (c.attn_softcap, c.final_softcap) == (h.attn_logit_softcapping, h.final_logit_softcapping)
    assert c.qk_norm == (c.architecture == "Gemma3ForCausalLM") and c.head_dim == h.head_dim
    if c.architecture == "Gemma3ForCausalLM":
        full, local = h.rope_parameters["full_attention"], h.rope_parameters["sliding_attention"]
        assert (c.rope.theta, c.local_rope.theta) == (full["rope_theta"], local["rope_theta"])
        assert c.rope.type == full["rope_type"] and c.local_rope.type == "default"
    assert set(ours.state_dict()) == {k.removeprefix("model.") for k, _ in hf.named_parameters()}
    assert unsupported(ours, ours.new_cache(1, 8)) is not None  # the kernel's layers are Llama's


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_logits_in_chunks(variant, chunk):
    _, hf, _, ours = variant
    seq = prompt(40, 1)
    ref = hf_logits(hf, seq)
    assert ref.std() > 0.5, "logits too flat for the comparison to mean anything"
    (got,) = feed(ours, [seq], chunk, max_len=MAX_LEN)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


def test_ragged_batch(variant):
    _, hf, _, ours = variant
    rows = [prompt(5, 1), prompt(23, 2), prompt(40, 3)]
    for row, got in zip(rows, feed(ours, rows, 7, max_len=MAX_LEN), strict=True):
        torch.testing.assert_close(got, hf_logits(hf, row), atol=TOL, rtol=0)


def test_greedy_equals_transformers_generate(variant):
    _, hf, _, ours = variant
    gen = Generator(ours, max_len=MAX_LEN, chunk_size=8, eos_token_ids=[])
    for seq in (prompt(13, 4), prompt(3, 5)):  # 30 new tokens: past the window
        assert gen.generate(seq, 30) == hf_greedy(hf, seq, 30, eos=None)


@pytest.mark.parametrize("name", ["gemma2-cap", "gemma3"])
def test_compiled_greedy_equals_eager_and_transformers(name, tmp_path):
    family, kwargs, _ = VARIANTS[name]
    hf = hf_family(family, seed=3 + len(name), **kwargs)
    model = load_model(save(hf, tmp_path))
    opts = CaptureOptions(buckets=BucketLadder((32, MAX_LEN)), settings=CompileSettings(backend="eager"),
                          kinds=GREEDY, progress=False)
    compiled = Generator(model, max_len=MAX_LEN, chunk_size=8, eos_token_ids=[], compile=True, capture=opts)
    eager = Generator(model, max_len=MAX_LEN, chunk_size=8, eos_token_ids=[])
    for seq in (prompt(13, 4), prompt(3, 5)):
        tokens = compiled.generate(seq, 30)
        assert tokens == eager.generate(seq, 30) == hf_greedy(hf, seq, 30, eos=None)
    records = compiled.capture_records
    assert records and all((r.graph_breaks, r.fallback) == (0, "") for r in records)  # compiled, not eager
    compiled.runner.close()


@pytest.mark.parametrize("name", ["gemma2-256", "gemma2-cap"])
def test_softcaps_change_the_logits(name, tmp_path):
    family, kwargs, _ = VARIANTS[name]
    ours = load_model(save(hf_family(family, seed=3 + len(name), **kwargs), tmp_path))
    seq = prompt(30, 9)
    for keys in ({"attn_softcap": None}, {"final_softcap": None}):
        other = Llama(dataclasses.replace(ours.config, **keys))
        other.load_state_dict(ours.state_dict())
        (a,) = feed(ours, [seq], 7, max_len=MAX_LEN)
        (b,) = feed(other, [seq], 7, max_len=MAX_LEN)
        assert (a - b).abs().max() > 1e-3, keys


@pytest.mark.parametrize("impl", ["matmul", "matmul_qk", "sdpa_folded", "split_key", "decode_kernel", "sdpa"])
def test_formulations(variant, impl):
    """Gemma 3 (no softcap) through every formulation; Gemma 2 through those that softcap, the others refused
    before anything is written."""
    _, hf, _, ours = variant
    seq = prompt(40, 8)
    ours.attn_impl = impl
    try:
        if ours.config.attn_softcap is not None and impl not in ("matmul", "matmul_qk"):
            cache = ours.new_cache(1, MAX_LEN)
            with pytest.raises(ValueError, match=f"'{impl}' cannot softcap"):
                ours(torch.tensor([seq[:7]]), cache, [7])
            assert cache.host_lens.tolist() == [0] and int(cache.k.abs().sum()) == 0
            return
        (got,) = feed(ours, [seq], 7, max_len=MAX_LEN)
    finally:
        ours.attn_impl = "auto"
    torch.testing.assert_close(got, hf_logits(hf, seq), atol=TOL, rtol=0)


def test_4x_style_config_loads_the_same_model(variant, tmp_path):
    """transformers 4.x Gemma 3 files: rope_theta + rope_scaling for the full layers, rope_local_base_freq."""
    name, _, src, ours = variant
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    if ours.config.architecture != "Gemma3ForCausalLM":
        rewrite_config(path, to_4x_style)
        assert load_model(path).config == ours.config
        return

    def old(c: dict) -> None:
        full, local = c.pop("rope_parameters")["full_attention"], VARIANTS[name][1].get("rope_local_base_freq", 1e4)
        c["rope_theta"] = full.pop("rope_theta")
        c["rope_scaling"] = full if full.get("rope_type") != "default" else None
        c["rope_local_base_freq"] = local

    rewrite_config(path, old)
    assert load_model(path).config == ours.config


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda c: c.update(hidden_activation="gelu"), ["hidden_activation", "gelu"]),
        (lambda c: c.update(use_bidirectional_attention=True), ["use_bidirectional_attention"]),
        (lambda c: c.update(layer_types=["sliding_attention", "local"]), ["layer_types", "local"]),
        (lambda c: c.update(sliding_window=None), ["sliding_window"]),
        (lambda c: c.update(query_pre_attn_scalar=0), ["query_pre_attn_scalar"]),
    ],
)
def test_config_errors_name_the_key(tmp_path, edit, words):
    path = save(hf_family("gemma2", head_dim=16), tmp_path)
    rewrite_config(path, edit)
    with pytest.raises(ValueError) as info:
        load_model(path)
    for w in words:
        assert w in str(info.value)
