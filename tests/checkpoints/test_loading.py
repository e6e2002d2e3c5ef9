"""Checkpoint loading: both config.json styles, sharded weights, EOS ids, tokenizer, dtype, and every error path.

Pins: transformers 4.x files (rope_theta + rope_scaling, or the older `type` key) and 5.x files
(rope_parameters) load to the same model; head_dim comes from the config when present; an unknown
architecture, an unsupported rope type, a missing, unexpected or mis-shaped tensor are refused with an error
naming the key, before any model is returned.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from static_decode import LlamaConfig, load_model, load_tokenizer
from static_decode.checkpoints.loading import parse_dtype
from static_decode.model.config import RopeConfig
from tests.support.checkpoints import VOCAB, hf_llama, hf_logits, rewrite_config, save, to_4x_style

SEQ = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    hf = hf_llama(rope="llama3", seed=1, eos=[5, 6])
    return hf, save(hf, tmp_path_factory.mktemp("llama3"))


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def logits(model, seq=SEQ) -> torch.Tensor:
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        return model(torch.tensor([seq]), cache, [len(seq)])[0].float()


# ---- what loads --------------------------------------------------------------------------------------------
def test_5x_style_reads_rope_parameters(llama3):
    hf, path = llama3
    assert "rope_parameters" in json.loads((path / "config.json").read_text())
    cfg = load_model(path).config
    assert cfg.rope == RopeConfig(
        theta=500000.0,
        type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=256,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (8, 2, 8, 2)


@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_4x_style_loads_the_same_model(llama3, tmp_path, type_key):
    hf, path = llama3
    old = copy(path, tmp_path)

    def edit(cfg):
        to_4x_style(cfg)
        cfg["rope_scaling"][type_key] = cfg["rope_scaling"].pop("rope_type")

    rewrite_config(old, edit)
    assert "rope_parameters" not in json.loads((old / "config.json").read_text())
    new_model, old_model = load_model(path), load_model(old)
    assert old_model.config == new_model.config
    torch.testing.assert_close(logits(old_model), hf_logits(hf, SEQ), atol=1e-4, rtol=0)


def test_4x_style_default_rope(tmp_path):
    hf = hf_llama(rope="default", seed=2)
    path = save(hf, tmp_path / "a")
    rewrite_config(path, lambda c: (to_4x_style(c), c.update(rope_theta=12345.0)))
    cfg = load_model(path).config
    assert cfg.rope == RopeConfig(theta=12345.0)


def test_sharded_checkpoint_equals_single_file(llama3, tmp_path):
    hf, path = llama3
    sharded = save(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a, b = load_model(path).state_dict(), load_model(sharded).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_head_dim_from_config(tmp_path):
    hf = hf_llama(head_dim=16, seed=3)  # 8 heads x 16 != hidden 64
    model = load_model(save(hf, tmp_path))
    assert model.config.head_dim == 16
    torch.testing.assert_close(logits(model), hf_logits(hf, SEQ), atol=1e-4, rtol=0)


def test_eos_ids_from_generation_config_then_config(llama3, tmp_path):
    _, path = llama3
    assert load_model(path).config.eos_token_ids == (5, 6)
    ckpt = copy(path, tmp_path)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert load_model(ckpt).config.eos_token_ids == (9,)  # generation_config.json wins, an int is fine
    (ckpt / "generation_config.json").unlink()
    rewrite_config(ckpt, lambda c: c.update(eos_token_id=4))
    assert load_model(ckpt).config.eos_token_ids == (4,)


def test_dtype_default_is_the_checkpoints_and_can_be_overridden(tmp_path):
    hf = hf_llama(seed=4).to(torch.bfloat16)
    path = save(hf, tmp_path)
    assert load_model(path).dtype == torch.bfloat16
    model = load_model(path, dtype="float32")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.inv_freq.dtype == torch.float32  # rope stays float32 whatever the weights
    assert parse_dtype("bf16") == torch.bfloat16 and parse_dtype(torch.float16) == torch.float16


def test_tied_checkpoint_has_no_head_and_shares_the_embedding(tmp_path):
    path = save(hf_llama(tied=True), tmp_path)
    model = load_model(path)
    assert model.lm_head is None and "lm_head.weight" not in load_file(path / "model.safetensors")


def test_loaded_model_is_inference_only(llama3):
    model = load_model(llama3[1])
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def test_tokenizer_loaded_when_present(llama3, tmp_path):
    from tokenizers import Tokenizer, models

    ckpt = copy(llama3[1], tmp_path)
    assert load_tokenizer(ckpt) is None
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(ckpt / "tokenizer.json"))
    tok = load_tokenizer(ckpt)
    assert tok.token_to_id("b") == 1


# ---- what is refused, naming the key -----------------------------------------------------------------------
def refuses(path: Path, error: type[Exception], *words: str) -> None:
    with pytest.raises(error) as info:
        load_model(path)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {info.value}"


def test_unknown_architecture(llama3, tmp_path):
    ckpt = copy(llama3[1], tmp_path)
    rewrite_config(ckpt, lambda c: c.update(architectures=["GemmaForCausalLM"]))
    refuses(ckpt, ValueError, "architectures", "GemmaForCausalLM", "Qwen3ForCausalLM")  # names what is supported
    rewrite_config(ckpt, lambda c: c.update(architectures=["LlamaForCausalLM", "Qwen2ForCausalLM"]))
    refuses(ckpt, ValueError, "architectures")  # one model, one architecture


@pytest.mark.parametrize("style", ["5.x", "4.x"])
def test_unsupported_rope_type(llama3, tmp_path, style):
    ckpt = copy(llama3[1], tmp_path)

    def edit(cfg):
        if style == "4.x":
            to_4x_style(cfg)
            cfg["rope_scaling"]["rope_type"] = "proportional"
        else:
            cfg["rope_parameters"]["rope_type"] = "proportional"

    rewrite_config(ckpt, edit)
    refuses(ckpt, ValueError, "proportional", "rope_parameters" if style == "5.x" else "rope_scaling")


def test_llama3_rope_missing_parameter(llama3, tmp_path):
    ckpt = copy(llama3[1], tmp_path)
    rewrite_config(ckpt, lambda c: c["rope_parameters"].pop("low_freq_factor"))
    refuses(ckpt, ValueError, "rope_parameters.low_freq_factor")


@pytest.mark.parametrize(
    ("key", "value", "word"),
    [
        ("hidden_act", "gelu", "hidden_act"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
        ("num_key_value_heads", 3, "num_kv_heads"),
    ],
)
def test_unsupported_config_values(llama3, tmp_path, key, value, word):
    ckpt = copy(llama3[1], tmp_path)
    rewrite_config(ckpt, lambda c: c.update({key: value}))
    refuses(ckpt, ValueError, word)


def test_missing_config_key(llama3, tmp_path):
    ckpt = copy(llama3[1], tmp_path)
    rewrite_config(ckpt, lambda c: c.pop("intermediate_size"))
    refuses(ckpt, ValueError, "intermediate_size")


def edit_weights(ckpt: Path, edit) -> None:
    file = ckpt / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor(llama3, tmp_path):
    ckpt = copy(llama3[1], tmp_path)
    edit_weights(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    refuses(ckpt, KeyError, "model.layers.1.self_attn.k_proj.weight")


def test_misshaped_tensor(llama3, tmp_path):
    ckpt = copy(llama3[1], tmp_path)
    edit_weights(ckpt, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(127, 64)}))
    refuses(ckpt, ValueError, "model.layers.0.mlp.up_proj.weight", "(127, 64)", "(128, 64)")


def test_unexpected_tensor(llama3, tmp_path):
    ckpt = copy(llama3[1], tmp_path)
    edit_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    refuses(ckpt, KeyError, "model.layers.0.self_attn.q_proj.bias")


def test_rotary_tables_in_old_checkpoints_are_ignored(llama3, tmp_path):
    ckpt = copy(llama3[1], tmp_path)
    edit_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}))
    assert load_model(ckpt).config.head_dim == 8


def test_missing_files(llama3, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    ckpt = copy(llama3[1], tmp_path)
    (ckpt / "model.safetensors").unlink()
    refuses(ckpt, FileNotFoundError, "model.safetensors")
    (ckpt / "config.json").unlink()
    refuses(ckpt, FileNotFoundError, "config.json")


def test_index_naming_a_missing_shard(llama3, tmp_path):
    sharded = save(llama3[0], tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    key, shard = next(iter(index["weight_map"].items()))
    (sharded / shard).unlink()
    refuses(sharded, FileNotFoundError, key, shard)


def test_bad_dtype_and_json(llama3, tmp_path):
    with pytest.raises(ValueError, match="float8"):
        load_model(llama3[1], dtype="float8")
    ckpt = copy(llama3[1], tmp_path)
    (ckpt / "config.json").write_text("{not json")
    refuses(ckpt, ValueError, "config.json")


# ---- the config dataclass on its own -------------------------------------------------------------------------
def test_config_validation_names_the_value():
    base = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 8,
        "num_kv_heads": 2,
    }
    assert LlamaConfig(**base).head_dim == 8 and LlamaConfig(**base).groups == 4
    for bad, word in [
        ({"num_kv_heads": 3}, "num_kv_heads=3"),
        ({"head_dim": 7}, "head_dim=7"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"eos_token_ids": (VOCAB,)}, str(VOCAB)),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"hidden_size": 66, "num_heads": 4, "num_kv_heads": 4}, "hidden_size=66"),
        ({"qk_norm": 1}, "qk_norm"),
        ({"o_bias": None}, "o_bias"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"sliding_window": 8.0}, "sliding_window"),
        ({"architecture": "GPT2LMHeadModel"}, "GPT2LMHeadModel"),
    ]:
        with pytest.raises((ValueError, TypeError), match=word):
            LlamaConfig(**{**base, **bad})
    windowed = LlamaConfig(**base, sliding_window=32, architecture="MistralForCausalLM")
    windowed.check_max_len(33)  # a window is a mask, not a bound on the cache: any length
    with pytest.raises(ValueError, match="max_len"):
        windowed.check_max_len(0)
    assert windowed.layer_windows == (32, 32)
    assert LlamaConfig(**base, sliding_window=8, sliding_layers=(False, True)).layer_windows == (None, 8)
    for bad, word in [
        ({"sliding_window": 8, "sliding_layers": (True,)}, "sliding_layers must be None or 2 bools"),
        ({"sliding_window": 8, "sliding_layers": (1, 0)}, "sliding_layers must be None or 2 bools"),
        ({"sliding_layers": (False, True)}, "sliding_window is None"),
    ]:
        with pytest.raises(ValueError, match=word):
            LlamaConfig(**{**base, **bad})
    LlamaConfig(**base).check_max_len(10**9)  # no window: any length
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeConfig(type="llama3", low_freq_factor=4.0, high_freq_factor=4.0)
    with pytest.raises(ValueError, match="'proportional'"):
        RopeConfig(type="proportional")
