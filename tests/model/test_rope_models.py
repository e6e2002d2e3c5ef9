"""Tiny random Llama checkpoints with each RoPE scaling against the transformers model that wrote them.

Pins:
* float32 logits within 1e-4 of transformers' for a prompt fed in chunks across the original context
  (transformers fed the same chunks through its cache: the tables of "dynamic" and "longrope" follow each
  forward call's last position), and for a ragged batch whose rows sit at different lengths, each row against
  its own run; the scaled logits differ from the unscaled model's past the context;
* a forward at position ~100,000 equals transformers' over the same keys (both caches hold the same random
  100,000 keys and values, transformers given the positions explicitly), without a 100k-token prefill;
* a model rotating half of each head equals transformers' Llama given Phi3's partial application; the fused
  decode kernel refuses it;
* greedy tokens of a compiled longrope model equal eager ones and transformers' while the row passes the
  original context, with no graph break, recompile or fallback (and through inductor for dynamic, marked slow).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capture import BucketLadder, CaptureOptions, CompileSettings, steady_state
from static_decode import Generator, Llama, load_model
from static_decode.model.config import LlamaConfig
from static_decode.model.fused_decode import unsupported
from static_decode.model.rope_config import RopeConfig
from tests.support.checkpoints import feed, hf_greedy, hf_logits, prompt, rewrite_config, save
from tests.support.rope_cases import HEAD_DIM, factors, hf_chunked, hf_model

TOL = 1e-4


# ---- logits against transformers ---------------------------------------------------------------------------------
# name -> (rope dict, max_position_embeddings): contexts small enough that a 45-token prompt passes them.
MODELS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, 64),
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, 24),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 64),
    "yarn-mscale": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
         "mscale_all_dim": 0.5, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False},
        64,
    ),
    "longrope": (
        {"rope_type": "longrope", "short_factor": factors(HEAD_DIM // 2, 5, 1.0, 1.5),
         "long_factor": factors(HEAD_DIM // 2, 6, 1.0, 8.0), "original_max_position_embeddings": 16},
        64,
    ),
}


@pytest.fixture(scope="module", params=list(MODELS))
def pair(request, tmp_path_factory):
    """(name, transformers model, our model loaded from its save_pretrained directory)."""
    hf = hf_model(*MODELS[request.param], seed=len(request.param))
    return request.param, hf, load_model(save(hf, tmp_path_factory.mktemp(request.param)))


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_logits_equal_transformers_fed_the_same_chunks(pair, chunk):
    name, hf, model = pair
    seq = prompt(45, 1)  # past every original context above
    ref = hf_chunked(hf, seq, chunk)
    assert ref.std() > 0.5, "logits too flat for the comparison to mean anything"
    (got,) = feed(model, [seq], chunk)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)
    if name not in ("dynamic", "longrope"):  # a fixed table: the whole-sequence forward is the same function
        torch.testing.assert_close(got, hf_logits(hf, seq), atol=TOL, rtol=0)


def feed_staggered(model, rows: list[list[int]], chunk: int, first: list[int]) -> list[torch.Tensor]:
    """Feed rows together in chunks, row b joining at step first[b] (so rows sit at different lengths in one step);
    return each row's logits [len(row), V]."""
    cache = model.new_cache(len(rows), 128)
    got: list[list[torch.Tensor]] = [[] for _ in rows]
    done = [0] * len(rows)
    step = 0
    while any(d < len(r) for d, r in zip(done, rows, strict=True)):
        n = [min(chunk, len(r) - done[b]) if step >= first[b] else 0 for b, r in enumerate(rows)]
        tokens = torch.full((len(rows), chunk), 7, dtype=torch.int64)  # [B, chunk]
        for b, row in enumerate(rows):
            tokens[b, : n[b]] = torch.tensor(row[done[b] : done[b] + n[b]], dtype=torch.int64)
        with torch.no_grad():
            logits = model(tokens, cache, n)  # [B, chunk, V]
        for b in range(len(rows)):
            got[b].append(logits[b, : n[b]])
            done[b] += n[b]
        step += 1
    return [torch.cat(g) for g in got]


def test_ragged_rows_each_equal_their_own_run(pair):
    """Row 1 is fed while row 0 is past the original context: each row keeps the table its own length picks."""
    _, hf, model = pair
    rows = [prompt(45, 4), prompt(10, 2), prompt(30, 3)]
    for row, got in zip(rows, feed_staggered(model, rows, 7, first=[0, 4, 1]), strict=True):
        torch.testing.assert_close(got, hf_chunked(hf, row, 7), atol=TOL, rtol=0)


def test_the_tables_change_the_logits_past_the_context(pair):
    """The same weights under the default rope give other logits past the original context (not a vacuous pass)."""
    name, hf, model = pair
    plain = Llama(LlamaConfig(**{**model.config.__dict__, "rope": RopeConfig()}))
    plain.load_state_dict(model.state_dict())
    seq = prompt(45, 1)
    (scaled,), (unscaled,) = feed(model, [seq], 16), feed(plain, [seq], 16)
    assert (scaled[-8:] - unscaled[-8:]).abs().max() > 1e-2


