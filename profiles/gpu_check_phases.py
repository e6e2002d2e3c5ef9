"""The phases of profiles/gpu_check.py. Each runs in a process of its own under its own time budget and appends
its rows (gpu_check_common.Rows) the moment they are measured; the driver builds the summary from the rows.

Adding a phase: a function `phase_x(ctx)` and an entry in PHASES (name, budget on the device, function). Adding a
decode setting to compare: an entry in VARIANTS (its `prepare` gets the model). Quantized weights have a phase of
their own (`quant`, profiles/gpu_check_quant.py).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from gpu_check_common import (
    LLAMA_8B,
    Timer,
    copy_bandwidth,
    error_text,
    kv_bytes,
    time_decode,
    weight_bytes_per_token,
)
from gpu_check_ctx import Ctx, _model, _replayed, greedy_row, sync
from gpu_check_quant import phase_quant  # int8 / int4 weights beside the bf16 row

from capture import BucketLadder, CaptureOptions
from capture import _dynamo_counters as dc
from static_decode import Generator, Llama
from static_decode.core import attention as attn
from static_decode.core import masks
from static_decode.steps.functions import GREEDY_KINDS


# ---- env -------------------------------------------------------------------------------------------------------
def phase_env(ctx: Ctx) -> None:
    d = ctx.device
    info: dict[str, Any] = {"torch": torch.__version__, "device": "cpu", "cuda": torch.version.cuda}
    if d.type == "cuda":
        p = torch.cuda.get_device_properties(d)
        info.update(device=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    ctx.rows.add("env", **info)
    nbytes = 1 << 20 if ctx.dry else 2 << 30
    gbps = copy_bandwidth(d, nbytes, Timer(d), reps=3 if ctx.dry else 20) / 1e9
    ctx.rows.add("copy", gbps=round(gbps, 1), bytes=nbytes)


# ---- attention: correctness against float64, and timing alone -------------------------------------------------
def formulations(device: torch.device) -> list[tuple[str, bool]]:
    """(formulation, compiled) pairs to check and time: on CUDA the key-splitting ones compiled (flex exists only
    compiled) and eager, and the one-call SDPA; on the CPU each eagerly (flex's eager reference)."""
    if device.type == "cuda":
        return [("flex", True), ("split_key", True), ("split_key", False), ("sdpa_folded", True),
                ("sdpa_folded", False)]
    return [("flex", False), ("split_key", False), ("sdpa_folded", False)]


def _attention_fn(compiled: bool, dry: bool) -> Callable[..., torch.Tensor]:
    if not compiled:
        return attn.grouped_attention
    # One graph per (formulation, shape), all on grouped_attention's code: far more than dynamo's default limit,
    # past which it would run the rest eagerly and time the wrong thing.
    dc.raise_recompile_limit(256)
    return torch.compile(attn.grouped_attention, dynamic=False, fullgraph=True, backend="eager" if dry else "inductor")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, n_new: torch.Tensor):
    """Float64 attention with the offset mask (rule 3), padded slots zero: [B, Hq, T, d]."""
    B, Hq, T, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    visible = masks.chunk_mask(lens, n_new, T, S)  # [B, T, S]
    qf = q.double().view(B, Hkv, G, T, d)
    scores = torch.einsum("bhgtd,bhsd->bhgts", qf, k.double()) / math.sqrt(d)  # [B, Hkv, G, T, S]
    scores = scores.masked_fill(~visible[:, None, None], -math.inf)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked (padded) slot: zeros
    out = torch.einsum("bhgts,bhsd->bhgtd", p, v.double()).reshape(B, Hq, T, d)
    real = (torch.arange(T, device=q.device) < n_new[:, None])[:, None, :, None]  # [B, 1, T, 1]
    return torch.where(real, out, torch.zeros((), dtype=out.dtype, device=out.device))


