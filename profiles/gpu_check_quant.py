"""The `quant` phase of profiles/gpu_check.py: int8, int4 and GGUF-block weights on the shape's model (random bf16
weights, quantized on the device: every projection and the head), beside the bf16 model.

In this order, each part while the phase's budget leaves time for it:

1. products: one row by every weight a decode step reads (each layer's projections and the head; the embedding
   is a lookup), back to back in one CUDA graph, per form: bf16 (cuBLAS), int8, GGUF Q4_K blocks (the tensor
   code's reduction, compiled) and int4-g32 through each int4 product ("reduce", "tinygemm"); ms, GB/s and the
   fraction of the copy rate. Before timing a quantized form,
   `correct` / quant_matmul rows: two of layer 0's products (one row compiled, 4 rows eager) against float64 by
   the dequantized weight.
2. whole steps (SETTINGS): the model quantized, its decode step compiled as the generator captures it, timed at
   the first live length (1k on the device) over graph replays: rows `quant` (seconds to quantize and capture,
   the bytes a step reads, ms, tokens/s, the fraction of the copy rate: weight + KV bytes / time / copy rate) and
   `correct` / greedy_<setting> (32 greedy tokens against eager's). int4 goes first, through the product part 1
   found faster; the other int4 product last. Only the decode step is compiled: the prompt and the first token
   run eagerly on both sides of the comparison (what it checks is the decode step; compiling the 32-layer model
   for two more kinds would not fit the budget).

gpu_check.summarize sets tokens/s against the bf16 row of the `model` phase at the same live length.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from gpu_check_common import Timer, error_text, kv_bytes, time_decode
from gpu_check_ctx import GREEDY_TOKENS, PROMPT, Ctx, _model, _replayed, greedy_row, sync
from torch import nn

from capture import BucketLadder, CaptureOptions
from capture import _dynamo_counters as dc
from static_decode import Generator
from static_decode.model import gguf_quant, quant, quant_cuda
from static_decode.model.gguf_quant import BlockLinear, BlockWeight
from static_decode.model.quant import QuantLinear, QuantWeight
from static_decode.steps.functions import STEPS

STEP_KIND = "decode_greedy"
INT4 = "int4-g32"  # the default int4 scheme (groups of 32)
SETTING_S = 100  # a whole-step setting starts only with this much of the phase left (a 32-layer compile, timing)
PRODUCTS_S = 30  # the product timings start only with this much left
MATMUL_WEIGHTS = ("layers.0.mlp.down_proj", "layers.0.mlp.gate_up_proj")  # the longest K; the widest layer N


@dataclass(frozen=True)
class Setting:
    name: str
    scheme: str  # static_decode.model.quant.parse's name
    kernel: str | None = None  # int4: one of static_decode.model.quant_cuda.INT4_KERNELS


def gguf_kind(dry: bool) -> str:
    """The GGUF block type the phase runs: Q4_K (what Q4_K_M files hold most), Q8_0 on the dry run's shape (its
    64-wide rows are no multiple of Q4_K's 256)."""
    return "q8_0" if dry else "q4_k"


def settings(faster_int4: str, dry: bool = False) -> list[Setting]:
    """The whole-step settings in the order they run: int4 through the faster product, int8, GGUF blocks (the tensor
    code a CUDA step compiles: static_decode.model.gguf_dequant), the other int4 product."""
    other = next(k for k in quant_cuda.INT4_KERNELS if k != faster_int4)
    return [Setting(f"{INT4}-{faster_int4}", INT4, faster_int4), Setting("int8", "int8"),
            Setting(f"gguf-{gguf_kind(dry)}", gguf_kind(dry)), Setting(f"{INT4}-{other}", INT4, other)]


def phase_quant(ctx: Ctx) -> None:
    dc.raise_recompile_limit(64)  # a graph per weight shape of each compiled product
    faster = products(ctx)
    for s in settings(faster, ctx.dry):
        if ctx.left() < (20 if ctx.dry else SETTING_S):
            ctx.rows.add("quant", setting=s.name, skipped="no time left in the phase's budget")
            continue
        try:
            whole_step(ctx, s)
        except Exception as e:  # noqa: BLE001 - a failing setting is a row; the next one still runs
            ctx.rows.add("quant", setting=s.name, error=error_text(e))
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


