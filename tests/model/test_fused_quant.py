"""Quantized weights in our CPU kernels: the one-row product (csrc/gemv_quant.cpp, `gemv_q`) against a float64
product by the dequantized weight, and the fused decode layers over quantized projections (`decode_layers_q`)
against the eager quantized layers.

The eager layers' one-row products call the same `gemv_q`, so the fused layers differ from them only where the
float layers do: the norm's sum of squares runs in another order, which can move a bfloat16 value by its last
bit and the layers after it by a little more; float32 ones agree to ~1e-6.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from static_decode.kernels import cpu_kernel
from static_decode.model import quant
from static_decode.model.fused_decode import FusedLayers, projection_formats, unsupported
from static_decode.model.quant import QuantWeight, Scheme
from tests.model.test_fused_decode import CFG, cache_pair, decode_layers, random_model
from tests.support.row_codes import row_codes

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")

QCFG = dataclasses.replace(CFG, intermediate_size=384)  # every K a multiple of 64: int4 takes each projection
SCHEMES = ["int8", "int4-g32", "int4-g64", "int4-g128"]


def _dtypes() -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] if cpu_kernel.bf16_rows() else [torch.float32]


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("N", "K"), [(80, 384), (13, 1536), (1, 128), (7, 128), (5, 576), (3, 192), (5, 8192),
                                        (3, 8256), (4, 8320)])
def test_gemv_q_matches_float64_by_the_dequantized_weight(scheme, dtype, N, K):
    """Every format and group, row counts that leave a partial block of rows (of 2, 3, 4 or 8 rows), K with an
    int8 tail past whole vectors, K an odd number of 64-column chunks (int4 group 32 takes two a step), rows long
    enough (K 8192) for the int4 loop to read each row's two halves side by side, and long rows whose halves it
    cannot split (8256: an odd number of chunks; 8320 at group 128: halves of 4,160 columns)."""
    s = quant.parse(scheme)
    if s.bits == 4 and quant.int4_refusal(K, s.group):
        pytest.skip(f"{scheme} does not take K {K}")
    torch.manual_seed(N * K)
    qw = QuantWeight((torch.randn(N, K) * torch.linspace(0.1, 2, K)).to(dtype), s)
    x = torch.randn(K).to(dtype)
    w = qw.dequantize(torch.float64)  # [N, K]
    xr = row_as_multiplied(x, s.bits)  # [K] float64
    want = w @ xr  # [N]
    got = torch.ops.static_decode_cpu.gemv_q(x, qw.qweight, qw.scales, s.group)
    assert got.shape == (N,) and got.dtype == dtype
    # The error bound scales with sum |w| |x| (cancellation); bfloat16: the output's rounding, 2^-8 relative.
    bound = (w.abs() @ xr.abs()) * 1e-5 + (want.abs() * 2**-8 if dtype == torch.bfloat16 else 0)
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.skipif(not cpu_kernel.int8_dot(), reason="this CPU has no AVX512-VNNI")
def test_both_cpus_row_plans_match_float64() -> None:
    """The one-row products (bf16 and the int8 dot-product loops) take their rows per step and prefetch by CPU
    (AMD's or Intel's): the plan this CPU does not pick, forced in a subprocess, passes the same product tests; a
    plan by another name is refused."""
    here = "amd" if "AMD" in _cpu_vendor() else "intel"
    other = {"amd": "intel", "intel": "amd"}[here]
    root = Path(__file__).resolve().parents[2]
    tests = [f"{__file__}::test_gemv_q_matches_float64_by_the_dequantized_weight",
             f"{__file__}::test_fused_quantized_layers_on_two_threads_equal_one",
             f"{root}/tests/kernels/test_cpu_kernel.py::test_gemv_matches_float64_on_bfloat16_values",
             f"{root}/tests/kernels/test_cpu_kernel.py::test_cat3_is_the_three_products_concatenated",
             f"{root}/tests/kernels/test_cpu_kernel.py::test_glu_is_silu_of_the_rounded_gate_times_the_rounded_up"]
    env = {**os.environ, "STATIC_DECODE_ROW_PLAN": other}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    skips = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    assert all("does not take K" in line for line in skips), skips  # only the formats' own refusals
    bad = subprocess.run([sys.executable, "-c", _PLAN_PROBE], env={**os.environ, "STATIC_DECODE_ROW_PLAN": "arm"},
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 0 and "STATIC_DECODE_ROW_PLAN is 'arm' (amd or intel)" in bad.stdout, bad.stdout


_PLAN_PROBE = """
import torch
from static_decode.kernels import cpu_kernel
from static_decode.model.quant import QuantWeight, Scheme
assert cpu_kernel.available()
qw = QuantWeight(torch.randn(4, 128).bfloat16(), Scheme(8))
try:
    torch.ops.static_decode_cpu.gemv_q(torch.randn(128).bfloat16(), qw.qweight, qw.scales, 0)
