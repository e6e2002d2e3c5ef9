"""The `concat` baseline (static_decode/commands/bench/baselines.py) computes the same model as the library.

Pins: a baseline that disagrees with the library would make the bench compare different work; it must give
the library's logits (float64, to 1e-10) through a prefill and decode steps, while really growing its cache
by concatenation (a new allocation each step) and repeating KV heads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from static_decode.model.config import LlamaConfig
from static_decode.model.llama import Llama

ROOT = Path(__file__).resolve().parents[3]


def load_baselines():
    from static_decode.commands.bench import baselines

    return baselines


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
    return Llama(cfg, dtype=torch.float64).eval()


@pytest.mark.parametrize("batch", [1, 2])
def test_concat_baseline_matches_the_library(tiny, batch):
    baselines = load_baselines()
    system = baselines.ConcatDecoder(tiny)
    cache = tiny.new_cache(batch, 32)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 50, (batch, 6), generator=gen)
    with torch.no_grad():
        got, want = system.step(prompt), tiny(prompt, cache, [6] * batch)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        for n in range(5):
            ptr = system.k[0].data_ptr()
            tok = torch.randint(0, 50, (batch, 1), generator=gen)
            got, want = system.step(tok), tiny(tok, cache, [1] * batch)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
            assert system.length == 7 + n
            assert system.k[0].data_ptr() != ptr  # it really regrew (the cost the bench measures)
    assert system.bytes_cached() == 2 * 2 * batch * 2 * 11 * 8 * 8  # K,V x layers x B x Hkv x L x d x 8 B


def test_concat_baseline_refuses_a_batch_change(tiny):
    system = load_baselines().ConcatDecoder(tiny)
    with torch.no_grad():
        system.step(torch.zeros(2, 3, dtype=torch.int64))
        with pytest.raises(ValueError, match="reset"):
            system.step(torch.zeros(1, 1, dtype=torch.int64))
        system.reset()
        assert system.step(torch.zeros(1, 1, dtype=torch.int64)).shape == (1, 1, 50)