def phase_correct_attention(ctx: Ctx) -> None:
    """Each formulation against float64 at each live length on a few heads: 2 ragged rows, a decode step and a
    4-slot verify chunk whose second row has a padded slot (a decode step: that row is all padding)."""
    d = ctx.device
    dtype = ctx.sh.dtype
    hkv, g, hd = 2, 4, (16 if ctx.dry else 128)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # of the reference's largest value: bf16 keeps ~3 digits
    gen = torch.Generator(device=d).manual_seed(0)
    for live in ctx.sh.lengths:
        S = (live // 128 + 1) * 128  # the read: whole 128-key blocks, past the live keys (which must stay unseen)
        kv = torch.randn(2, 2, hkv, S + 1, hd, generator=gen, device=d).to(dtype)  # [K/V, B, Hkv, S + spare, d]
        k, v = kv[0, :, :, :S], kv[1, :, :, :S]  # strided like the cache's views
        for T in (1, 4):
            q = (4.0 * torch.randn(2, hkv * g, T, hd, generator=gen, device=d)).to(dtype)  # peaky softmax
            lens = torch.tensor([live, live // 3 + T], device=d)
            n_new = torch.tensor([T, T - 1], device=d)
            want = reference(q, k, v, lens, n_new)
            scale = float(want.abs().max())
            for impl, compiled in formulations(d):
                if ctx.left() < 5:
                    return
                row = {"check": "attention", "impl": impl, "compiled": compiled, "live": live, "slots": T}
                try:
                    got = _attention_fn(compiled, ctx.dry)(q, k, v, lens, n_new, impl=impl)
                    err = float((got.double() - want).abs().max()) / scale
                    padded_zero = bool((got[1, :, T - 1] == 0).all())
                    ctx.rows.add("correct", **row, rel_err=err, padded_zero=padded_zero,
                                 ok=err <= tol and padded_zero and bool(torch.isfinite(got).all()))
                except Exception as e:  # noqa: BLE001 - a failing formulation is a row, not the end of the phase
                    ctx.rows.add("correct", **row, ok=False, error=error_text(e))


def phase_attention(ctx: Ctx) -> None:
    """Decode attention alone over every layer of the shape (batch 1, one query slot; each layer its own K/V, so
    nothing stays in L2), per formulation and live length; on CUDA one graph of every layer, replayed."""
    d, sh = ctx.device, ctx.sh
    c = sh.config
    copy = ctx.copy_gbps()
    timer = Timer(d)
    for impl, compiled in formulations(d):
        for live in sh.lengths:
            if ctx.left() < 10:
                return
            row = {"impl": impl, "compiled": compiled, "live": live}
            try:
                S = min(sh.max_len, (live // 128 + 1) * 128)
                kv = torch.zeros(2, c.num_layers, 1, c.num_kv_heads, S + 1, c.head_dim, dtype=sh.dtype, device=d)
                q = torch.randn(1, c.num_heads, 1, c.head_dim, device=d).to(sh.dtype)
                lens, n_new = torch.tensor([live], device=d), torch.tensor([1], device=d)
                views = [(kv[0, i, :, :, :S], kv[1, i, :, :, :S]) for i in range(c.num_layers)]  # cache-like views
                fn, args = _attention_fn(compiled, ctx.dry), (q, lens, n_new, impl)

                def layers(fn: Callable[..., torch.Tensor] = fn, views: list = views, args: tuple = args) -> None:
                    q, lens, n_new, impl = args
                    for k, v in views:
                        fn(q, k, v, lens, n_new, impl=impl)

                seconds = _replayed(layers, d, timer, reps=3 if ctx.dry else 20)
                nbytes = kv_bytes(c, live, sh.dtype)
                ctx.rows.add("attention", **row, ms=round(seconds * 1e3, 4), gbps=round(nbytes / seconds / 1e9, 1),
                             fraction=round(nbytes / seconds / 1e9 / copy, 3))
                del kv, views, layers
            except Exception as e:  # noqa: BLE001
                ctx.rows.add("attention", **row, error=error_text(e))


# ---- the whole model: capture cold / warm, decode, greedy tokens ----------------------------------------------
def _capture_rows(ctx: Ctx, gen: Generator, process: str, setting: str = "default", seen: int = 0) -> int:
    records = gen.capture_records
    for r in records[seen:]:
        ctx.rows.add("capture", process=process, setting=setting, step=r.kind, read_len=r.read_len,
                     seconds=round(r.seconds, 2), graphs=r.graphs, pool_bytes=r.pool_bytes,
                     cudagraph_skips=r.cudagraph_skips, recompiles=r.recompiles, fallback=r.fallback)
    registry = getattr(gen.runner, "registry", None)
    per_kind = getattr(registry, "formulation_fallbacks", {})
    failed = {impl: why for kinds in per_kind.values() for impl, why in kinds.items()}
    ctx.rows.add("formulations_failed", failed=failed, per_kind=per_kind)
    return len(records)


def phase_model(ctx: Ctx, process: str = "cold") -> None:
    """The shape's model (random weights): greedy kinds captured on a fresh compile cache (cold) or the one the
    cold process filled (warm); cold also times decode at each live length and compares 32 greedy tokens."""
    sh, d = ctx.sh, ctx.device
    t0 = time.perf_counter()
    model = _model(sh.config, sh, d)
    sync(d)
    ctx.rows.add("model", process=process, layers=sh.config.num_layers, weight_bytes=weight_bytes_per_token(model),
                 init_s=round(time.perf_counter() - t0, 1))
    kinds = ("decode_greedy",) if process == "cold" else GREEDY_KINDS  # cold: decode first, timed before the rest
    opts = CaptureOptions(settings=ctx.settings(), kinds=kinds, compile_cache=ctx.cache_dir, progress=False)
    gen = Generator(model, max_len=sh.max_len, batch=1, compile=True, eos_token_ids=[], capture=opts)
    seen = _capture_rows(ctx, gen, process)
    if process != "cold":
        return
    copy, timer = ctx.copy_gbps(), Timer(d)
    for live in sh.lengths:
        read_len = gen.read_len(live + ctx.steps)
        s = time_decode(gen, live, ctx.steps, read_len, timer)
        nbytes = weight_bytes_per_token(model) + kv_bytes(sh.config, live + ctx.steps // 2, sh.dtype)
        ctx.rows.add("decode", setting="default", layers=sh.config.num_layers, live=live, read_len=read_len,
                     ms=round(s * 1e3, 4), gbps=round(nbytes / s / 1e9, 1),
                     copy_fraction=round(nbytes / s / 1e9 / copy, 3))
    gen.warm_up(("prefill", "first_greedy"), progress=False)
    _capture_rows(ctx, gen, process, seen=seen)
    greedy_row(ctx, model, gen, "greedy_model")


def phase_model_warm(ctx: Ctx) -> None:
    phase_model(ctx, "warm")


def phase_embedded(ctx: Ctx) -> None:
    """The embedded default model: compiled greedy tokens equal eager's (32 tokens)."""
    from static_decode.checkpoints.loading import default_model_path, load_model

    model = load_model(default_model_path(), device=ctx.device)
    opts = CaptureOptions(settings=ctx.settings(), kinds=GREEDY_KINDS, progress=False)
    gen = Generator(model, max_len=256, batch=1, compile=True, eos_token_ids=[], capture=opts)
    greedy_row(ctx, model, gen, "greedy_embedded")


# ---- settings in question: whole-step decode per variant -------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """A decode setting to compare with the default, on the shape's layers cut to `VARIANT_LAYERS`."""

    name: str
    attn_impl: str = "auto"
    symbolic: bool = True
    fused: bool = True
    options: dict[str, Any] = field(default_factory=dict)  # inductor options (CUDA graphs kept)
    kv_dtype: torch.dtype | None = None  # the cache's dtype (None: the model's)
    prepare: Callable[[Llama], Llama] | None = None  # e.g. quantise the weights


VARIANTS = (
    Variant("default"),  # CUDA: flex where it fits
    Variant("kv_int8", kv_dtype=torch.int8),  # int8 K/V codes with a scale per token and KV head
    Variant("split_key", attn_impl="split_key"),
    Variant("static_read_len", symbolic=False),
    Variant("unfused_projections", fused=False),
    Variant("coordinate_descent", options={"coordinate_descent_tuning": True}),
    Variant("sdpa_folded", attn_impl="sdpa_folded"),
)
VARIANT_LAYERS = 4  # enough layers that the layer work dominates nothing else, few enough to compile in seconds


def phase_variants(ctx: Ctx) -> None:
    sh, d = ctx.sh, ctx.device
    cfg = sh.config if ctx.dry else dataclasses.replace(LLAMA_8B, num_layers=VARIANT_LAYERS)
    copy, timer = ctx.copy_gbps(), Timer(d)
    ladder = BucketLadder.cuda(sh.max_len) if not ctx.dry else BucketLadder.geometric(sh.max_len, align=16)
    rungs = BucketLadder(tuple(sorted({ladder.bucket_for(n + ctx.steps) for n in sh.lengths} | {sh.max_len})))
    for v in VARIANTS:
        if ctx.left() < 20:
            ctx.rows.add("decode", setting=v.name, skipped="no time left in the phase's budget")
            continue
        if ctx.dry and v.options:
            ctx.rows.add("decode", setting=v.name, skipped="inductor options: not on the dry run's eager backend")
            continue
        try:
            model = _model(cfg, sh, d, attn_impl=v.attn_impl, fused_projections=v.fused, kv_dtype=v.kv_dtype)
            if v.prepare is not None:
                model = v.prepare(model)
            settings = ctx.settings(symbolic=v.symbolic, options=v.options)
            opts = CaptureOptions(buckets=rungs, settings=settings, kinds=("decode_greedy",), progress=False)
            t0 = time.perf_counter()
            gen = Generator(model, max_len=sh.max_len, batch=1, compile=True, eos_token_ids=[], capture=opts)
            records = gen.capture_records
            ctx.rows.add("capture", process="variant", setting=v.name, step="decode_greedy",
                         seconds=round(time.perf_counter() - t0, 2), graphs=sum(r.graphs for r in records),
                         buckets=len(records))
            for live in sh.lengths:
                read_len = gen.read_len(live + ctx.steps)
                s = time_decode(gen, live, ctx.steps, read_len, timer)
                nbytes = weight_bytes_per_token(model) + kv_bytes(cfg, live + ctx.steps // 2, model.kv_dtype)
                ctx.rows.add("decode", setting=v.name, layers=cfg.num_layers, live=live, read_len=read_len,
                             ms=round(s * 1e3, 4), copy_fraction=round(nbytes / s / 1e9 / copy, 3))
            del gen, model
            if d.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            ctx.rows.add("decode", setting=v.name, error=error_text(e))


# name -> (budget on the device in seconds, python start-up included, function); run in this order, the driver
# cutting the last ones to what is left of gpu_check.TOTAL_S. A later call can run the phases a first one cut short:
# `profiles/gpu_check.py --phases attention,variants` (about 3 minutes), `--phases quant` (about 4).
PHASES: dict[str, tuple[float, Callable[[Ctx], None]]] = {
    "env": (20, phase_env),
    "correct_attention": (40, phase_correct_attention),
    "model": (220, phase_model),
    "model_warm": (60, phase_model_warm),
    "embedded": (30, phase_embedded),
    "quant": (240, phase_quant),
    "attention": (40, phase_attention),
    "variants": (120, phase_variants),
}