except RuntimeError as err:
    print(err)
"""


def _cpu_vendor() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line for line in f if line.startswith("vendor_id")), "")


def row_as_multiplied(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The row as quantized weights of `bits` multiply it (float64): a bfloat16 row's int8 codes where the kernel
    multiplies codes (cpu_kernel.int8_codes; both weight forms' scales are bfloat16 in a bfloat16 model), else the row
    itself."""
    if x.dtype == torch.bfloat16 and cpu_kernel.int8_codes(bits):
        return row_codes(x)
    return x.double()


def test_row_codes8_states_the_blocks():
    """`row_codes8` against the blocks stated one by one (tests/support/row_codes.py): tails, a zero block, values
    at half a code, a block with an infinity."""
    torch.manual_seed(9)
    for K in (32, 100, 576, 3):
        x = (torch.randn(K) * torch.linspace(0.01, 3, K)).bfloat16()
        assert torch.equal(cpu_kernel.row_codes8(x), row_codes(x)), K
    z = torch.zeros(64, dtype=torch.bfloat16)
    z[40] = 2.0
    r = cpu_kernel.row_codes8(z)
    assert r[:32].abs().sum() == 0 and abs(r[40].item() - 2.0) < 1e-6  # 127 codes of d = float32(2 / 127)
    half = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5], dtype=torch.bfloat16)  # d = 1: ties to even
    assert cpu_kernel.row_codes8(half).tolist() == [127.0, 0.0, 2.0, 2.0, -0.0, -2.0]
    bad = torch.randn(64).bfloat16()
    bad[33] = float("inf")
    r = cpu_kernel.row_codes8(bad)
    assert torch.equal(r[32:], bad[32:].double()) and torch.equal(r, row_codes(bad))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_bfloat16_row_is_multiplied_as_int8_codes(scheme):
    """On the int8 dot-product paths (AVX512-VNNI's, AVX2's) the product is the weight times the row's codes, not
    the row: it matches the codes' product closely, and differs from the plain row's by more than its own error."""
    s = quant.parse(scheme)
    if not cpu_kernel.int8_codes(s.bits):
        pytest.skip(f"{cpu_kernel.capability()}: {scheme} weights multiply the row itself here")
    torch.manual_seed(11)
    qw = QuantWeight(torch.randn(64, 1536).bfloat16(), s)
    x = torch.randn(1536) * 0.05
    x[::32] = 10.0  # one large value a block: the small ones keep a code or two of the 127
    x = x.bfloat16()
    w = qw.dequantize(torch.float64)
    got = torch.ops.static_decode_cpu.gemv_q(x, qw.qweight, qw.scales, s.group).double()
    codes, plain = w @ row_codes(x), w @ x.double()
    assert (got - codes).abs().mean() < 0.2 * (plain - codes).abs().mean()
    inf = x.clone()
    inf[700] = float("inf")
    assert torch.ops.static_decode_cpu.gemv_q(inf, qw.qweight, qw.scales, s.group).isnan().all()


def test_gemv_q_int8_tail_and_float16_row():
    """K not a multiple of the 16-wide vectors (masked loads); a float16 row in, float16 out."""
    torch.manual_seed(3)
    qw = QuantWeight(torch.randn(9, 100), Scheme(8))
    x = torch.randn(100, dtype=torch.float16)
    got = torch.ops.static_decode_cpu.gemv_q(x, qw.qweight, qw.scales, 0)
    want = qw.dequantize() @ x.double()
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequant_q_is_the_float64_weight_rounded_once(scheme, dtype):
    """The chunks' weight (csrc/gemv_quant.cpp's dequant_q): the exact dequantized weight rounded to `dtype`."""
    s = quant.parse(scheme)
    torch.manual_seed(4)
    qw = QuantWeight(torch.randn(24, 384).to(dtype), s)
    got = torch.ops.static_decode_cpu.dequant_q(qw.qweight, qw.scales, s.group, dtype)
    assert got.dtype == dtype and torch.equal(got, qw.dequantize(torch.float64).to(dtype))


