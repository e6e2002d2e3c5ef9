"""Weight-only quantization (static_decode.model.quant): the formats, their products, and quantized models.

Pins:
* the stored formats decode to exactly what a plain reference quantizer (written here, group by group) gives:
  int8 per channel, int4 grouped with its range search; so the int4 packing round-trips;
* the products (our one-row kernel, the dequantized GEMM for chunks) agree with a float64 product by the
  dequantized weight, one row and a chunk, float32 and bfloat16;
* a quantized model's logits agree with a float64 model built from the dequantized weights; the tied head is
  quantized too, the embedding is not; `weight_bytes` counts the quantized bytes;
* a quantized model decodes compiled (through the fused decode layers) with eager's greedy tokens;
* what the path does not take is refused in one line naming it.
"""

from __future__ import annotations

import pytest
import torch

from static_decode.model import quant
from static_decode.model.quant import QuantWeight, Scheme

SCHEMES = [Scheme(8), Scheme(4, 32), Scheme(4, 64), Scheme(4, 128)]


def _ref_int8(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows = []
    for row in w.float():
        s = (row.abs().max() / 127).to(dtype).float()
        q = [min(127.0, max(-128.0, float(torch.round(v / s)))) for v in row]
        rows.append(torch.tensor(q, dtype=torch.float64) * s.double())
    return torch.stack(rows)


def _ref_int4(w: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Group by group: each shrink of the min/max range, rounded scale and offset, codes, the least squared error
    (the first on a tie), w' = (q - 8) * s + z."""
    N, K = w.shape
    out = torch.empty(N, K, dtype=torch.float64)
    for n in range(N):
        for g0 in range(0, K, group):
            x = w[n, g0:g0 + group].float()
            best = None
            for shrink in quant.INT4_SHRINK:
                lo, hi = x.min() * shrink, x.max() * shrink
                s = ((hi - lo) / 15).clamp(min=1e-12).to(dtype).float()
                z = (lo + 8 * s).to(dtype).float()
                q = torch.round((x - z) / s + 8).clamp(0, 15)
                err = float(((q - 8) * s + z - x).double().pow(2).sum())
                if best is None or err < best[0]:
                    best = (err, (q.double() - 8) * s.double() + z.double())
            out[n, g0:g0 + group] = best[1]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_formats_decode_to_the_reference_quantizer(scheme, dtype):
    torch.manual_seed(0)
    w = torch.randn(48, 256, dtype=dtype) * torch.linspace(0.01, 3, 256).to(dtype)  # groups of varied ranges
    w[3, 7] = 40.0  # an outlier: the range search clips or keeps it group by group
    qw = QuantWeight(w, scheme)
    ref = _ref_int8(w, dtype) if scheme.bits == 8 else _ref_int4(w, scheme.group, dtype)
    assert torch.equal(qw.dequantize(), ref)
    # What the stored layout holds (bytes): int8 codes + a scale per row; int4 half a byte + a scale and a zero
    # per group.
    per = 2 if dtype == torch.bfloat16 else 4
    want = 48 * 256 + 48 * per if scheme.bits == 8 else 48 * 128 + 48 * (256 // scheme.group) * 2 * per
    assert qw.nbytes == want


def test_int4_packing_puts_two_runs_of_32_columns_in_each_chunk():
    """`pack_int4`: in each chunk of 64 columns byte j holds column j (low nibble) and column j + 32 (high); and
    `unpack_int4` gives the codes back."""
    q = torch.randint(0, 16, (5, 128), dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    packed = quant.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 64)
    for c in range(2):
        for j in (0, 17, 31):
            assert int(packed[3, 32 * c + j]) == int(q[3, 64 * c + j]) | int(q[3, 64 * c + 32 + j]) << 4
    assert torch.equal(quant.unpack_int4(packed).to(torch.int32), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_products_match_float64_by_the_dequantized_weight(scheme, dtype, rows):
    torch.manual_seed(1)
    w = torch.randn(80, 384, dtype=dtype)
    qw = QuantWeight(w, scheme)
    x = torch.randn(2, rows, 384, dtype=dtype)
    ref = x.double() @ qw.dequantize().t()  # [2, rows, 80]
    got = qw.matmul(x)
    assert got.shape == (2, rows, 80) and got.dtype == dtype
    # float32: accumulation order only; bfloat16: the output's rounding (2^-8 relative) on top.
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7 * ref.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= tol


def test_quantization_error_is_bounded():
    """Sanity of the formats themselves: int8 within half a step of the weight, int4 within a step."""
    torch.manual_seed(2)
    w = torch.randn(64, 256)
    q8 = QuantWeight(w, Scheme(8))
    step = w.abs().amax(1, keepdim=True).double() / 127
    assert ((q8.dequantize() - w.double()).abs() <= step / 2 + 1e-6).all()
    err = [(QuantWeight(w, Scheme(4, g)).dequantize() - w.double()).pow(2).mean().item() for g in (32, 64, 128)]
    assert err[0] < err[1] < err[2] < 0.01


@pytest.mark.parametrize(
    "spec, want",
    [("int8", Scheme(8)), ("int4", Scheme(4, quant.DEFAULT_INT4_GROUP)), ("INT4-g64", Scheme(4, 64)),
     ("int4-g128", Scheme(4, 128)), ("none", None), (None, None)],
)
def test_parse(spec, want):
    assert quant.parse(spec) == want


@pytest.mark.parametrize("spec", ["int3", "int4-g16", "int8-g32", "fp8"])
def test_parse_refuses_naming_the_value(spec):
    with pytest.raises(ValueError, match=spec):
        quant.parse(spec)


def test_group_that_does_not_divide_is_refused_naming_the_layer():
    from static_decode import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=192, num_layers=1, num_heads=4, num_kv_heads=2)
    model = Llama(cfg)
    with pytest.raises(ValueError, match=r"^lm_head: int4 takes a weight whose 96 inputs are a multiple of 64 and of "
                                         r"the group 64; use int8$"):
        quant.quantize_model(model, "int4-g64")
    assert not any(isinstance(m, quant.QuantLinear) for m in model.modules())  # refused before any change
    with pytest.raises(ValueError, match="float16"):
        quant.quantize_model(Llama(cfg, dtype=torch.float16), "int8")


def _reference(model, qmodel):
    """A float64 model whose every quantized weight is the dequantized one (the head untied, holding the
    quantized head's weight; the embedding the float model's)."""
    import dataclasses

    from static_decode import Llama

    cfg = dataclasses.replace(qmodel.config, tie_word_embeddings=False)
    ref = Llama(cfg, dtype=torch.float64)
    state = {k: v.double() for k, v in model.state_dict().items() if k in ref.state_dict()}
    ref.load_state_dict(state, strict=False)
    ref_modules = dict(ref.named_modules())
    for name, m in qmodel.named_modules():
        if isinstance(m, quant.QuantLinear):
            ref_modules[name].weight.data.copy_(m.weight.dequantize())
    return ref.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["int8", "int4-g32", "int4-g128"])
def test_quantized_logits_match_a_float64_dequantized_reference(spec, dtype):
    """Chunked prefill (offset mask and cache on the path) of two ragged rows. Tolerance: float32 1e-3 of the
    logits' range (accumulation order); bfloat16 3e-2 (activations rounded to 8 bits at every layer)."""
    from static_decode import load_model
    from static_decode.checkpoints.loading import default_model_path
    from tests.support.checkpoints import feed

    model = load_model(default_model_path(), dtype=dtype)
    qmodel = quant.quantize_model(load_model(default_model_path(), dtype=dtype), spec)
    assert isinstance(qmodel.lm_head, quant.QuantLinear) and qmodel.embed_tokens.weight.dtype == dtype  # tied head
    ref = _reference(model, qmodel)
    rows = [list(range(3, 40)), [7, 1, 99, 4]]
    got, want = feed(qmodel, rows, 8), feed(ref, rows, 8)
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item()
        err = (g.double() - w).abs().max().item()
        assert err <= (1e-3 if dtype == torch.float32 else 3e-2) * scale, (err, scale)


def test_weight_bytes_count_the_quantized_weights():
    """int8: a byte per weight and a scale per output row; the tied head gets its own copy, the embedding stays."""
    from static_decode import load_model
    from static_decode.checkpoints.loading import default_model_path

    model = load_model(default_model_path(), dtype=torch.bfloat16)
    c = model.config
    embed = c.vocab_size * c.hidden_size * 2
    norms = sum(p.nbytes for n, p in model.named_parameters() if "norm" in n)
    linears = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and "norm" not in n)
    rows = sum(p.shape[0] for n, p in model.named_parameters() if n.startswith("layers.") and "norm" not in n)
    assert quant.weight_bytes(model) == embed + norms + linears * 2  # the tied head is the embedding: once
    quant.quantize_model(model, "int8")
    head = c.vocab_size * c.hidden_size + c.vocab_size * 2
    assert quant.weight_bytes(model) == embed + norms + linears + rows * 2 + head
    from static_decode.generation import memory

    assert memory.weight_bytes(model) == quant.weight_bytes(model)
    assert memory.read_bytes(model) == quant.read_bytes(model) == quant.weight_bytes(model) - embed + c.hidden_size * 2


@pytest.mark.parametrize("spec", ["int8", "int4"])
def test_compiled_generator_decodes_quantized_through_the_fused_layers(spec):
    """The CPU default (layer regions, fused decode on): one-token steps run the fused layers over the quantized
    projections, prefill chunks the compiled regions, and greedy tokens equal eager's."""
    from capture import CaptureOptions
    from static_decode import Generator, load_model
    from static_decode.checkpoints.loading import default_model_path
    from static_decode.steps.functions import GREEDY_KINDS

    torch._dynamo.reset()
    model = quant.quantize_model(load_model(default_model_path()), spec)
    eager = Generator(model, max_len=64, chunk_size=16, batch=1)
    gen = Generator(model, max_len=64, chunk_size=16, batch=1, compile=True,
                    capture=CaptureOptions(buckets=(64,), kinds=GREEDY_KINDS, progress=False))
    from static_decode.kernels import cpu_kernel

    assert (gen.runner.regions.fused is not None) == cpu_kernel.available(), gen.runner.regions.fused_why
    for prompt in ([5, 9, 2, 7, 7, 1, 3], list(range(1, 30))):
        assert gen.generate(prompt, 16, stop_at_eos=False) == eager.generate(prompt, 16, stop_at_eos=False)
    gen.runner.close()
    torch._dynamo.reset()


def test_compiled_generator_decodes_quantized_with_eager_tokens():
    """Projections in two formats (layers 0-1 int8, 2-3 and the head int4) keep the fused layers off (their reason
    recorded): the compiled regions run both products, and greedy tokens equal eager's."""
    from capture import CaptureOptions
    from static_decode import Generator, load_model
    from static_decode.checkpoints.loading import default_model_path
    from static_decode.steps.functions import GREEDY_KINDS

    torch._dynamo.reset()
    model = quant.quantize_model(load_model(default_model_path()), "int8")
    floats = load_model(default_model_path())
    int4 = Scheme(4, 32)
    for i in (2, 3):
        for parent in ("self_attn", "mlp"):
            for name, lin in floats.layers[i].get_submodule(parent).named_children():
                if isinstance(lin, torch.nn.Linear):
                    setattr(model.layers[i].get_submodule(parent), name, quant.QuantLinear(lin.weight, None, int4))
    model.lm_head = quant.QuantLinear(floats.embed_tokens.weight, None, int4)
    eager = Generator(model, max_len=64, chunk_size=16, batch=1)
    gen = Generator(model, max_len=64, chunk_size=16, batch=1, compile=True,
                    capture=CaptureOptions(buckets=(64,), kinds=GREEDY_KINDS, progress=False))
    assert gen.runner.regions.fused is None
    assert gen.runner.regions.fused_why.startswith("projections in several formats (int4-g32, int8)")
    for prompt in ([5, 9, 2, 7, 7, 1, 3], list(range(1, 30))):
        assert gen.generate(prompt, 16, stop_at_eos=False) == eager.generate(prompt, 16, stop_at_eos=False)
    gen.runner.close()
    torch._dynamo.reset()


def test_read_bytes_count_what_a_decode_step_reads():
    """A tied float model's head is the embedding (read whole); quantized, the head reads its own copy and the
    embedding is one looked-up row a step: the bench's bytes floor counts that."""
    from static_decode import load_model
    from static_decode.checkpoints.loading import default_model_path

    model = load_model(default_model_path())
    assert quant.read_bytes(model) == quant.weight_bytes(model)
    quant.quantize_model(model, "int4")
    embed = model.embed_tokens.weight
    assert quant.read_bytes(model) == quant.weight_bytes(model) - embed.nbytes + embed[0].nbytes


def test_commands_take_quantize_and_refuse_what_it_does_not_run(capsys):
    """generate (and so demo), with the refusal of a model dtype the products do not take in one line."""
    from static_decode.commands import cli

    argv = ["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--temperature", "0", "-t", "1"]
    assert cli.main([*argv, "--quantize", "int4"]) == 0
    assert cli.main([*argv, "--quantize", "int8", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "static-decode generate: error: --quantize int8 takes a float32 or bfloat16 model, not torch.float16"
    for command in ("chat", "capture-report", "bench", "demo", "perplexity"):
        help_text = cli.build_parser().parse_args([command, "--quantize", "int8"])
        assert help_text.quantize == "int8"


def _tp_results(ckpt, tp, spec):
    from static_decode import Generator, load_model
    from tests.support import tp_worker

    model = load_model(ckpt, tp=tp, quantize=spec)
    with torch.no_grad():
        cache = model.new_cache(2, tp_worker.MAX_LEN)
        logits = [model(torch.tensor(t), cache, n) for t, n in tp_worker.FORWARD_CHUNKS]
    gen = Generator(model, max_len=tp_worker.MAX_LEN, chunk_size=tp_worker.CHUNK, eos_token_ids=[])
    return {"logits": logits, "tokens": gen.generate(tp_worker.PROMPTS, tp_worker.NEW_TOKENS)}


def _tp_rank(rank, world, port, ckpt, dest):
    import torch.distributed as dist

    from static_decode.model.parallel import TensorParallel, open_group

    torch.set_num_threads(1)
    open_group("gloo", rank, world, f"tcp://127.0.0.1:{port}")
    try:
        torch.save({spec: _tp_results(ckpt, TensorParallel(rank, world), spec) for spec in ("int8", "int4")},
                   dest / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_one_process(tmp_path):
    """Each rank quantizes its own slices: int4 groups are whole within a slice, int8's row-parallel scales are
    the whole rows' (a max over the ranks at load), so the shards' all-reduced logits are the single process's
    (to float32 summation order) and the greedy tokens equal."""
    import torch.multiprocessing as mp

    from static_decode.model.parallel import SINGLE
    from tests.support import tp_worker
    from tests.support.checkpoints import hf_llama, save

    # hidden 128: a rank's row-parallel slices keep 64 inputs, what int4's packed chunks take
    ckpt = save(hf_llama(seed=7, kv_heads=4, bias=True, hidden=128), tmp_path / "ckpt")
    mp.spawn(_tp_rank, args=(2, tp_worker.free_port(), ckpt, tmp_path), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for spec in ("int8", "int4"):
        single = _tp_results(ckpt, SINGLE, spec)
        for got in ranks:
            assert got[spec]["tokens"] == single["tokens"], spec
            for a, b in zip(got[spec]["logits"], single["logits"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
