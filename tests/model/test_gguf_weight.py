"""BlockWeight (static_decode.model.gguf_quant) off the CPU kernels: the tensor code a CUDA step runs (one row as a
reduction over the dequantized values, fused by inductor when compiled; several rows through the dequantized weight;
an embedding's lookups), run here on the CPU with the kernels switched off, against gguf's own dequantization; and the
refusals of weights it cannot hold."""

from __future__ import annotations

import pytest
import torch

from static_decode.model import gguf_quant
from static_decode.model.gguf_dequant import BLOCK_TYPES
from static_decode.model.gguf_quant import BlockEmbedding, BlockLinear, BlockWeight
from tests.support.gguf_blocks import gguf_dequantized, random_blocks


@pytest.fixture
def tensor_code(monkeypatch):
    """The kernels off, as on CUDA."""
    monkeypatch.setattr(gguf_quant.BlockWeight, "_kernel", lambda self: False)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tensor_code_products_are_the_dequantized_weight_s(tensor_code, kind, dtype):
    blocks = random_blocks(kind, 48, 512, seed=11)
    w = BlockWeight(blocks, kind, 512, dtype)
    ref = gguf_dequantized(blocks, kind).double()  # [48, 512]
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(11)).to(dtype)
    scale = float((x.double().abs() @ ref.abs().t()).max())  # float32 sums: an error of a few ulps of this
    tol = dict(rtol=0, atol=1e-5 * scale) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * scale)
    one = w.matmul(x[:1])  # [1, 48]: a reduction over the float32 values
    torch.testing.assert_close(one.double(), (x[:1].double() @ ref.t()), **tol)
    many = w.matmul(x)  # [3, 48]: the dequantized weight in x's dtype
    torch.testing.assert_close(many.double(), (x.double() @ ref.to(dtype).double().t()), **tol)
    assert torch.equal(w.dequantize(torch.float32), ref.float())
    index = torch.tensor([[3, 0], [47, 3]])
    assert torch.equal(BlockEmbedding(w)(index), ref.float()[index].to(dtype))


def test_a_compiled_one_row_product_fuses_the_dequantization(tensor_code):
    blocks = random_blocks("Q4_K", 64, 512, seed=12)
    w = BlockLinear(BlockWeight(blocks, "Q4_K", 512, torch.float32), None)
    x = torch.randn(1, 1, 512)
    compiled = torch.compile(w, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x), w(x), rtol=1e-5, atol=1e-5)


def test_refusals_name_the_value():
    blocks = random_blocks("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="GGUF type 'IQ4_XS' is not held as blocks"):
        BlockWeight(blocks, "IQ4_XS", 256, torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16 model, got torch.float16"):
        BlockWeight(blocks, "Q4_K", 256, torch.float16)
    with pytest.raises(ValueError, match=r"Q4_K blocks \(4, 144\) do not hold rows of 512 weights"):
        BlockWeight(blocks, "Q4_K", 512, torch.float32)
    with pytest.raises(ValueError, match="must be uint8 bytes"):
        BlockWeight(blocks.view(torch.int8), "Q4_K", 256, torch.float32)
    assert set(BLOCK_TYPES) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
