"""The quantized products written for CUDA (static_decode.model.quant_cuda), run on CPU tensors, eagerly and compiled
by inductor's CPU backend, and the setting that picks the int4 one (`quant.use_int4_kernel`).

Pins:
* int8 one row / several rows, int4 one row ("reduce") and int4 through torch's int4pack ops ("tinygemm"; on
  the CPU their CPU counterparts over the same scales_and_zeros) agree with float64 by the dequantized weight
  (`QuantWeight.dequantize(torch.float64)`): float32 to 1e-5 of the largest output (accumulation order), bfloat16
  to 2^-7 of it (the output's rounding, 2^-8, twice over); compiled agrees with eager to float32 rounding;
* compiled, the one-row int8 and int4 products allocate no buffer anywhere near the [N, K] weight (inductor's
  generated code read back), one fused kernel each; the counterfactual (dequantize, then F.linear) does;
* `QuantWeight.matmul` on a CUDA weight routes one row to these products (the device faked on CPU tensors);
* the tinygemm operands: torch's CUDA byte order (column 2i high nibble, 2i + 1 low), scales_and_zeros
  [K / group, N, 2]; they are not saved and not counted as weight bytes; "reduce" drops them;
* refusals name the value and the layer, and leave the model as it was.
On a GPU (`-m gpu`): a small CUDA model quantized on the device decodes compiled with eager's greedy tokens,
with either int4 kernel.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from static_decode import Llama, LlamaConfig
from static_decode.model import quant, quant_cuda
from static_decode.model.quant import QuantWeight, Scheme

N, K = 256, 1024  # a weight whose [N, K] is far larger than anything else a one-row product needs
SCHEMES = [Scheme(8), Scheme(4, 32), Scheme(4, 64), Scheme(4, 128)]
DTYPES = [torch.float32, torch.bfloat16]


def _weight(scheme: Scheme, dtype: torch.dtype, n: int = N, k: int = K) -> QuantWeight:
    torch.manual_seed(0)
    w = torch.randn(n, k, dtype=dtype) * torch.linspace(0.1, 2, k).to(dtype)  # groups of varied ranges
    return QuantWeight(w, scheme)


def _tol(dtype: torch.dtype, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    return (1e-5 if dtype == torch.float32 else 2 ** -7) * scale


def _product(qw: QuantWeight):
    """The device product of one row (what `QuantWeight.matmul` calls on CUDA)."""
    if qw.scheme.bits == 8:
        return lambda x: quant_cuda.int8_matmul(x, qw.qweight, qw.scales)
    return lambda x: quant_cuda.int4_row(x, qw.qweight, qw.scales, qw.scheme.group)


def _buffers(code: str) -> list[int]:
    """Element counts of the buffers inductor's generated (CPU) code allocates: its own (`empty_strided_cpu`) and
    those an extern op returns (the size it asserts for them)."""
    sizes = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", code)
    sizes += re.findall(r"assert_size_stride\(buf\d+, \(([^)]*)\)", code)
    return [int(torch.Size(int(d) for d in s.split(",") if d.strip()).numel()) for s in sizes]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_one_row_matches_float64_eager_and_compiled(scheme: Scheme, dtype: torch.dtype) -> None:
    qw = _weight(scheme, dtype)
    x = torch.randn(1, K, dtype=dtype)
    ref = x.double() @ qw.dequantize(torch.float64).t()  # [1, N]
    fn = _product(qw)
    eager = fn(x)
    torch._dynamo.reset()
    compiled, code = run_and_get_code(torch.compile(fn, fullgraph=True, dynamic=False), x)
    for got in (eager, compiled):
        assert got.shape == (1, N) and got.dtype == dtype
        assert (got.double() - ref).abs().max().item() <= _tol(dtype, ref)
    # Compiled = eager up to float32 summation order (then the same rounding to the output dtype).
    assert (compiled.float() - eager.float()).abs().max().item() <= (
        1e-5 * ref.abs().max().item() if dtype == torch.float32 else 2 ** -8 * ref.abs().max().item())
    # One fused kernel reads the codes; nothing it allocates comes near the weight's [N, K] (only [N] outputs).
    assert code[0].count("async_compile.cpp") == 1
    assert max(_buffers(code[0])) <= N


def test_the_buffer_check_sees_a_materialised_weight() -> None:
    """The counterfactuals: a weight handed to F.linear is an [N, K] buffer in the compiled code, converted by
    inductor (gpt-fast's int8 form on the CPU) or dequantized by an op."""
    q8, q4 = _weight(Scheme(8), torch.bfloat16), _weight(Scheme(4, 32), torch.bfloat16)
    x = torch.randn(1, K, dtype=torch.bfloat16)
    for fn in (lambda x: F.linear(x, q8.qweight.to(x.dtype)) * q8.scales,
               lambda x: F.linear(x, q4.dequantize(x.dtype))):
        torch._dynamo.reset()
        _, code = run_and_get_code(torch.compile(fn), x)
        assert max(_buffers(code[0])) >= N * K


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [2, 7])
def test_int8_several_rows(rows: int, dtype: torch.dtype) -> None:
    qw = _weight(Scheme(8), dtype)
    x = torch.randn(rows, K, dtype=dtype)
    ref = x.double() @ qw.dequantize(torch.float64).t()
    got = quant_cuda.int8_matmul(x, qw.qweight, qw.scales)
    assert got.shape == (rows, N) and got.dtype == dtype
    # gpt-fast's form rounds the product to the dtype before scaling: two roundings.
    assert (got.double() - ref).abs().max().item() <= 2 * _tol(dtype, ref)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_dequantized_is_the_stored_weight(group: int) -> None:
    qw = _weight(Scheme(4, group), torch.float32)
    assert torch.equal(quant_cuda.int4_dequantized(qw.qweight, qw.scales, group, torch.float64), qw.dequantize())


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """QuantWeight.matmul takes its CUDA branches on CPU tensors (the device it asks is CUDA)."""
    monkeypatch.setattr(QuantWeight, "device", property(lambda self: torch.device("cuda")))


