"""Phi3ForCausalLM (Phi-3-mini-4k / 128k, Phi-3.5-mini, Phi-4-mini shapes), loaded from checkpoints written by
transformers' Phi3ForCausalLM and checked against it.

Pins:
* q/k/v and gate/up load from the checkpoint's joined `qkv_proj` / `gate_up_proj` and the state dict keeps those
  names (whatever `fused_projections` says);
* float32 logits equal transformers' within 1e-4 fed in chunks of 1, 7 and 64 and as a ragged batch: the mini-4k
  shape with a sliding window of 16 over a 64-token cache (windows past the window), the mini-128k shape with
  longrope (original context 32, so 40-token prompts cross it; transformers fed the same chunks, since longrope
  picks its table by each forward call's length), a Phi-4-mini-like one with partial_rotary_factor 0.75, longrope
  and tied embeddings;
* greedy tokens equal transformers', eager and compiled (dynamo, eager backend): `generate` for the fixed table;
  for longrope, transformers decoding through its own cache, one forward a token. (Its Phi3 `generate` drops the
  cache and recomputes every key with the long factors when a sequence first passes the original context; here
  KV is written once, so the keys cached before keep their short-factor rotation, as in transformers' forward over
  its cache);
* a 2-rank tensor-parallel run (gloo) equals the single process: a rank takes its KV heads' rows of q, k and v out
  of the joined qkv_proj, and its slice of gate and of up;
* Phi3's older rope name "su" reads as longrope.
"""

from __future__ import annotations

import json

import pytest
import torch

from capture import BucketLadder, CaptureOptions, CompileSettings
from static_decode import Generator, load_model
from static_decode.model.parallel import TensorParallel, joined_rows
from tests.support import tp_worker
from tests.support.checkpoints import feed, hf_family, hf_greedy, prompt, rewrite_config, save
from tests.support.rope_cases import factors, hf_chunked

TOL = 1e-4
MAX_LEN = 64
GREEDY = ("prefill", "first_greedy", "decode_greedy")


def longrope(n: int, partial: float = 1.0) -> dict:
    return {
        "rope_type": "longrope", "rope_theta": 1e6, "short_factor": factors(n, 1, 1.0, 1.5),
        "long_factor": factors(n, 2, 1.0, 8.0), "partial_rotary_factor": partial,
    }


