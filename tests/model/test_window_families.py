"""Sliding windows shorter than the cache, against the transformers model that wrote each checkpoint.

Pins, for Mistral (window 16 on every layer), Qwen2 (use_sliding_window, max_window_layers: layer 0 full, the
others windowed) and Qwen3 (5.x `layer_types`: windowed, full, windowed):
* each loads with max_len 128 (8x the window), reading its per-layer windows from config.json;
* float32 logits equal transformers' within 1e-4 for a 100-token prompt fed in chunks of 1, 7 and 64 and a ragged
  batch, so every position up to 6x the window is checked; the window matters there (the same weights without it
  give other logits);
* greedy tokens equal transformers' `generate` past the window, eager and compiled, and the compiled steps compile
  nothing new while positions cross the window (fail_on_recompile); the compiled batch-1 Mistral decodes through
  the fused decode layers with the window in the kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import static_decode.core.split_attention as split
from capture import BucketLadder, CaptureOptions, CompileSettings, fail_on_recompile
from static_decode import Generator, load_model
from static_decode.kernels import cpu_kernel
from static_decode.model.llama import Llama
from tests.support.checkpoints import feed, hf_family, hf_greedy, hf_logits, prompt, rewrite_config, save

TOL = 1e-4
W = 16
MAX_LEN = 128  # 8x the window
GREEDY = ("prefill", "first_greedy", "decode_greedy")
QWEN3_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]

# name -> (family, hf_family kwargs, our per-layer windows)
VARIANTS = {
    "mistral": ("mistral", {"sliding_window": W}, (W, W)),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1, "layers": 3},
              (None, W, W)),
    "qwen3": ("qwen3", {"use_sliding_window": True, "sliding_window": W, "layer_types": QWEN3_TYPES, "layers": 3,
                        "head_dim": 16}, (W, None, W)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, transformers model, its save_pretrained directory, our model loaded from it)."""
    family, kwargs, _ = VARIANTS[request.param]
    hf = hf_family(family, seed=7 + len(request.param), **kwargs)
    path = save(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, path, load_model(path)


def test_per_layer_windows_are_read(variant, tmp_path):
    name, hf, path, ours = variant
    assert ours.config.layer_windows == VARIANTS[name][2]
    assert tuple(b.self_attn.window for b in ours.layers) == VARIANTS[name][2]
    if name != "mistral":  # transformers' own Qwen layers say which of them slide
        assert tuple(layer.self_attn.sliding_window for layer in hf.model.layers) == VARIANTS[name][2]
    ours.new_cache(1, 4 * W)  # past the window: no refusal
    ours.new_cache(1, MAX_LEN)


def test_qwen2_4x_file_reads_max_window_layers(tmp_path):
    """A 4.x Qwen2 file has no layer_types: the layers from max_window_layers on slide."""
    family, kwargs, windows = VARIANTS["qwen2"]
    path = save(hf_family(family, **kwargs), tmp_path)
    rewrite_config(path, lambda c: c.pop("layer_types", None))
    assert load_model(path).config.layer_windows == windows


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_logits_in_chunks_past_the_window(variant, chunk):
    _, hf, _, ours = variant
    seq = prompt(100, 3)
    ref = hf_logits(hf, seq)
    assert ref.std() > 0.5, "logits too flat for the comparison to mean anything"
    (got,) = feed(ours, [seq], chunk, max_len=MAX_LEN)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


def test_ragged_batch_past_the_window(variant):
    _, hf, _, ours = variant
    rows = [prompt(100, 4), prompt(61, 5), prompt(5, 6)]
    for row, got in zip(rows, feed(ours, rows, 7, max_len=MAX_LEN), strict=True):
        torch.testing.assert_close(got, hf_logits(hf, row), atol=TOL, rtol=0)


@pytest.mark.parametrize("impl", ["split_key", "sdpa_folded", "matmul", "sdpa"])
def test_every_formulation_in_the_model(variant, impl):
    """The same prompt through each named formulation, chunks of 7 (decode_kernel, auto's pick, is above)."""
    _, hf, _, ours = variant
    seq = prompt(90, 8)
    ours.attn_impl = impl
    try:
        (got,) = feed(ours, [seq], 7, max_len=MAX_LEN)
    finally:
        ours.attn_impl = "auto"
    torch.testing.assert_close(got, hf_logits(hf, seq), atol=TOL, rtol=0)


def test_the_window_changes_the_logits(variant):
    """Without its window the same model gives other logits past W (the comparisons above can fail)."""
    _, hf, _, ours = variant
    seq = prompt(60, 9)
    full = Llama(dataclasses.replace(ours.config, sliding_window=None, sliding_layers=None))
    full.load_state_dict(ours.state_dict())
    (windowed,) = feed(ours, [seq], 7, max_len=MAX_LEN)
    (unwindowed,) = feed(full, [seq], 7, max_len=MAX_LEN)
    torch.testing.assert_close(windowed[:W], unwindowed[:W], atol=TOL, rtol=0)  # within the window: the same
    assert (windowed[W:] - unwindowed[W:]).abs().max() > 1e-2


def test_greedy_equals_transformers_generate_past_the_window(variant):
    _, hf, _, ours = variant
    gen = Generator(ours, max_len=MAX_LEN, chunk_size=8, eos_token_ids=[])
    for seq in (prompt(13, 4), prompt(40, 5)):  # 60 new tokens: positions up to 6x the window
        assert gen.generate(seq, 60) == hf_greedy(hf, seq, 60, eos=None)


@pytest.mark.parametrize("chunk", [1, 8])
def test_split_key_reading_window_blocks_equals_transformers(variant, monkeypatch, chunk):
    """split_key with blocks of 16 over reads of the whole 128-key cache: each windowed layer reads only its rows'
    runs of blocks ((W + chunk - 2) // 16 + 2 of the read's 8), the full layers all 8; logits as transformers'."""
    _, hf, _, ours = variant
    monkeypatch.setattr(split, "SPLIT_BLOCK", 16)
    reads: list[int] = []
    real = split.block_partials

    def spy(q, k, v, bias, scale):
        reads.append(k.shape[1])
        return real(q, k, v, bias, scale)

    monkeypatch.setattr(split, "block_partials", spy)
    seq = prompt(100, 2)
    cache = ours.new_cache(1, MAX_LEN)
    ours.attn_impl = "split_key"
    try:
        with torch.no_grad():
            got = torch.cat([ours(torch.tensor([seq[i:i + chunk]]), cache, [len(seq[i:i + chunk])],
                                  read_len=MAX_LEN)[0] for i in range(0, len(seq), chunk)])
    finally:
        ours.attn_impl = "auto"
    torch.testing.assert_close(got, hf_logits(hf, seq), atol=TOL, rtol=0)
    run = (W + chunk - 2) // 16 + 2
    windows = ours.config.layer_windows
    calls = -(-len(seq) // chunk)
    assert reads == [run if w is not None else MAX_LEN // 16 for w in windows] * calls


def _compiled(model: Llama, settings: CompileSettings | None) -> Generator:
    opts = CaptureOptions(buckets=BucketLadder((32, 64, MAX_LEN)), settings=settings, kinds=GREEDY, progress=False)
    return Generator(model, max_len=MAX_LEN, chunk_size=8, eos_token_ids=[], batch=1, compile=True, capture=opts)


REGIONS = CompileSettings(backend="eager", symbolic_read_len=True, layer_regions=2, fused_decode=True)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiled_greedy_crosses_the_window_without_recompiling(name, tmp_path):
    family, kwargs, _ = VARIANTS[name]
    hf = hf_family(family, seed=7 + len(name), **kwargs)
    ours = load_model(save(hf, tmp_path))
    torch._dynamo.reset()
    gen = _compiled(ours, REGIONS)
    if name == "mistral" and cpu_kernel.available():  # no biases, no q/k norms: the fused decode layers take it
        assert gen.runner.regions.fused is not None and gen.runner.regions.fused.windows == [W, W]
    seq = prompt(10, 11)
    with fail_on_recompile():  # every bucket warmed up: nothing compiles while positions pass W, 2W, ... 4W
        tokens = gen.generate(seq, 70)
    assert tokens == hf_greedy(hf, seq, 70, eos=None)
    records = gen.capture_records
    assert records and all((r.graph_breaks, r.fallback) == (0, "") for r in records)  # compiled, not eager
    gen.runner.close()
    torch._dynamo.reset()


@pytest.mark.slow
def test_mistral_inductor_greedy_past_the_window(tmp_path):
    """The CPU default compile (inductor, layer regions, fused decode layers) over a windowed model."""
    family, kwargs, _ = VARIANTS["mistral"]
    hf = hf_family(family, seed=7 + len("mistral"), **kwargs)
    torch._dynamo.reset()
    gen = _compiled(load_model(save(hf, tmp_path)), None)
    seq = prompt(10, 12)
    with fail_on_recompile():
        tokens = gen.generate(seq, 60)
    assert tokens == hf_greedy(hf, seq, 60, eos=None)
    gen.runner.close()
    torch._dynamo.reset()