@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.name)
def test_matmul_on_cuda_routes_one_row_to_the_device_products(scheme: Scheme, monkeypatch) -> None:
    qw = _weight(scheme, torch.bfloat16)
    calls: list[str] = []
    for name in ("int8_matmul", "int4_row"):
        real = getattr(quant_cuda, name)
        monkeypatch.setattr(quant_cuda, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    _fake_cuda(monkeypatch)
    for rows in (1, 3):
        x = torch.randn(1, rows, K, dtype=torch.bfloat16)
        ref = x.double() @ qw.dequantize().t()
        got = qw.matmul(x)
        assert got.shape == (1, rows, N)
        assert (got.double() - ref).abs().max().item() <= 2 * _tol(torch.bfloat16, ref)
    # int8: both go to int8_matmul; int4: one row to int4_row, the 3 rows dequantized for the GEMM.
    assert calls == (["int8_matmul"] * 2 if scheme.bits == 8 else ["int4_row"])


@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda s: s.name)
def test_compiled_matmul_on_cuda_materialises_no_weight(scheme: Scheme, monkeypatch) -> None:
    """`QuantWeight.matmul` itself, compiled on its CUDA branch: one row allocates [N]-sized buffers only."""
    qw = _weight(scheme, torch.bfloat16)
    _fake_cuda(monkeypatch)
    x = torch.randn(1, 1, K, dtype=torch.bfloat16)
    torch._dynamo.reset()
    got, code = run_and_get_code(torch.compile(qw.matmul, fullgraph=True, dynamic=False), x)
    ref = x.double() @ qw.dequantize().t()
    assert (got.double() - ref).abs().max().item() <= _tol(torch.bfloat16, ref)
    assert max(_buffers(code[0])) <= N


# ---- tinygemm ----------------------------------------------------------------------------------------------------
def test_tinygemm_bytes_are_torch_cuda_order() -> None:
    """Byte i: column 2i in the high nibble, 2i + 1 in the low one (torch's int4mm.cu, _convert_weight_to_int4pack)."""
    codes = torch.randint(0, 16, (8, 128), generator=torch.Generator().manual_seed(3))
    got = quant_cuda.tinygemm_bytes(codes)
    assert got.dtype == torch.uint8 and got.shape == (8, 64)
    for n in range(8):
        for i in range(64):
            assert int(got[n, i]) == int(codes[n, 2 * i]) * 16 + int(codes[n, 2 * i + 1])


