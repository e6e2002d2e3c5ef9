"""profiles/windowed.py: a Llama checkpoint rewritten so that every layer has a sliding window, its weights linked;
transformers' Mistral and static_decode read the copy alike (float32 logits past the window); bad input is
refused naming it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from static_decode.checkpoints.loading import load_model
from tests.support.checkpoints import feed, hf_llama, save

ROOT = Path(__file__).resolve().parents[2]


def _windowed():
    spec = importlib.util.spec_from_file_location("sd_profiles_windowed", ROOT / "profiles" / "windowed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_layer_gets_the_window_and_the_weights_are_linked(tmp_path):
    src = save(hf_llama(seed=3, eos=None, layers=2), tmp_path / "llama")
    out = _windowed().write(src, tmp_path / "win", 6)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["sliding_window"] == 6
    weights = next(out.glob("*.safetensors"))
    assert weights.is_symlink() and weights.resolve() == (src / weights.name).resolve()
    model = load_model(out)
    assert model.config.sliding_window == 6
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids = [(5 * i + 3) % 96 for i in range(30)]  # 30 positions: five times the window
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = feed(model, [ids], chunk=7)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    plain = feed(load_model(src), [ids], chunk=7)[0]
    assert (plain[-1] - got[-1]).abs().max() > 1e-3  # the window changes the late positions' logits


def test_bad_input_is_refused(tmp_path):
    w = _windowed()
    src = save(hf_llama(seed=3, eos=None, layers=1), tmp_path / "llama")
    with pytest.raises(ValueError, match="--window must be >= 1, got 0"):
        w.write(src, tmp_path / "win", 0)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architectures \['Qwen2ForCausalLM'\]; expected"):
        w.write(src, tmp_path / "win", 4)
