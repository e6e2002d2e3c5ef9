"""`static-decode perplexity`: the chunked score equals a one-pass reference; the command, its text and its errors.

Pins:
* perplexity through chunks (the cache and offset mask on the path) equals exp(cross-entropy) of one whole-sequence
  forward computed independently, for chunk sizes that do and do not divide the length;
* the shipped default text is in the package and long enough (>= 1,024 tokens of the embedded byte tokenizer);
* the command prints one line with the perplexity (float and --quantize int8 / int4, and with --kv-dtype int8 the
  int8 cache's), and refuses bad options in one line naming them.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from static_decode.checkpoints.loading import default_model_path, load_model, load_tokenizer
from static_decode.commands import cli
from static_decode.commands.perplexity import default_text_path, perplexity


@pytest.fixture(scope="module")
def model():
    return load_model(default_model_path())


@pytest.fixture(scope="module")
def ids():
    text = default_text_path().read_text(encoding="utf-8")
    return load_tokenizer(default_model_path()).encode(text, add_special_tokens=False).ids


def test_default_text_ships_and_is_long_enough(ids):
    assert default_text_path().is_file()
    assert len(ids) >= 1024


@pytest.mark.parametrize("chunk", [7, 32, 96])
def test_chunked_perplexity_equals_one_pass_cross_entropy(model, ids, chunk):
    seq = ids[:96]
    tokens = torch.tensor([seq])  # [1, 96]
    with torch.no_grad():
        logits = model(tokens, model.new_cache(1, 96), [96])[0]  # [96, V]: one chunk, nothing cached before
    want = math.exp(F.cross_entropy(logits[:-1].double(), tokens[0, 1:]).item())
    got = perplexity(model, seq, chunk)
    assert got.tokens == 96
    assert got.perplexity == pytest.approx(want, rel=1e-5)
    assert got.nll == pytest.approx(math.log(want), rel=1e-5)


def test_perplexity_refuses_too_few_tokens(model):
    with pytest.raises(ValueError, match="at least 2 tokens, got 1"):
        perplexity(model, [5], 4)
    with pytest.raises(ValueError, match="chunk must be a positive int, got 0"):
        perplexity(model, [5, 6], 0)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_command_prints_the_perplexity(capsys, quantize):
    argv = ["perplexity", "--tokens", "64", "--chunk", "16", "-q"] + (["--quantize", quantize] if quantize else [])
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("perplexity ") and "64 tokens of perplexity.txt in chunks of 16" in out
    assert (quantize or "float32") in out
    value = float(out.split()[1])
    assert 1.0 < value < 256.0  # a byte model: better than uniform over its 256 tokens


def test_kv_dtype_reaches_the_cache_every_chunk_attends_through(capsys, model, ids):
    """--kv-dtype int8: the printed perplexity is the function's on a model with an int8 cache, which differs from
    the float cache's (the codes round K and V) but only slightly."""
    assert cli.main(["perplexity", "--tokens", "64", "--chunk", "16", "-q", "--kv-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "float32, int8 cache;" in out
    float_cache = perplexity(model, ids[:64], 16).perplexity
    model.kv_dtype = "int8"
    try:
        int8_cache = perplexity(model, ids[:64], 16).perplexity
    finally:
        model.kv_dtype = None
    assert float(out.split()[1]) == pytest.approx(int8_cache, abs=1e-4)
    assert int8_cache != float_cache and int8_cache == pytest.approx(float_cache, rel=0.02)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "1"], "--tokens must be at least 2, got 1"),
        (["--chunk", "0"], "--chunk must be at least 1, got 0"),
        (["--text", "/nonexistent/t.txt"], "no text file /nonexistent/t.txt (--text)"),
    ],
)
def test_command_refuses_bad_options_in_one_line(capsys, argv, message):
    assert cli.main(["perplexity", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"static-decode perplexity: error: {message}"
