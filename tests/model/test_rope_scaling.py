"""RoPE scaling against transformers: linear, dynamic (NTK-aware), yarn, longrope and partial rotary.

Pins:
* the inverse frequencies, cos, sin and attention factor equal transformers' own rotary embedding class
  (LlamaRotaryEmbedding, dynamic_rope_update included; Phi3RotaryEmbedding for partial rotary) within 1e-6 at
  positions within and past the original context, up to 131,071;
* both config.json spellings read to the same parameters, every key transformers reads honoured and the others
  refused naming the key and the file;
* tiny random Llama checkpoints with each scaling give float32 logits within 1e-4 of transformers' for a prompt
  fed in chunks across the original context (transformers fed the same chunks through its cache: the tables of
  "dynamic" and "longrope" follow each forward call's last position), and for a ragged batch, each row against
  its own run;
* a forward at position ~100,000 equals transformers' over the same keys (both caches hold the same random
  100,000 keys and values, transformers given the positions explicitly), without a 100k-token prefill;
* partial rotary: rope.apply equals Phi3's apply_rotary_pos_emb, and a model rotating half of each head equals
  transformers' Llama with that rotation;
* greedy tokens of a compiled longrope model equal eager ones while a row passes the original context, with no
  graph break.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from capture import BucketLadder, CaptureOptions, CompileSettings, steady_state
from static_decode import Generator, Llama, load_model
from static_decode.model import rope
from static_decode.model.config import LlamaConfig
from static_decode.model.fused_decode import unsupported
from static_decode.model.rope_config import RopeConfig, rope_from_hf
from tests.support.checkpoints import (
    VOCAB,
    feed,
    hf_greedy,
    hf_llama,
    hf_logits,
    prompt,
    rewrite_config,
    save,
    to_4x_style,
)

TOL = 1e-4
TABLE_TOL = 1e-6
HEAD_DIM = 16


def _factors(n: int, seed: int, low: float, high: float) -> list[float]:
    return np.random.default_rng(seed).uniform(low, high, n).round(4).tolist()


# name -> (rope dict, max_position_embeddings) at real-model sizes, for the table tests.
TABLES = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, 8192),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 4096),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    "yarn-untruncated": (
        {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 24.0,
         "beta_slow": 2.0, "truncate": False},
        131072,
    ),
    "yarn-mscale": (
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
         "mscale_all_dim": 0.707},
        163840,
    ),
    "yarn-attention-factor": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "attention_factor": 1.25},
        65536,
    ),
    "yarn-derived-factor": ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 8192}, 65536),
    "longrope": (
        {"rope_type": "longrope", "short_factor": _factors(HEAD_DIM // 2, 1, 1.0, 1.2),
         "long_factor": _factors(HEAD_DIM // 2, 2, 1.0, 30.0), "original_max_position_embeddings": 4096},
        131072,
    ),
    "longrope-factor": (
        {"rope_type": "longrope", "short_factor": _factors(HEAD_DIM // 2, 3, 1.0, 1.2),
         "long_factor": _factors(HEAD_DIM // 2, 4, 1.0, 30.0), "original_max_position_embeddings": 4096,
         "factor": 16.0},
        131072,
    ),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        131072,
    ),
}
POSITIONS = [0, 1, 2, 17, 1000, 4095, 4096, 4097, 8191, 8192, 8193, 32767, 32768, 32769, 65535, 65536, 100000, 131071]


def hf_config(rope_params: dict, max_positions: int, **extra):
    """A transformers LlamaConfig with this rope (4 heads of HEAD_DIM over hidden 64)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=max_positions, rope_theta=10000.0,
        rope_parameters=dict(rope_params, rope_theta=10000.0), initializer_range=0.2, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **extra,
    )