# ---- 1. the products alone ----------------------------------------------------------------------------------------
def products(ctx: Ctx) -> str:
    """Times every form's products (rows `products`); returns the faster int4 product (the default when not both
    were timed)."""
    sh, d = ctx.sh, ctx.device
    ms: dict[str, float] = {}
    if ctx.left() < (10 if ctx.dry else PRODUCTS_S):
        ctx.rows.add("products", form="all", skipped="no time left in the phase's budget")
        return quant_cuda.DEFAULT_INT4_KERNEL
    copy_gbps, timer = ctx.copy_gbps(), Timer(d)
    model = _model(sh.config, sh, d)
    float_form = "bf16" if sh.dtype == torch.bfloat16 else str(sh.dtype).removeprefix("torch.")
    blocks = f"gguf-{gguf_kind(ctx.dry)}"
    for form in (float_form, "int8", blocks, f"{INT4}-reduce", f"{INT4}-tinygemm"):
        if ctx.left() < (5 if ctx.dry else 15):
            ctx.rows.add("products", form=form, skipped="no time left in the phase's budget")
            continue
        try:
            if form in ("int8", blocks):
                m = quant.quantize_model(copy.deepcopy(model), form.removeprefix("gguf-"))
            elif form == f"{INT4}-reduce":
                m = quant.quantize_model(model, INT4)  # in place: the float weights go
            elif form == f"{INT4}-tinygemm":
                m = quant.use_int4_kernel(model, "tinygemm")
            else:
                m = model
            if form != float_form:
                matmul_rows(ctx, m, form)
            fn, nbytes = _products_fn(m, ctx.dry)
            seconds = _replayed(fn, d, timer, reps=3 if ctx.dry else 20)
            ms[form] = seconds * 1e3
            gbps = nbytes / seconds / 1e9
            ctx.rows.add("products", form=form, weights=len(_weights(m)), bytes=nbytes, ms=round(seconds * 1e3, 4),
                         gbps=round(gbps, 1), copy_fraction=round(gbps / copy_gbps, 3))
            del m, fn
        except Exception as e:  # noqa: BLE001
            ctx.rows.add("products", form=form, error=error_text(e))
    timed = {k: ms.get(f"{INT4}-{k}") for k in quant_cuda.INT4_KERNELS}
    if any(v is None for v in timed.values()):
        return quant_cuda.DEFAULT_INT4_KERNEL
    return min(timed, key=timed.get)


def _weights(model: nn.Module) -> list[torch.Tensor | QuantWeight]:
    """Every weight a decode step multiplies by (float nn.Linear weights or QuantWeights), the head included."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear | QuantLinear | BlockLinear)]


def _products_fn(model: nn.Module, dry: bool) -> tuple[Callable[[], None], int]:
    """A call that multiplies one row by every weight in turn, as a decode step's projections do (float: F.linear;
    int8 / int4 reduce: the product compiled, one graph per weight shape; tinygemm: its op), and the bytes it
    reads."""
    weights = _weights(model)
    xs = {K: torch.randn(1, K, device=weights[0].device).to(weights[0].dtype) for K in {w.shape[1] for w in weights}}
    compile_ = lambda f: torch.compile(f, fullgraph=True, dynamic=False, backend="eager" if dry else "inductor")  # noqa: E731
    int8, int4 = compile_(quant_cuda.int8_matmul), compile_(quant_cuda.int4_row)
    gguf = compile_(gguf_quant.row_product)
    calls: list[Callable[[], torch.Tensor]] = []
    nbytes = 0
    for w in weights:
        x = xs[w.shape[1]]
        if isinstance(w, BlockWeight):  # the one-row reduction over the dequantized blocks, compiled
            calls.append(lambda x=x, w=w: gguf(x, w.blocks, w.scheme.name))
            nbytes += w.nbytes
            continue
        if not isinstance(w, QuantWeight):
            calls.append(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            nbytes += w.nbytes
            continue
        nbytes += w.nbytes  # the stored bytes; tinygemm's operands are as many
        if w.scheme.bits == 8:
            calls.append(lambda x=x, w=w: int8(x, w.qweight, w.scales))
        elif w.tinygemm_on is not None:
            calls.append(lambda x=x, w=w: quant_cuda.tinygemm_matmul(x, w.tinygemm_weight, w.tinygemm_scales,
                                                                     w.scheme.group))
        else:
            calls.append(lambda x=x, w=w: int4(x, w.qweight, w.scales, w.scheme.group))

    def run() -> None:
        for c in calls:
            c()

    return run, nbytes


def matmul_rows(ctx: Ctx, model: nn.Module, form: str) -> None:
    """Each of MATMUL_WEIGHTS' products (`QuantWeight.matmul`) against float64 by its dequantized weight: one row
    compiled (as the decode step runs it), 4 rows eagerly. Tolerance: the output's rounding to the model's dtype
    (bfloat16: 2^-8 relative) twice over, of the reference's largest value; float32 accumulation adds far less."""
    modules = dict(model.named_modules())
    gen = torch.Generator(device=ctx.device).manual_seed(2)
    for name in MATMUL_WEIGHTS:
        qw = modules[name].weight
        N, K = qw.shape
        for rows, compiled in ((1, True), (4, False)):
            row = {"check": "quant_matmul", "setting": form, "weight": name, "rows": rows, "compiled": compiled}
            try:
                x = torch.randn(rows, K, generator=gen, device=ctx.device).to(qw.dtype)  # [M, K]
                want = x.double() @ qw.dequantize(torch.float64).t()  # [M, N]
                fn = qw.matmul
                if compiled:
                    fn = torch.compile(qw.matmul, fullgraph=True, dynamic=False,
                                       backend="eager" if ctx.dry else "inductor")
                got = fn(x)
                err = float((got.double() - want).abs().max()) / float(want.abs().max())
                tol = 2.0 ** -7 if qw.dtype == torch.bfloat16 else 1e-5
                ctx.rows.add("correct", **row, rel_err=err, ok=err <= tol and got.shape == (rows, N))
                del want
            except Exception as e:  # noqa: BLE001
                ctx.rows.add("correct", **row, ok=False, error=error_text(e))


