"""Parity with transformers' LlamaForCausalLM: the model over the static cache computes the same function.

Pins: RoPE positions taken from the device lengths (a chunk appended after cached tokens must rotate at
lens + t, not at t), Llama 3 frequency scaling, GQA head mapping (query head h reads KV head h // G), tied and
untied LM heads, padded slots of a chunk not leaking into real ones, ragged rows fed together, and greedy
decoding equal to transformers' generate token for token. Also: the checked `forward` refuses a bad call
(foreign cache, bad ids, overflow, short read length) before writing anything.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from static_decode import Generator, load_model
from static_decode.model.config import RopeConfig
from static_decode.model.rope import inv_freq
from tests.support.checkpoints import LLAMA3_ROPE, VOCAB, feed, hf_greedy, hf_llama, hf_logits, prompt, save

VARIANTS = {
    "default-untied": {"rope": "default", "tied": False},
    "llama3-untied": {"rope": "llama3", "tied": False},
    "default-tied": {"rope": "default", "tied": True},
    "llama3-tied": {"rope": "llama3", "tied": True},
}
TOL = 1e-4


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    """(transformers model, our model loaded from its save_pretrained directory)."""
    hf = hf_llama(seed=len(request.param), **VARIANTS[request.param])
    path = save(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(path)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_whole_sequence_in_chunks(pair, chunk):
    hf, ours = pair
    seq = prompt(40)
    ref = hf_logits(hf, seq)
    assert ref.std() > 0.5, "logits too flat for the comparison to mean anything"
    (got,) = feed(ours, [seq], chunk)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


def test_ragged_batch_fed_together(pair):
    hf, ours = pair
    rows = [prompt(5, 1), prompt(23, 2), prompt(40, 3)]
    for row, got in zip(rows, feed(ours, rows, 7), strict=True):
        torch.testing.assert_close(got, hf_logits(hf, row), atol=TOL, rtol=0)


def test_llama3_inverse_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_llama(rope="llama3")
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    rope = RopeConfig(theta=500000.0, type="llama3", **{k: LLAMA3_ROPE[k] for k in keys})
    got = inv_freq(rope, 8)
    assert torch.equal(got, ref)
    # The scaling really does something here: kept, smoothed and divided frequencies all occur.
    plain = inv_freq(RopeConfig(theta=500000.0), 8)
    ratio = (plain / got).tolist()
    assert ratio[0] == 1.0 and 1.0 < ratio[1] < 8.0 and ratio[2] == pytest.approx(8.0) == ratio[3]


def test_greedy_generation_equals_transformers(pair):
    hf, ours = pair
    gen = Generator(ours, max_len=64, chunk_size=8, eos_token_ids=[])
    for seq in (prompt(13, 4), prompt(3, 5)):  # the second request reuses the generator's cache
        assert gen.generate(seq, 20) == hf_greedy(hf, seq, 20, eos=None)


def test_greedy_stops_at_eos_like_transformers(tmp_path):
    hf = hf_llama(seed=9)
    seq = prompt(11, 6)
    free = hf_greedy(hf, seq, 16, eos=None)
    eos = free[5]  # a token greedy decoding emits: both must stop right after its first occurrence
    expected = hf_greedy(hf, seq, 16, eos=eos)
    assert expected[-1] == eos and len(expected) < 16
    ours = load_model(save(hf, tmp_path))
    assert Generator(ours, max_len=40, chunk_size=4, eos_token_ids=[eos]).generate(seq, 16) == expected


@pytest.mark.parametrize("impl", ["sdpa", "split_key"])
def test_sdpa_attention_gives_the_same_logits(pair, impl, monkeypatch):
    import static_decode.core.split_attention as split

    monkeypatch.setattr(split, "SPLIT_BLOCK", 4)  # reads of a multiple of 4 keys split into blocks of 4
    hf, ours = pair
    seq = prompt(30, 7)
    ours.attn_impl = impl
    try:
        (got,) = feed(ours, [seq], 7)
    finally:
        ours.attn_impl = "matmul"
    torch.testing.assert_close(got, hf_logits(hf, seq), atol=TOL, rtol=0)


def test_checked_forward_refuses_before_writing(pair):
    _, ours = pair
    cache = ours.new_cache(2, 16)
    ours(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache, [3, 1])
    k, lens = cache.k.clone(), cache.host_lens.copy()
    other = ours.new_cache(2, 16).to(torch.float64)  # wrong dtype: not this model's cache
    bad = [
        ((torch.tensor([[1, 2], [3, 4]]), other, [1, 1]), "new_cache"),
        ((torch.tensor([[1, 2], [3, VOCAB]]), cache, [2, 2]), f"0..{VOCAB - 1}"),
        ((torch.tensor([[1, 2], [3, 4]]).int(), cache, [2, 2]), "int64"),
        ((torch.tensor([[1, 2]]), cache, [2]), "batch"),
        ((torch.tensor([[1, 2], [3, 4]]), cache, [3, 2]), "n_new"),
        ((torch.zeros(2, 14, dtype=torch.int64), cache, [14, 14]), "overflow"),
    ]
    for args, word in bad:
        with pytest.raises((ValueError, TypeError), match=word):
            ours(*args)
    with pytest.raises(ValueError, match="read_len=3"):
        ours(torch.tensor([[1], [2]]), cache, [1, 1], read_len=3)  # row 0 would hold 4 tokens
    assert torch.equal(cache.k, k) and np.array_equal(cache.host_lens, lens)
    assert cache.lens.tolist() == lens.tolist()