# name -> (hf_family kwargs, (rope type, rotary dims, per-layer windows, tied))
VARIANTS = {
    "mini-4k": ({"sliding_window": 16}, ("default", 16, (16, 16), False)),
    "mini-128k": ({"rope_parameters": longrope(8), "original_max_position_embeddings": 32},
                  ("longrope", 16, (None, None), False)),
    "phi4-mini": ({"rope_parameters": longrope(6, 0.75), "partial_rotary_factor": 0.75,
                   "original_max_position_embeddings": 32, "tied": True}, ("longrope", 12, (None, None), True)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, transformers model, its save_pretrained directory, our model loaded from it)."""
    hf = hf_family("phi3", seed=len(request.param), **VARIANTS[request.param][0])
    path = save(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, path, load_model(path)


def test_config_and_checkpoint_names(variant):
    name, hf, path, ours = variant
    c = ours.config
    assert (c.rope.type, c.rope.rotary_dim(c.head_dim), c.layer_windows, c.tie_word_embeddings) == VARIANTS[name][1]
    assert c.joined_checkpoint and not (c.qkv_bias or c.o_bias or c.mlp_bias)
    assert set(ours.state_dict()) == {k.removeprefix("model.") for k, _ in hf.named_parameters()}
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    split = load_model(path, fused_projections=False)  # the checkpoint is joined: the model stays joined
    assert set(split.state_dict()) == set(ours.state_dict())


def reference(name: str, hf, seq: list[int], chunk: int) -> torch.Tensor:
    # A fixed table gives transformers' whole-sequence logits; longrope's follow each forward call's length.
    return hf_chunked(hf, seq, chunk if name != "mini-4k" else len(seq))


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_logits_in_chunks(variant, chunk):
    name, hf, _, ours = variant
    seq = prompt(40, 1)
    ref = reference(name, hf, seq, chunk)
    assert ref.std() > 0.5, "logits too flat for the comparison to mean anything"
    (got,) = feed(ours, [seq], chunk, max_len=MAX_LEN)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


def test_ragged_batch(variant):
    name, hf, _, ours = variant
    rows = [prompt(5, 1), prompt(23, 2), prompt(40, 3)]  # under, across and past longrope's original context
    for row, got in zip(rows, feed(ours, rows, 7, max_len=MAX_LEN), strict=True):
        torch.testing.assert_close(got, reference(name, hf, row, 7), atol=TOL, rtol=0)


def hf_cached_greedy(hf, seq: list[int], new: int) -> list[int]:
    """transformers' greedy tokens decoding through its own cache (the prompt in one forward, then one a token)."""
    from transformers import DynamicCache

    cache, ids, out = DynamicCache(config=hf.config), torch.tensor([seq]), []
    with torch.no_grad():
        for _ in range(new):
            token = int(hf(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def hf_tokens(name: str, hf, seq: list[int], new: int) -> list[int]:
    return hf_greedy(hf, seq, new, eos=None) if name == "mini-4k" else hf_cached_greedy(hf, seq, new)


def test_greedy_equals_transformers(variant):
    name, hf, _, ours = variant
    gen = Generator(ours, max_len=MAX_LEN, chunk_size=16, eos_token_ids=[])
    for seq in (prompt(13, 4), prompt(3, 5)):  # 30 new tokens: past the window, across longrope's 32
        assert gen.generate(seq, 30) == hf_tokens(name, hf, seq, 30)
    short = prompt(5, 6)  # within the original context: transformers' generate itself
    assert gen.generate(short, 20) == hf_greedy(hf, short, 20, eos=None)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiled_greedy_equals_eager(name, tmp_path):
    hf = hf_family("phi3", seed=len(name), **VARIANTS[name][0])
    model = load_model(save(hf, tmp_path))
    opts = CaptureOptions(buckets=BucketLadder((32, MAX_LEN)), settings=CompileSettings(backend="eager"),
                          kinds=GREEDY, progress=False)
    compiled = Generator(model, max_len=MAX_LEN, chunk_size=16, eos_token_ids=[], compile=True, capture=opts)
    eager = Generator(model, max_len=MAX_LEN, chunk_size=16, eos_token_ids=[])
    for seq in (prompt(13, 4), prompt(3, 5)):
        tokens = compiled.generate(seq, 30)
        assert tokens == eager.generate(seq, 30) == hf_tokens(name, hf, seq, 30)
    records = compiled.capture_records
    assert records and all((r.graph_breaks, r.fallback) == (0, "") for r in records)  # compiled, not eager
    compiled.runner.close()


def test_su_is_longrope(tmp_path):
    path = save(hf_family("phi3", **VARIANTS["mini-128k"][0]), tmp_path)
    rewrite_config(path, lambda c: c["rope_parameters"].update(rope_type="su"))
    assert load_model(path).config.rope.type == "longrope"


def test_joined_rows_take_each_part_slice():
    # q 8 rows, k 4, v 4 over 2 ranks: rank 1 takes q rows 4..7, k rows 10..11, v rows 14..15.
    assert joined_rows((8, 4, 4), TensorParallel(rank=1, world=2)) == [(4, 8), (10, 12), (14, 16)]


def test_two_ranks_equal_one(tmp_path):
    """4 query / 2 KV heads: rank r holds KV head r and its 2 query heads, read out of the joined qkv_proj."""
    ckpt = save(hf_family("phi3", seed=5, **VARIANTS["phi4-mini"][0]), tmp_path / "phi3")
    ref = tp_worker.single(ckpt)
    for r, got in enumerate(tp_worker.spawn(2, ckpt, tmp_path)):
        assert got["eager"] == ref["eager"], f"rank {r} greedy tokens differ from the single process"
        for a, b in zip(got["logits"], ref["logits"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert got["cache_heads"] == 1 and got["cache_bytes"] * 2 == ref["cache_bytes"]