# ---- 2. whole steps ------------------------------------------------------------------------------------------------
def whole_step(ctx: Ctx, s: Setting) -> None:
    """The setting's model, its decode step captured and timed at the first live length; greedy tokens."""
    sh, d = ctx.sh, ctx.device
    live = sh.lengths[0]
    max_len = sh.max_len if ctx.dry else 2048  # the 1k row reads rung 2048 of the CUDA ladder: no more cache
    ladder = BucketLadder.cuda(max_len) if not ctx.dry else BucketLadder.geometric(max_len, align=16)
    rungs = {ladder.bucket_for(PROMPT + GREEDY_TOKENS + 1), ladder.bucket_for(live + ctx.steps), max_len}
    t0 = time.perf_counter()
    model = quant.quantize_model(_model(sh.config, sh, d), s.scheme)
    if s.kernel is not None:
        quant.use_int4_kernel(model, s.kernel)
    sync(d)
    quantize_s = time.perf_counter() - t0
    opts = CaptureOptions(buckets=BucketLadder(tuple(sorted(rungs))), settings=ctx.settings(), kinds=(STEP_KIND,),
                          progress=False)
    t0 = time.perf_counter()
    gen = Generator(model, max_len=max_len, batch=1, compile=True, eos_token_ids=[], capture=opts)
    capture_s = time.perf_counter() - t0
    read_len = gen.read_len(live + ctx.steps)
    seconds = time_decode(gen, live, ctx.steps, read_len, Timer(d))
    weights = quant.read_bytes(model)
    gbps = (weights + kv_bytes(sh.config, live + ctx.steps // 2, sh.dtype)) / seconds / 1e9
    ctx.rows.add("quant", setting=s.name, scheme=s.scheme, kernel=s.kernel, layers=sh.config.num_layers, live=live,
                 read_len=read_len, quantize_s=round(quantize_s, 1), capture_s=round(capture_s, 1),
                 weight_bytes=weights, ms=round(seconds * 1e3, 4), tokens_per_s=round(1 / seconds, 1),
                 gbps=round(gbps, 1), copy_fraction=round(gbps / ctx.copy_gbps(), 3))
    compiled_decode_only(gen)
    greedy_row(ctx, model, gen, f"greedy_{s.name}")
    gen.runner.close()


def compiled_decode_only(gen: Generator) -> None:
    """The generator's prompt and first-token steps run eagerly from now on; only the decode step stays compiled
    (the other kinds were never captured: they would compile the whole model again)."""
    compiled = gen.step_fn
    gen.step_fn = lambda kind, read_len: compiled(kind, read_len) if kind == STEP_KIND else STEPS[kind]