# ---- far positions: ~100,000 without a 100k-token prefill -------------------------------------------------------
FAR = {
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 32768),
    "longrope": (
        {"rope_type": "longrope", "short_factor": factors(HEAD_DIM // 2, 7, 1.0, 1.2),
         "long_factor": factors(HEAD_DIM // 2, 8, 1.0, 30.0), "original_max_position_embeddings": 4096},
        131072,
    ),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 131072),
}
CACHED = 99_996  # keys already cached: the 4 new tokens sit at 99,996..99,999 (the row's length after: 100,000)


def _far_logits_hf(hf, keys, values, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """transformers over the same cached keys: its cache holds keys/values [layers, 1, Hkv, CACHED, d], the new
    tokens are given their positions explicitly (start.. : the rotation, the causal mask and the table)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    for layer in range(keys.shape[0]):
        cache.update(keys[layer].clone(), values[layer].clone(), layer)
    pos = torch.arange(start, start + tokens.shape[1])
    with torch.no_grad():
        out = hf(input_ids=tokens, cache=cache, position_ids=pos[None], cache_position=pos, use_cache=True)
    return out.logits[0].float()


@pytest.mark.parametrize("name", list(FAR))
def test_a_forward_near_position_100k_equals_transformers(name, tmp_path):
    hf = hf_model(*FAR[name], seed=11)
    model = load_model(save(hf, tmp_path))
    c = model.config
    g = torch.Generator().manual_seed(0)
    # Random cached K (large, so the softmax is peaked and follows the queries' rotation closely) and V.
    keys = 3 * torch.randn(c.num_layers, 1, c.num_kv_heads, CACHED, c.head_dim, generator=g)
    values = torch.randn(c.num_layers, 1, c.num_kv_heads, CACHED, c.head_dim, generator=g)
    tokens = torch.tensor([prompt(4, 9)])
    cache = model.new_cache(1, CACHED + 4)
    n = torch.tensor([CACHED])
    for layer in range(c.num_layers):  # the cache positioned at CACHED, holding exactly transformers' keys
        cache.write(layer, keys[layer], values[layer], n)
    cache.advance(n)
    cache.commit(np.array([CACHED]))
    with torch.no_grad():
        got = model(tokens, cache, [4])[0]  # [4, V]
    ref = _far_logits_hf(hf, keys, values, tokens, CACHED)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)
    # The queries' positions decide the result: the same keys read from 50,000 positions earlier differ.
    assert (_far_logits_hf(hf, keys, values, tokens, CACHED - 50_000) - ref).abs().max() > 1e-2


# ---- partial rotary ---------------------------------------------------------------------------------------------
def test_a_model_rotating_half_of_each_head_equals_transformers(tmp_path, monkeypatch):
    """transformers' Llama given Phi3's partial application (its rotary class already makes rot_dim-wide tables for
    the scaled types) against our model built with the same partial rope."""
    import transformers.models.llama.modeling_llama as hf_llama_module
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    params = {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}
    hf = hf_model(params, 64, seed=4)
    monkeypatch.setattr(hf_llama_module, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    path = save(hf, tmp_path)
    rewrite_config(path, lambda c: c["rope_parameters"].pop("partial_rotary_factor"))  # refused for Llama files
    whole = load_model(path)
    half = RopeConfig(type="linear", factor=2.0, partial_rotary_factor=0.5)
    model = Llama(LlamaConfig(**{**whole.config.__dict__, "rope": half}))
    model.load_state_dict(whole.state_dict())
    assert model.inv_freq.shape == (HEAD_DIM // 4,)
    seq = prompt(40, 5)
    ref = hf_logits(hf, seq)
    for chunk in (1, 7):
        (got,) = feed(model, [seq], chunk)
        torch.testing.assert_close(got, ref, atol=TOL, rtol=0)
    (rotating_all,) = feed(whole, [seq], 7)
    assert (rotating_all - ref).abs().max() > 1e-2
    assert "partial rotary" in unsupported(model, model.new_cache(1, 8))  # the fused kernel rotates whole heads


# ---- compiled ---------------------------------------------------------------------------------------------------
def test_compiled_greedy_equals_eager_and_transformers_across_the_original_context(tmp_path):
    """A longrope model whose row passes the original context (16) while decoding: the table switches inside the
    captured steps (a torch.where over both tables) with no graph break, no recompile and no eager fallback."""
    hf = hf_model(*MODELS["longrope"], seed=3)
    model = load_model(save(hf, tmp_path))
    opts = CaptureOptions(buckets=BucketLadder((32,)), settings=CompileSettings(backend="eager"),
                          kinds=("prefill", "first_greedy", "decode_greedy"), progress=False)
    compiled = Generator(model, max_len=32, chunk_size=8, eos_token_ids=[], compile=True, capture=opts)
    eager = Generator(model, max_len=32, chunk_size=8, eos_token_ids=[])
    short = prompt(3, 7)
    assert compiled.generate(short, 5) == eager.generate(short, 5)  # every step compiled, all within the context
    seq = prompt(10, 6)
    with steady_state(host_sync=False):
        got = compiled.generate(seq, 20)  # positions 10..29: past 16 from the seventh token on
    assert got == eager.generate(seq, 20) == hf_greedy(hf, seq, 20, eos=None)
    records = compiled.capture_records
    assert records and all((r.graph_breaks, r.fallback) == (0, "") for r in records)


@pytest.mark.slow
def test_inductor_greedy_equals_eager_for_dynamic_rope(tmp_path):
    """The CPU default compile (inductor) over dynamic's device-side table (clamp, pow, where): the same tokens as
    eager and transformers while the row passes max_position_embeddings (24)."""
    hf = hf_model(*MODELS["dynamic"], seed=5)
    model = load_model(save(hf, tmp_path))
    opts = CaptureOptions(buckets=BucketLadder((32,)), kinds=("prefill", "first_greedy", "decode_greedy"),
                          progress=False)
    compiled = Generator(model, max_len=32, chunk_size=8, eos_token_ids=[], compile=True, capture=opts)
    seq = prompt(10, 8)
    got = compiled.generate(seq, 20)
    assert got == Generator(model, max_len=32, chunk_size=8, eos_token_ids=[]).generate(seq, 20)
    assert got == hf_greedy(hf, seq, 20, eos=None)
    assert all((r.graph_breaks, r.fallback) == (0, "") for r in compiled.capture_records)
