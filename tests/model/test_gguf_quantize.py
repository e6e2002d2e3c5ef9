"""Float weights quantized into GGUF blocks (static_decode.model.gguf_quantize): the blocks are what gguf's own
dequantization reads (the values ours give), each type's error on a weight with outliers is within its bound (Q4_K:
int4-g32's at three quarters of the bytes), and a model quantized at load runs on them; refusals name the layer."""

from __future__ import annotations

import pytest
import torch

from static_decode.checkpoints.loading import default_model_path, load_model
from static_decode.model.gguf_dequant import dequantize_blocks
from static_decode.model.gguf_quant import Blocks, BlockWeight
from static_decode.model.gguf_quantize import quantize_blocks
from static_decode.model.quant import QuantWeight, Scheme, parse, quantize_model, weight_bytes
from tests.support.checkpoints import feed
from tests.support.gguf_blocks import gguf_dequantized

BOUNDS = {"Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.06, "Q4_K": 0.1}  # relative RMS error


def _weight() -> torch.Tensor:
    w = torch.randn(192, 1024, generator=torch.Generator().manual_seed(3)) * 0.05
    w[:, :4] *= 10  # outlier columns, as real projections have
    w[7] = 0.0  # a zero row: scales 0, codes 0
    return w


def _rel(a: torch.Tensor, w: torch.Tensor) -> float:
    return float(((a - w).pow(2).mean() / w.pow(2).mean()).sqrt())


@pytest.mark.parametrize("kind", list(BOUNDS))
def test_blocks_are_gguf_s_and_within_the_bound(kind):
    w = _weight()
    blocks = quantize_blocks(w, kind)
    values = gguf_dequantized(blocks, kind)
    assert torch.equal(values, dequantize_blocks(blocks, kind))
    assert _rel(values, w) < BOUNDS[kind]
    assert torch.equal(values[7], torch.zeros(1024))


def test_q4_k_matches_int4_g32_at_three_quarters_of_the_bytes():
    w = _weight()
    blocks = quantize_blocks(w, "Q4_K")
    int4 = QuantWeight(w, Scheme(4, 32))
    assert _rel(gguf_dequantized(blocks, "Q4_K"), w) < 1.1 * _rel(int4.dequantize(torch.float32), w)
    assert blocks.nbytes * 8 / w.numel() == 4.5 and int4.nbytes * 8 / w.numel() == 6.0


def test_refusals_name_the_value():
    with pytest.raises(ValueError, match="Q4_K takes a weight whose 96 inputs are a multiple of 256; use q8_0"):
        quantize_blocks(torch.randn(4, 96), "Q4_K")
    with pytest.raises(ValueError, match="GGUF type 'Q3_K' is not one this quantizes"):
        quantize_blocks(torch.randn(4, 256), "Q3_K")
    assert parse("Q4_K") == Blocks(("Q4_K",)) and parse("q8_0") == Blocks(("Q8_0",))


def test_a_model_quantized_at_load_runs_on_the_blocks():
    path = default_model_path()
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\..*Q4_K takes a weight whose .* multiple of 256"):
        load_model(path, quantize="q4_k")
    ref = load_model(path)
    model = load_model(path, quantize="q8_0")
    assert model.quantization == Blocks(("Q8_0",)) and isinstance(model.lm_head.weight, BlockWeight)
    assert weight_bytes(model) < weight_bytes(ref)
    rows = [[5, 9, 100, 7, 3, 44]]
    got, want = feed(model, rows, 3)[0], feed(ref, rows, 3)[0]
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    with pytest.raises(ValueError, match=r"already quantized \(gguf Q8_0\)"):
        quantize_model(model, "int8")