def test_tinygemm_scales_layout() -> None:
    qw = _weight(Scheme(4, 64), torch.bfloat16)
    sz = quant_cuda.tinygemm_scales(qw.scales)
    assert sz.shape == (K // 64, N, 2) and sz.is_contiguous()
    assert torch.equal(sz[5, 17], qw.scales[17, 5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_tinygemm_kernel_matches_float64(group: int, dtype: torch.dtype) -> None:
    """The operands through torch's int4pack product (its CPU counterpart here): the scales_and_zeros layout and
    the (q - 8) * s + z convention are the stored format's; up to TINYGEMM_ROWS rows, eager and compiled alike."""
    qw = _weight(Scheme(4, group), dtype)
    qw.use_int4_kernel("tinygemm")
    assert qw.tinygemm_on == "cpu"
    for rows in (1, 4, quant_cuda.TINYGEMM_ROWS, quant_cuda.TINYGEMM_ROWS + 1):  # the last: dequantized + GEMM
        x = torch.randn(rows, K, dtype=dtype)
        ref = x.double() @ qw.dequantize().t()
        got = qw.matmul(x)
        assert (got.double() - ref).abs().max().item() <= 2 * _tol(dtype, ref)
    x = torch.randn(1, K, dtype=dtype)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(qw.matmul, fullgraph=True)(x), qw.matmul(x))  # one extern op either way


def _model(vocab_size: int = 128) -> Llama:
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2)
    torch.manual_seed(0)
    return Llama(cfg, dtype=torch.bfloat16).requires_grad_(False)


def test_use_int4_kernel_prepares_and_drops_operands() -> None:
    model = quant.quantize_model(_model(), "int4")
    state = set(model.state_dict())
    nbytes = quant.weight_bytes(model)
    read = quant.read_bytes(model)
    quant.use_int4_kernel(model, "tinygemm")
    weights = [m for m in model.modules() if isinstance(m, QuantWeight)]
    assert weights and all(w.tinygemm_on == "cpu" for w in weights)
    # Not saved, not counted: a step reads them in place of the stored bytes, as many of them.
    assert set(model.state_dict()) == state and quant.weight_bytes(model) == nbytes and quant.read_bytes(model) == read
    quant.use_int4_kernel(model, "reduce")
    assert all(w.tinygemm_on is None and not hasattr(w, "tinygemm_weight") for w in weights)


def test_use_int4_kernel_refusals_name_the_value() -> None:
    with pytest.raises(ValueError, match="'fast'"):
        quant.use_int4_kernel(quant.quantize_model(_model(), "int4"), "fast")
    with pytest.raises(ValueError, match="int8"):
        quant.use_int4_kernel(quant.quantize_model(_model(), "int8"), "tinygemm")
    with pytest.raises(ValueError, match="float"):
        quant.use_int4_kernel(_model(), "reduce")
    # A head of 100 rows: tinygemm takes multiples of 8; refused naming the layer, nothing prepared anywhere.
    model = quant.quantize_model(_model(vocab_size=100), "int4")
    with pytest.raises(ValueError, match=r"^lm_head: .*multiple of 8 rows, got 100"):
        quant.use_int4_kernel(model, "tinygemm")
    assert all(m.tinygemm_on is None for m in model.modules() if isinstance(m, QuantWeight))


def test_tinygemm_refusals() -> None:
    cuda = torch.device("cuda")
    assert "bfloat16" in quant_cuda.tinygemm_refusal(cuda, torch.float32, 64, 64)
    assert quant_cuda.tinygemm_refusal(cuda, torch.bfloat16, 64, 128) is None
    assert "meta" in quant_cuda.tinygemm_refusal(torch.device("meta"), torch.bfloat16, 64, 64)
    assert quant_cuda.inner_k_tiles(4096) == 8 and quant_cuda.inner_k_tiles(64 * 3) == 4


def test_quantize_model_refuses_other_devices() -> None:
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2)
    with pytest.raises(ValueError, match="runs on the CPU or CUDA, the model is on meta"):
        quant.quantize_model(Llama(cfg, device="meta"), "int8")


# ---- on a GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec, kernel", [("int8", None), ("int4", "reduce"), ("int4", "tinygemm")])
def test_cuda_model_decodes_compiled_with_eager_tokens(spec: str, kernel: str | None) -> None:
    from static_decode import Generator

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2)
    torch.manual_seed(0)
    model = quant.quantize_model(Llama(cfg, dtype=torch.bfloat16, device="cuda").requires_grad_(False), spec)
    if kernel is not None:
        quant.use_int4_kernel(model, kernel)
    prompt = list(range(1, 9))
    eager = Generator(model, max_len=64, batch=1, eos_token_ids=[]).generate(prompt, 16, stop_at_eos=False)
    compiled = Generator(model, max_len=64, batch=1, eos_token_ids=[], compile=True).generate(
        prompt, 16, stop_at_eos=False)
    assert compiled == eager
