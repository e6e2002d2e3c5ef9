"""The GGUF block ops (csrc/gguf_ops.cpp and the ISA's loop) and their tensor-code twin (model/gguf_dequant.py)
against gguf's own dequantization: every value bit for bit in float32, the one-row product against the float64
product of those values by the row's int8 codes (cpu_kernel.row_codes8, stated independently there), several rows
against torch's float product. The ISA's loop runs here; the forced-ISA reruns (tests/support/isa_runs.py) run the
AVX2 and portable ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from static_decode.kernels import cpu_kernel
from static_decode.model.gguf_dequant import BLOCK_TYPES, dequantize_blocks
from tests.support.gguf_blocks import gguf_dequantized, random_blocks

KINDS = tuple(BLOCK_TYPES)
ROOT = Path(__file__).resolve().parents[2]
needs_kernels = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")
OPS = torch.ops.static_decode_cpu if cpu_kernel.available() else None


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_code_dequantizes_as_gguf_bit_for_bit(kind):
    blocks = random_blocks(kind, 24, 512, seed=1)
    assert torch.equal(bits(dequantize_blocks(blocks, kind)), bits(gguf_dequantized(blocks, kind)))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_dequantizes_as_gguf_bit_for_bit_and_rounds_bfloat16_once(kind):
    blocks = random_blocks(kind, 40, 768, seed=2)
    want = gguf_dequantized(blocks, kind)
    assert torch.equal(bits(OPS.dequant_gguf(blocks, BLOCK_TYPES[kind].number, torch.float32)), bits(want))
    assert torch.equal(OPS.dequant_gguf(blocks, BLOCK_TYPES[kind].number, torch.bfloat16), want.to(torch.bfloat16))


def _check_row_product(y: torch.Tensor, blocks: torch.Tensor, kind: str, x: torch.Tensor) -> None:
    w = gguf_dequantized(blocks, kind).double()  # [N, K]
    codes = cpu_kernel.row_codes8(x)  # float64 [K]
    want = w @ codes
    bound = 1e-5 * (w.abs() @ codes.abs()) + want.abs() * (2**-8 if x.dtype == torch.bfloat16 else 0)
    err = (y.double().reshape(-1) - want).abs()
    assert (err <= bound + 1e-30).all(), (kind, float((err - bound).max()))


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_is_the_float64_product_of_the_row_codes(kind, dtype):
    for n, k, seed in ((37, 256, 3), (130, 1536, 4)):
        blocks = random_blocks(kind, n, k, seed=seed)
        x = (torch.randn(1, k, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
        y = OPS.gemv_gguf(x, blocks, BLOCK_TYPES[kind].number)
        assert y.shape == (1, n) and y.dtype == dtype
        _check_row_product(y, blocks, kind, x)
        _check_row_product(OPS.gemv_gguf_portable(x, blocks, BLOCK_TYPES[kind].number), blocks, kind, x)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_a_row_block_with_a_nan_or_infinity_gives_nan(kind):
    blocks = random_blocks(kind, 8, 512, seed=5)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 512)
        x[0, 300] = bad
        assert OPS.gemv_gguf(x, blocks, BLOCK_TYPES[kind].number).isnan().all()


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_rows_multiply_the_dequantized_weight(kind, dtype):
    blocks = random_blocks(kind, 300, 512, seed=6)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6)).to(dtype)
    got = OPS.linear_gguf(x, blocks, BLOCK_TYPES[kind].number)
    want = x @ gguf_dequantized(blocks, kind).to(dtype).t()
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


@needs_kernels
def test_several_rows_in_inference_mode_on_two_threads():
    from static_decode.model.quant import QuantWeight, Scheme

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        blocks = random_blocks("Q4_K", 512, 512, seed=7)
        q = QuantWeight(torch.randn(512, 512), Scheme(8))
        with torch.inference_mode():
            x = torch.randn(4, 512)
            got = OPS.linear_gguf(x, blocks, 12)
            got_q = OPS.linear_q(x, q.qweight, q.scales, 0)
        torch.testing.assert_close(got, x @ gguf_dequantized(blocks, "Q4_K").t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_q, x @ q.dequantize(torch.float32).t(), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_refusals_name_the_value():
    good = random_blocks("Q4_K", 4, 256)
    x = torch.randn(1, 256)
    cases = [
        (lambda: OPS.gemv_gguf(x, good, 5), "GGUF type 5 is not one the kernels read"),
        (lambda: OPS.gemv_gguf(x, good.view(torch.int8), 12), "blocks must be uint8"),
        (lambda: OPS.gemv_gguf(x, good[:, :100], 12), "must hold whole Q4_K blocks of 144 bytes"),
        (lambda: OPS.gemv_gguf(torch.randn(1, 512), good, 12), "is not [M, 256]"),
        (lambda: OPS.gemv_gguf(torch.randn(2, 256), good, 12), "must be one row"),
        (lambda: OPS.gemv_gguf(x.double(), good, 12), "is not float32/bfloat16"),
        (lambda: OPS.dequant_gguf(good, 12, torch.float16), "(float32 or bfloat16)"),
        (lambda: OPS.linear_gguf(torch.randn(0, 256), good, 12), "is not [M, 256]"),
        (lambda: OPS.linear_gguf(x, torch.cat([good, good], 1)[:, ::2], 12), "must be contiguous"),
        (lambda: OPS.gemv_gguf(x, good[:0], 12), "must hold whole Q4_K blocks"),
    ]
    for call, words in cases:
        with pytest.raises(RuntimeError, match=None) as err:
            call()
        assert words in str(err.value), (words, str(err.value))


@needs_kernels
def test_fuzzed_calls_compute_the_reference_or_are_refused_without_a_trace(tmp_path):
    trail = tmp_path / "trail.txt"
    proc = subprocess.run([sys.executable, "-m", "tests.support.native_fuzz_gguf", "300", str(trail)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = trail.read_text().splitlines()[-1:] if trail.exists() else []
    assert proc.returncode == 0, f"exit {proc.returncode} during {last}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    ran, refused = (int(v) for v in proc.stdout.split()[-2:])
    assert ran > 50 and refused > 50, proc.stdout
