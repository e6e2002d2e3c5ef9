"""RoPE scaling tables and config.json parsing against transformers: linear, dynamic (NTK-aware), yarn, longrope,
llama3 and partial rotary.

Pins:
* the inverse frequencies, cos, sin and attention factor equal transformers' own rotary embedding class
  (LlamaRotaryEmbedding, dynamic_rope_update included; Phi3RotaryEmbedding for partial rotary) within 1e-6 at
  positions within and past the original context, up to 131,071; in a ragged batch each row gets its own table;
* both config.json spellings read to the same parameters, every key transformers reads honoured and the others
  refused naming the key and the file;
* partial rotary: rope.apply equals Phi3's apply_rotary_pos_emb (the unrotated dims pass through).

The models built with these scalings: tests/model/test_rope_models.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from static_decode import load_model
from static_decode.model import rope
from static_decode.model.config import LlamaConfig
from static_decode.model.rope_config import RopeConfig, rope_from_hf
from tests.support.checkpoints import VOCAB, hf_llama, rewrite_config, save, to_4x_style
from tests.support.rope_cases import HEAD_DIM, factors, hf_config, our_tables

TABLE_TOL = 1e-6


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
        {"rope_type": "longrope", "short_factor": factors(HEAD_DIM // 2, 1, 1.0, 1.2),
         "long_factor": factors(HEAD_DIM // 2, 2, 1.0, 30.0), "original_max_position_embeddings": 4096},
        131072,
    ),
    "longrope-factor": (
        {"rope_type": "longrope", "short_factor": factors(HEAD_DIM // 2, 3, 1.0, 1.2),
         "long_factor": factors(HEAD_DIM // 2, 4, 1.0, 30.0), "original_max_position_embeddings": 4096,
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


def hf_tables(cfg, positions: torch.Tensor):
    """transformers' (inv_freq, attention_scaling, cos, sin) for one forward call at positions [1, T], from a fresh
    LlamaRotaryEmbedding (its dynamic update then depends on this call alone)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    emb = LlamaRotaryEmbedding(cfg)
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), positions)  # [1, T, r] each
    return emb.inv_freq.clone(), emb.attention_scaling, cos, sin


@pytest.mark.parametrize("name", list(TABLES))
def test_tables_equal_transformers_rotary_embedding(name):
    params, max_positions = TABLES[name]
    cfg = hf_config(params, max_positions)
    config = rope_from_hf(json.loads(cfg.to_json_string()))
    assert config.type == params["rope_type"]
    for last in POSITIONS:
        positions = torch.tensor([[max(last - 3, 0), max(last - 1, 0), last]])  # one call ending at `last`
        ref_freq, ref_scale, ref_cos, ref_sin = hf_tables(cfg, positions)
        freq, cos, sin = our_tables(config, positions)
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
            "short_factor": factors(rot // 2, 9, 1.0, 1.2), "long_factor": factors(rot // 2, 10, 1.0, 30.0),
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
        _, ours_cos, ours_sin = our_tables(config, positions)
        assert ours_cos.shape[-1] == rot // 2
        got_q, got_k = rope.apply(q, ours_cos, ours_sin), rope.apply(k, ours_cos, ours_sin)
        torch.testing.assert_close(got_q, ref_q, atol=TABLE_TOL, rtol=0)
        torch.testing.assert_close(got_k, ref_k, atol=TABLE_TOL, rtol=0)
        assert torch.equal(got_q[..., rot:], q[..., rot:])  # the last quarter passes through