def hf_tables(cfg, positions: torch.Tensor):
    """transformers' (inv_freq, attention_scaling, cos, sin) for one forward call at positions [1, T], from a fresh
    LlamaRotaryEmbedding (its dynamic update then depends on this call alone)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    emb = LlamaRotaryEmbedding(cfg)
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), positions)  # [1, T, r] each
    return emb.inv_freq.clone(), emb.attention_scaling, cos, sin


def ours(config: RopeConfig, positions: torch.Tensor, head_dim: int = HEAD_DIM):
    """Our (freq, cos, sin) for one batch-1 step at positions [1, T] (the row's length after it: the last + 1)."""
    base = rope.inv_freq(config, head_dim)
    long = rope.long_inv_freq(config, head_dim) if config.type == "longrope" else None
    seq_len = positions[:, -1] + 1  # [1]
    freq = rope.step_freq(config, head_dim, base, long, seq_len)
    cos, sin = rope.cos_sin(freq, positions, torch.float32, rope.attention_factor(config))  # [1, 1, T, r/2]
    return freq, cos, sin


@pytest.mark.parametrize("name", list(TABLES))
def test_tables_equal_transformers_rotary_embedding(name):
    params, max_positions = TABLES[name]
    cfg = hf_config(params, max_positions)
    config = rope_from_hf(json.loads(cfg.to_json_string()))
    assert config.type == params["rope_type"]
    for last in POSITIONS:
        positions = torch.tensor([[max(last - 3, 0), max(last - 1, 0), last]])  # one call ending at `last`
        ref_freq, ref_scale, ref_cos, ref_sin = hf_tables(cfg, positions)
        freq, cos, sin = ours(config, positions)
        assert rope.attention_factor(config) == pytest.approx(ref_scale, rel=1e-12, abs=1e-12)
        torch.testing.assert_close(freq.reshape(-1), ref_freq, atol=TABLE_TOL, rtol=TABLE_TOL)
        half = ref_cos.shape[-1] // 2
        for got, ref in ((cos, ref_cos), (sin, ref_sin)):
            torch.testing.assert_close(got[:, 0], ref[..., :half], atol=TABLE_TOL, rtol=0)
            torch.testing.assert_close(got[:, 0], ref[..., half:], atol=TABLE_TOL, rtol=0)


def test_the_scalings_really_scale():
    """Each table differs from the default one where its type says it should, so the comparisons above bind."""
    plain = rope.inv_freq(RopeConfig(), HEAD_DIM)
    cfgs = {n: rope_from_hf(json.loads(hf_config(*TABLES[n]).to_json_string())) for n in TABLES}
    torch.testing.assert_close(rope.inv_freq(cfgs["linear"], HEAD_DIM), plain / 4)
    yarn = rope.inv_freq(cfgs["yarn"], HEAD_DIM) / plain
    assert yarn[0] == 1 and yarn[-1] < 0.5 and bool((yarn >= 0.25).all())  # kept ... blended towards 1 / factor
    assert rope.attention_factor(cfgs["yarn"]) == pytest.approx(0.1 * math.log(4) + 1)
    assert rope.attention_factor(cfgs["yarn-derived-factor"]) == pytest.approx(0.1 * math.log(8) + 1)
    assert rope.attention_factor(cfgs["longrope"]) == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    for name, old in (("dynamic", 4096), ("longrope", 4096)):
        c = cfgs[name]
        at = [rope.step_freq(c, HEAD_DIM, rope.inv_freq(c, HEAD_DIM),
                             rope.long_inv_freq(c, HEAD_DIM) if name == "longrope" else None, torch.tensor([n]))
              for n in (old, old + 1, 4 * old)]
        assert torch.equal(at[0].reshape(-1), rope.inv_freq(c, HEAD_DIM))  # within the context: the base table
        assert not torch.equal(at[0], at[1])  # past it: another table
        assert name == "longrope" or not torch.equal(at[1], at[2])  # dynamic's keeps growing


def test_a_ragged_batch_gives_each_row_its_own_table():
    c = rope_from_hf(json.loads(hf_config(*TABLES["dynamic"]).to_json_string()))
    base = rope.inv_freq(c, HEAD_DIM)
    lens = torch.tensor([10, 5000, 4096, 20000])
    both = rope.step_freq(c, HEAD_DIM, base, None, lens)  # [4, 1, r/2]
    for b, n in enumerate(lens):
        assert torch.equal(both[b], rope.step_freq(c, HEAD_DIM, base, None, n[None])[0])


# ---- parsing ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TABLES))
def test_both_spellings_read_the_same(name):
    cfg = json.loads(hf_config(*TABLES[name]).to_json_string())
    old = dict(cfg)
    to_4x_style(old)
    assert "rope_parameters" not in old and old["rope_scaling"]["rope_type"] == TABLES[name][0]["rope_type"]
    assert rope_from_hf(old) == rope_from_hf(cfg)
    older = dict(old, rope_scaling={("type" if k == "rope_type" else k): v for k, v in old["rope_scaling"].items()})
    assert rope_from_hf(older) == rope_from_hf(cfg)


def test_keys_are_read_as_transformers_reads_them():
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}
    got = rope_from_hf({"rope_parameters": yarn, "max_position_embeddings": 1000})
    # original_max_position_embeddings defaults to max_position_embeddings; betas and truncate to 32, 1, true
    assert (got.original_max_position_embeddings, got.beta_fast, got.beta_slow, got.truncate) == (1000, 32, 1, True)
    assert got.theta == 5e5
    # a top-level original_max_position_embeddings (Phi3's spelling) wins over the dict's
    got = rope_from_hf({"rope_parameters": dict(yarn, original_max_position_embeddings=64),
                        "original_max_position_embeddings": 32})
    assert got.original_max_position_embeddings == 32
    # null betas take the defaults, as transformers' `or 32`
    assert rope_from_hf({"rope_parameters": dict(yarn, beta_fast=None, beta_slow=None)}).beta_fast == 32
    # partial_rotary_factor from the dict or the top level (4.x)
    assert rope_from_hf({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}) == RopeConfig(
        partial_rotary_factor=0.5
    )
    assert rope_from_hf({"partial_rotary_factor": 0.75, "rope_theta": 1e4}).partial_rotary_factor == 0.75
    # dynamic grows past max_position_embeddings
    assert rope_from_hf(
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}, "max_position_embeddings": 300}
    ).original_max_position_embeddings == 300


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"rope_type": "proportional"}, ["'rope_parameters.rope_type'", "'proportional'", "longrope"]),
        ({"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}, ["rope_parameters.low_freq_factor", "yarn"]),
        ({"rope_type": "linear", "factor": 2.0, "mrope_section": [1, 2]}, ["rope_parameters.mrope_section"]),
        ({"rope_type": "linear"}, ["rope_parameters.factor"]),
        ({"rope_type": "longrope", "short_factor": [1.0] * 8}, ["rope_parameters.long_factor"]),
        ({"rope_type": "linear", "factor": -1.0}, ["rope_parameters", "factor", "-1.0"]),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, ["truncate", "'no'"]),
        ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 8.0}, ["beta_fast", "8.0"]),
        ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3}, ["3 values", "needs 8"]),
        ({"rope_type": "linear", "factor": 2.0, "type": "dynamic"}, ["'linear'", "'dynamic'"]),
    ],
)
def test_unsupported_rope_keys_are_refused_naming_them_and_the_file(tmp_path, params, words):
    path = save(hf_llama(head_dim=HEAD_DIM), tmp_path)
    rewrite_config(path, lambda c: c.update(rope_parameters=dict(params, rope_theta=1e4)))
    with pytest.raises((ValueError, TypeError)) as info:
        load_model(path)
    for w in [*words, str(path / "config.json")]:
        assert w in str(info.value), f"{w!r} not in {info.value}"


