"""Layer regions (capture.regions): the blocks compiled apart and called from the step graphs as one op per span.

The counting and token cases use backend="eager" (dynamo's graphs, no inductor) on a tiny random model; one
inductor case over the embedded model checks tokens against eager and that the region op writes the cache in place
(inductor must reinplace the op's declared mutation of K/V).
"""

from __future__ import annotations

import pytest
import torch

from capture import CaptureOptions, CompileSettings, count_compiles
from capture.regions import spans
from capture.settings import CPU_LAYER_REGIONS, CPU_OPTIONS
from static_decode import Generator, Llama, LlamaConfig, load_model
from static_decode.checkpoints.loading import default_model_path

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2)
REGIONS = CompileSettings(backend="eager", symbolic_read_len=True, layer_regions=2)
PROMPTS = [[5, 9, 2, 7, 7], [3] * 11 + [4, 8], [1, 2]]
INDUCTOR_REGIONS = CompileSettings(options=CPU_OPTIONS, symbolic_read_len=True, layer_regions=CPU_LAYER_REGIONS)


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CFG)


def test_spans_are_equal_and_cover_the_layers() -> None:
    assert spans(30, 2) == ((0, 15), (15, 30))
    assert spans(4, 3) == ((0, 2), (2, 4))  # 3 does not divide 4: the largest divisor below it
    assert spans(7, 2) == ((0, 7),)  # a prime layer count: one span (still compiled apart from the step)
    assert spans(2, 8) == ((0, 1), (1, 2))
    with pytest.raises(ValueError, match="regions=0"):
        spans(4, 0)


def test_settings_default_and_refusals() -> None:
    assert CompileSettings.for_device("cpu").layer_regions == CPU_LAYER_REGIONS == 2  # the CPU default
    assert CompileSettings.for_device("cuda").layer_regions == 0  # CUDA graphs replay the whole step
    assert "2 layer regions" in INDUCTOR_REGIONS.describe()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="layer_regions"):
            CompileSettings(layer_regions=bad)


def test_runner_refuses_regions_under_cuda_graphs(model: Llama, monkeypatch) -> None:
    monkeypatch.setattr(CompileSettings, "cudagraphs", lambda self, device: True)
    with pytest.raises(ValueError, match="layer_regions=2 needs steps without CUDA graphs"):
        Generator(model, max_len=32, chunk_size=8, batch=1, compile=True,
                  capture=CaptureOptions(settings=REGIONS, warm_up="lazy", progress=False))


def test_regions_give_eager_tokens_and_compile_once_for_every_kind(model: Llama) -> None:
    torch._dynamo.reset()
    eager = Generator(model, max_len=64, chunk_size=8, batch=3, eos_token_ids=[])
    with count_compiles() as c:
        gen = Generator(model, max_len=64, chunk_size=8, batch=3, compile=True, eos_token_ids=[],
                        capture=CaptureOptions(buckets=(32, 64), settings=REGIONS, progress=False))
    assert gen.runner.regions.spans == ((0, 2), (2, 4))
    graphs, regions = {}, {}
    for r in gen.capture_records:
        graphs[r.kind] = graphs.get(r.kind, 0) + r.graphs
        regions[r.kind] = regions.get(r.kind, 0) + r.region_graphs
    # Each step kind its own small graph; the region once per chunk shape (prefill 8, decode 1) for all kinds and
    # both spans, reported apart: the first decoding kind warmed up compiles it, the other reuses it.
    assert graphs == dict.fromkeys(("prefill", "first", "first_greedy", "decode", "decode_greedy"), 1)
    decoding = sorted(k for k in ("decode", "decode_greedy") if regions[k] == 1)
    assert regions["prefill"] == 1 and len(decoding) == 1 and regions["first"] == regions["first_greedy"] == 0
    assert c.counts.graphs == sum(graphs.values()) + sum(regions.values()) == 7 and c.counts.graph_breaks == 0
    assert gen.generate(PROMPTS, 10) == eager.generate(PROMPTS, 10)
    assert gen.generate(PROMPTS, 10, temperature=0.9, seed=3) == eager.generate(PROMPTS, 10, temperature=0.9, seed=3)
    assert model.layer_runner is None  # installed only around compiled calls
    gen.runner.close()
    torch._dynamo.reset()


def test_a_whole_step_setting_has_no_regions(model: Llama) -> None:
    gen = Generator(model, max_len=32, chunk_size=8, batch=1, compile=True, capture=CaptureOptions(
        settings=CompileSettings(backend="eager", symbolic_read_len=True), warm_up="lazy", progress=False))
    assert gen.runner.regions is None
    assert gen.generate([[1, 2, 3]], 4) == Generator(model, max_len=32, chunk_size=8).generate([[1, 2, 3]], 4)


def test_inductor_regions_equal_eager_and_write_the_cache_in_place() -> None:
    """Rule 1 through the region op: a functional copy of K/V would show as an aten op over a whole
    [L, B, Hkv, S, d] buffer in the profile of a generation."""
    torch._dynamo.reset()
    embedded = load_model(default_model_path())
    opts = CaptureOptions(buckets=(32, 64), settings=INDUCTOR_REGIONS, kinds=("prefill", "first_greedy",
                          "decode_greedy"), progress=False)
    gen = Generator(embedded, max_len=64, chunk_size=8, batch=3, compile=True, eos_token_ids=[], capture=opts)
    eager = Generator(embedded, max_len=64, chunk_size=8, batch=3, eos_token_ids=[])
    assert gen.generate(PROMPTS, 8) == eager.generate(PROMPTS, 8)
    whole = list(gen.cache.k.shape)
    with torch.profiler.profile(record_shapes=True) as prof:
        gen.generate(PROMPTS, 4)
    events = list(prof.events())
    # The profile saw the region ops, with the whole buffers as their inputs (so a copy would match the shape too).
    assert any("layer_region" in e.name and any(list(s) == whole for s in e.input_shapes) for e in events)
    copies = [e.name for e in events if e.name.startswith("aten::") and any(list(s) == whole for s in e.input_shapes)]
    assert not [c for c in copies if c in ("aten::copy_", "aten::clone", "aten::index_put", "aten::empty_like")]
    gen.runner.close()
    torch._dynamo.reset()