def test_gemv_q_refuses_naming_the_value():
    qw = QuantWeight(torch.randn(16, 128), Scheme(4, 32))
    x = torch.randn(128)
    op = torch.ops.static_decode_cpu.gemv_q
    with pytest.raises(RuntimeError, match="group 16"):
        op(x, qw.qweight, qw.scales, 16)
    with pytest.raises(RuntimeError, match=r"int4 scales must be \[16, 2, 2\], got \[16, 4, 2\]"):
        op(x, qw.qweight, qw.scales, 64)
    with pytest.raises(RuntimeError, match="int8 codes must be int8"):
        op(x, qw.qweight, qw.scales, 0)
    with pytest.raises(RuntimeError, match=r"x \[127\] is not one row of the 128 values"):
        op(x[:127], qw.qweight, qw.scales, 32)
    with pytest.raises(RuntimeError, match="K a multiple of 64"):
        op(torch.randn(96), qw.qweight[:, :48].contiguous(), qw.scales[:, :3].contiguous(), 32)


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("cached", "n_new", "read_len"), [(37, 1, 48), (600, 1, 1024), (37, 0, 48), (0, 1, 16)])
def test_fused_quantized_layers_match_the_eager_ones(scheme, dtype, cached, n_new, read_len):
    cfg = QCFG if scheme != "int4-g128" else dataclasses.replace(QCFG, hidden_size=256, num_heads=8, head_dim=32)
    model = quant.quantize_model(random_model(dtype, cfg=cfg), scheme)
    assert unsupported(model, model.new_cache(1, 64)) is None
    ref_cache, cache = cache_pair(model, cached)
    want = decode_layers(model, ref_cache, 17, n_new, read_len, fused=False)
    got = decode_layers(model, cache, 17, n_new, read_len, fused=True)
    assert want.abs().max() > 1.0  # the layers did move x
    # bfloat16: a last-bit difference in a norm grows through the random layers: 3% of the largest value, and
    # on average 1% of the mean magnitude; float32: the summation order of the norm only.
    for a, b in ((got, want), (cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        if dtype == torch.bfloat16:
            torch.testing.assert_close(a, b, rtol=0.03, atol=0.03 * b.abs().max().item())
            assert (a.float() - b.float()).abs().mean() <= 0.01 * b.float().abs().mean()
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_quantized_layers_on_two_threads_equal_one(scheme, dtype):
    """On two threads each prepares a part of the row (192 and 384 values: parts of 128 and a shorter last one)
    before the products: the same layers, the same cache, bit for bit, as one thread preparing it all."""
    cfg = QCFG if scheme != "int4-g128" else dataclasses.replace(QCFG, hidden_size=256, num_heads=8, head_dim=32)
    model = quant.quantize_model(random_model(dtype, cfg=cfg), scheme)
    one_cache, two_cache = cache_pair(model, 37)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_layers(model, one_cache, 17, 1, 48, fused=True)
        torch.set_num_threads(2)
        two = decode_layers(model, two_cache, 17, 1, 48, fused=True)
    finally:
        torch.set_num_threads(threads)
    assert one.abs().max() > 1.0
    assert torch.equal(one, two)
    assert torch.equal(one_cache.k, two_cache.k) and torch.equal(one_cache.v, two_cache.v)


def test_fused_quantized_layers_refuse_bad_calls_before_writing():
    model = quant.quantize_model(random_model(torch.float32, cfg=QCFG), "int4-g32")
    cache = model.new_cache(1, 64)
    layers = FusedLayers(model, 0, len(model.layers))
    assert layers.group == 32 and len(layers.scales) == 7 * QCFG.num_layers
    k, v = cache.k.clone(), cache.v.clone()
    x = torch.randn(1, 1, QCFG.hidden_size)
    from static_decode.model import rope

    cos, sin = rope.cos_sin(model.inv_freq, cache.lens[:, None], model.dtype)
    n, lens_after = torch.tensor([1]), cache.lens + 1
    args = (x, cos, sin, cache.k, cache.v, cache.lens, n, lens_after, 32)
    op = torch.ops.static_decode_cpu.decode_layers_q
    with pytest.raises(RuntimeError, match="20 scales for 3 layers"):
        op(*args, layers.weights, layers.scales[:-1], 32, 1e-5)
    with pytest.raises(RuntimeError, match=r"int4 scales must be \[192, 3, 2\], got \[192, 6, 2\]"):
        op(*args, layers.weights, layers.scales, 64, 1e-5)
    with pytest.raises(RuntimeError, match="int8 codes must be int8"):
        op(*args, layers.weights, layers.scales, 0, 1e-5)
    bad = list(layers.scales)
    bad[3] = bad[3][:, :1].contiguous()  # layer 0's o_proj scales: one group of six
    with pytest.raises(RuntimeError, match="layer 0 weight 4"):
        op(*args, layers.weights, bad, 32, 1e-5)
    floats = list(layers.weights)
    floats[1] = torch.randn(192, 192)  # a float weight where layer 0's q codes belong
    with pytest.raises(RuntimeError, match="layer 0 weight 1"):
        op(*args, floats, layers.scales, 32, 1e-5)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


def test_projections_in_several_formats_stay_off_the_kernel():
    model = quant.quantize_model(random_model(torch.float32, cfg=QCFG), "int8")
    other = random_model(torch.float32, cfg=QCFG)
    model.layers[1].mlp.down_proj = quant.QuantLinear(other.layers[1].mlp.down_proj.weight, None, Scheme(4, 32))
    assert projection_formats(model) == {Scheme(8), Scheme(4, 32)}
    assert unsupported(model, model.new_cache(1, 64)) == (
        "projections in several formats (int4-g32, int8): the kernel takes one")