def test_both_spellings_at_once_must_agree():
    linear = {"rope_type": "linear", "factor": 2.0}
    assert rope_from_hf({"rope_scaling": linear, "rope_parameters": dict(linear, rope_theta=1e4)}).factor == 2.0
    with pytest.raises(ValueError, match="rope_scaling.*rope_parameters.*factor"):
        rope_from_hf({"rope_scaling": linear, "rope_parameters": dict(linear, factor=4.0)})


def test_partial_rotary_is_refused_for_architectures_that_rotate_whole_heads():
    with pytest.raises(ValueError, match="partial_rotary_factor.*LlamaForCausalLM"):
        LlamaConfig.from_hf({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 16, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "partial_rotary_factor": 0.5,
        })


# ---- tiny checkpoints: logits against transformers --------------------------------------------------------------
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
        {"rope_type": "longrope", "short_factor": _factors(HEAD_DIM // 2, 5, 1.0, 1.5),
         "long_factor": _factors(HEAD_DIM // 2, 6, 1.0, 8.0), "original_max_position_embeddings": 16},
        64,
    ),
}


def hf_model(rope_params: dict, max_positions: int, seed: int = 0, **extra):
    """A random transformers LlamaForCausalLM with this rope (weights large enough to spread the logits)."""
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(hf_config(rope_params, max_positions, **extra)).eval()


def hf_chunked(hf, seq: list[int], chunk: int) -> torch.Tensor:
    """[len(seq), V] float32 logits of transformers fed `seq` in chunks through its own cache: one forward call per
    chunk, so "dynamic" and "longrope" pick each chunk's table by its last position, as our steps do."""
    from transformers import DynamicCache

    cache, out = DynamicCache(config=hf.config), []
    with torch.no_grad():
        for start in range(0, len(seq), chunk):
            ids = torch.tensor([seq[start : start + chunk]])
            out.append(hf(input_ids=ids, cache=cache, use_cache=True).logits[0].float())
    return torch.cat(out)


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
        {"rope_type": "longrope", "short_factor": _factors(HEAD_DIM // 2, 7, 1.0, 1.2),
         "long_factor": _factors(HEAD_DIM // 2, 8, 1.0, 30.0), "original_max_position_embeddings": 4096},
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
def test_partial_rotary_equals_phi3_apply_rotary_pos_emb():
    """Phi-4-mini's layout: longrope over the first 3/4 of each head, read from a Phi3 config.json."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    rot = HEAD_DIM * 3 // 4
    cfg = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
        original_max_position_embeddings=4096, partial_rotary_factor=0.75, pad_token_id=None,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": _factors(rot // 2, 9, 1.0, 1.2), "long_factor": _factors(rot // 2, 10, 1.0, 30.0),
        },
    )
    config = rope_from_hf(json.loads(cfg.to_json_string()))
    assert (config.partial_rotary_factor, config.rotary_dim(HEAD_DIM), config.original_max_position_embeddings) == (
        0.75, rot, 4096
    )
    g = torch.Generator().manual_seed(0)
    for last in (10, 4096, 4097, 100000):
        positions = torch.tensor([[last - 2, last - 1, last]])
        q = torch.randn(1, 4, 3, HEAD_DIM, generator=g)  # [B, Hq, T, d]
        k = torch.randn(1, 2, 3, HEAD_DIM, generator=g)  # [B, Hkv, T, d]
        cos, sin = Phi3RotaryEmbedding(cfg)(q, positions)  # [1, T, rot]
        ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
        _, ours_cos, ours_sin = ours(config, positions)
        assert ours_cos.shape[-1] == rot // 2
        got_q, got_k = rope.apply(q, ours_cos, ours_sin), rope.apply(k, ours_cos, ours_sin)
        torch.testing.assert_close(got_q, ref_q, atol=TABLE_TOL, rtol=0)
        torch.testing.assert_close(got_k, ref_k, atol=TABLE_TOL, rtol=0)
        assert torch.equal(got_q[..., rot:], q[..., rot:])  # the last quarter passes through


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
