"""The decode projection formulation (static_decode.model.projection): where it streams, and that it computes F.linear.

Pins: the multiply-and-row-sum form is chosen only for one row, on the CPU, in bfloat16/float16, inside a compiled
step; compiled by inductor it equals a float32 reference as closely as the library GEMM does (bf16 output
rounding), with and without a bias.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from static_decode.model import projection


def test_it_streams_only_one_compiled_16_bit_cpu_row():
    w16, w32 = torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(4, 3)
    assert not projection.streams(w16, 1)  # eager: F.linear (the product would be materialised)
    seen = {}

    def probe(x):
        seen["bf16 1"] = projection.streams(w16, 1)
        seen["bf16 2"] = projection.streams(w16, 2)
        seen["f32 1"] = projection.streams(w32, 1)
        seen["f16 1"] = projection.streams(w16.half(), 1)
        return x + 1

    torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros(1))
    assert seen == {"bf16 1": True, "bf16 2": False, "f32 1": False, "f16 1": True}


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 96), (1, 96)])
def test_compiled_stream_equals_a_float32_reference(shape, bias, kernel, monkeypatch):
    """The streamed form (kernel=False: as on a CPU without AVX512-BF16 or AVX2) and the bfloat16 GEMV kernel where
    it runs."""
    from static_decode.kernels import cpu_kernel

    if kernel and not (cpu_kernel.bf16_rows() and cpu_kernel.available()):
        pytest.skip("no bfloat16 GEMV kernel here (AVX512-BF16 or AVX2)")
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "gemv_ready", lambda weight: False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    N, K = 200, shape[-1]
    w = torch.randn(N, K).to(torch.bfloat16)
    b = torch.randn(N).to(torch.bfloat16) if bias else None
    x = torch.randn(*shape).to(torch.bfloat16)
    got = torch.compile(projection.linear, fullgraph=True, dynamic=False)(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    lib = F.linear(x, w, b)
    assert got.shape == lib.shape == ref.shape and got.dtype == torch.bfloat16
    err, lib_err = (got.float() - ref).abs().max(), (lib.float() - ref).abs().max()
    assert err <= max(lib_err * 1.5, 0.05), (err, lib_err)  # bf16 rounding of the output, like the library's


def test_a_head_sized_product_reads_its_row_from_one_buffer(monkeypatch):
    """Past MATERIALIZE_ROWS weight rows (the head) the row is a buffer of its own: the product still equals the
    reference with a norm fused in front of it, and the generated code computes the norm once, before the loop over
    the weight rows (without the buffer inductor inlines it and recomputes the rsqrt once per row). The streamed
    form as it runs without our bfloat16 GEMV kernel (a CPU without AVX512-BF16 or AVX2; float16 weights)."""
    import torch._inductor.config as inductor_config

    from static_decode.kernels import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "gemv_ready", lambda weight: False)
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    N, K = projection.MATERIALIZE_ROWS, 64
    w, x, g = torch.randn(N, K).to(torch.bfloat16), torch.randn(K).to(torch.bfloat16), torch.randn(K)

    def norm(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * g).to(torch.bfloat16)  # a final norm

    def head(x, w):
        return projection.linear(norm(x)[None], w)

    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=True):  # the kernels' source in the returned code
        got, codes = run_and_get_code(torch.compile(head, fullgraph=True, dynamic=False), x, w)
    torch._dynamo.reset()
    ref = F.linear(norm(x).float()[None], w.float())
    assert (got.float() - ref).abs().max() <= 0.1
    assert torch.equal(projection.materialized(x), x)  # eager: a copy
    code = "\n".join(codes)
    rows = code.split(f"x0<static_cast<int64_t>({N}L)")  # the loops over the weight rows
    assert len(rows) >= 2 and "sqrt(" in rows[0] and not any("sqrt(" in r for r in rows[1:]), code[-3000:]
