"""Several rows times a quantized weight on the CPU (csrc/linear_quant.cpp, `linear_q`: the weight dequantized a block
of rows at a time, each block through the float GEMM) against the float64 product by the dequantized weight rounded
to the rows' dtype, the weight the GEMM multiplies by; and its refusals, which name the bad value."""

from __future__ import annotations

import pytest
import torch

from static_decode.kernels import cpu_kernel
from static_decode.model import quant
from static_decode.model.quant import QuantWeight, Scheme

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")

SCHEMES = ["int8", "int4-g32", "int4-g64", "int4-g128"]
OP = torch.ops.static_decode_cpu.linear_q if cpu_kernel.available() else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("scheme", "M", "N", "K"), [
    (scheme, *shape) for scheme in SCHEMES
    for shape in [(3, 80, 384), (1, 7, 128), (17, 300, 4096), (5, 150, 8192), (2, 1, 576)]
    if quant.parse(scheme).bits == 8 or not quant.int4_refusal(shape[2], quant.parse(scheme).group)])
def test_linear_q_matches_float64_by_the_rounded_weight(scheme, dtype, M, N, K):
    """Row counts of one and several; weights of one block of rows and of several with a partial last one (K 4096:
    128 bfloat16 or 64 float32 rows a block; K 8192: 64 or 32). Every format takes every K here but group 128 K 576."""
    s = quant.parse(scheme)
    torch.manual_seed(M * N + K)
    qw = QuantWeight((torch.randn(N, K) * torch.linspace(0.1, 2, K)).to(dtype), s)
    x = torch.randn(M, K).to(dtype)
    w = qw.dequantize(torch.float64).to(dtype).double()  # [N, K]: the values the GEMM multiplies by
    want = x.double() @ w.t()  # [M, N]
    got = OP(x, qw.qweight, qw.scales, s.group)
    assert got.shape == (M, N) and got.dtype == dtype
    # float32 sums in some order; bfloat16: the output's rounding (2^-8 relative) on top
    bound = (x.double().abs() @ w.abs().t()) * 1e-5 + (want.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_rows_by_a_large_weight_take_linear_q(dtype, monkeypatch):
    """QuantWeight.matmul sends a chunk's rows (any leading shape) through linear_q on the CPU where the weight
    dequantized would take BLOCKED_BYTES or more, else through the whole dequantized weight."""
    qw = QuantWeight(torch.randn(40, 256).to(dtype), Scheme(4, 32))
    x = torch.randn(2, 3, 256).to(dtype)
    size = 40 * 256 * x.element_size()
    for limit, op in ((size, "linear_q"), (size + 1, "dequant_q")):
        monkeypatch.setattr(quant, "BLOCKED_BYTES", limit)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = qw.matmul(x)
        names = {e.name for e in prof.events()} & {"static_decode_cpu::linear_q", "static_decode_cpu::dequant_q"}
        assert names == {f"static_decode_cpu::{op}"}, (limit, names)
        assert got.shape == (2, 3, 40) and got.dtype == dtype
        if op == "linear_q":
            assert torch.equal(got, OP(x.reshape(6, 256), qw.qweight, qw.scales, 32).reshape(2, 3, 40))


def test_linear_q_refuses_naming_the_value():
    qw = QuantWeight(torch.randn(16, 128), Scheme(4, 32))
    x = torch.randn(2, 128)
    with pytest.raises(RuntimeError, match=r"x \[128\] is not \[M, 128\]"):
        OP(x[0], qw.qweight, qw.scales, 32)
    with pytest.raises(RuntimeError, match=r"x \[0, 128\] is not \[M, 128\]"):
        OP(x[:0], qw.qweight, qw.scales, 32)
    with pytest.raises(RuntimeError, match=r"x \[2, 127\] is not \[M, 128\]"):
        OP(x[:, :127], qw.qweight, qw.scales, 32)
    with pytest.raises(RuntimeError, match="x's dtype Half is not float32/bfloat16"):
        OP(x.half(), qw.qweight, qw.scales, 32)
    with pytest.raises(RuntimeError, match=r"int4 scales must be \[16, 2, 2\], got \[16, 4, 2\]"):
        OP(x, qw.qweight, qw.scales, 64)
    with pytest.raises(RuntimeError, match="group 16"):
        OP(x, qw.qweight, qw.scales, 16)
