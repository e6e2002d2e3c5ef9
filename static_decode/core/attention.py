"""Grouped-query attention of a chunk of queries against the KV cache.

`grouped_attention` is the fixed-shape device function a captured step calls (device tensors plus a K/V view whose
length is a Python int); `gqa_attention` is the checked public entry over a `StaticKVCache`. Slot t of row b sits at
absolute position lens[b] - n_new[b] + t (lens counts the chunk just appended) and sees keys 0..that position, or
only pos - W < j <= pos on a layer with a sliding window W; slots t >= n_new[b] return exact zeros. The mask is built
from the device lengths, not as a T x T triangle, so a chunk appended after cached tokens sees them and positions
crossing W change no shape. Seven formulations (IMPLS), all reading K and V in place; `resolve_impl` picks one for
"auto". What each does and why: docs/internals.md#attention; numbers: profiles/attention_cpu.md.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
import torch.nn.functional as F

from static_decode.core import kv_quant
from static_decode.core.cache import IntsLike, StaticKVCache, host_ints
from static_decode.core.masks import StepMask, check_window, step_mask
from static_decode.core.split_attention import split_key_attention
from static_decode.kernels import cpu_kernel

IMPLS = ("matmul", "sdpa", "matmul_qk", "sdpa_folded", "flex", "split_key", "decode_kernel")  # the formulations
# The formulations that can softcap the scores (cap * tanh(scores / cap) before the mask, Gemma 2): those whose
# softmax is our own. SDPA's kernels, flex's score_mod here and the CPU decode kernel take no cap.
SOFTCAP_IMPLS = ("matmul", "matmul_qk")
CPU_ONLY = ("decode_kernel",)  # elsewhere they resolve to a general formulation: nothing of their own to measure
AUTO = "auto"  # resolve_impl: picked per call from the device, the batch and the KV heads
CHOICES = (*IMPLS, AUTO)
DEFAULT_IMPL = AUTO  # measured: profiles/attention_cpu.md, profiles/RESULTS.md ("Split-key attention")


def _threads() -> int:
    return torch.get_num_threads()


# A constant of the trace (dynamo cannot trace torch.get_num_threads): a graph keeps the formulation chosen for the
# thread count it was compiled under; correct either way, only the speed depends on it. This is exactly what
# `torch.compiler.assume_constant_result` does (it sets this marker), without importing torch._dynamo here: `--help`
# and the eager paths never load the compiler (tests/test_layers.py; tests/core/test_attention.py checks the marker).
_threads._dynamo_marked_constant = True  # type: ignore[attr-defined]


# ---- CUDA decode and verify steps ----------------------------------------------------------------------------
# A one-call attention gives a batch-1 decode step B * Hkv work items (8 for Llama-3.1-8B on 132 SMs: K/V read at
# ~5% of an H200's bandwidth past 1k, profiles/RESULTS.md). Decode and verify steps on CUDA therefore take a
# formulation that splits the key axis over the SMs, in this order of preference:
#   "flex": inductor's flex-decoding Triton template (query length < 128, a power-of-two group: its GQA block holds
#           the group's query heads together; head_dim a power of two >= 16), only inside a compile (eager flex is
#           PyTorch's unfused reference);
#   "split_key": blocks of keys through SDPA's memory-efficient kernel plus one combine (any shape, eager too);
#   "sdpa_folded": the one-call formulation, where the others failed to compile.
# A formulation that fails to compile is skipped for that step kind from then on: the capture registry owns that
# retry and hands the step a model whose `attn_skip` names it (`Llama.skipping`), so the step compiles again with
# the next one, never falling back to an eager step.
CUDA_DECODE_ORDER = ("flex", "split_key", "sdpa_folded")
FLEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def flex_fits(groups: int, query_len: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether inductor's flex-decoding template takes a step of this shape (torch/_inductor/kernel/flex/
    flex_decoding.py: query length < 128, a power-of-two count of query heads per KV head; head_dim >= 16, a power of
    two here so that no padding path is needed)."""
    def pow2(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    return pow2(groups) and 0 < query_len < 128 and head_dim >= 16 and pow2(head_dim) and dtype in FLEX_DTYPES


def cuda_decode_impl(
    groups: int,
    query_len: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    compiling: bool,
    failed: Collection[str] = (),
) -> str:
    """The formulation of a CUDA decode or verify step (CUDA_DECODE_ORDER): "flex" inside a compile where it fits,
    else "split_key", each unless it is in `failed` (it failed to compile for this step); "sdpa_folded" last."""
    for impl in CUDA_DECODE_ORDER:
        if impl in failed:
            continue
        if impl == "flex" and not (compiling and flex_fits(groups, query_len, head_dim, dtype)):
            continue
        return impl
    return "sdpa_folded"


# Query rows per KV head up to which SDPA's CPU flash kernel makes one work item per (row, KV head): its query
# block is 32 rows below 192 (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp). A decode step (G rows) or a short
# verify chunk; a prefill chunk of 128 tokens has G*128 rows, enough query blocks to keep every thread busy.
SPLIT_MAX_ROWS = 32


def resolve_impl(
    impl: str,
    batch: int,
    kv_heads: int,
    rows: int,
    device: torch.device,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    *,
    groups: int | None = None,
    skip: Collection[str] = (),
) -> str:
    """The formulation `impl` names, "auto" resolved for a step of `rows` query rows per KV head (G * T, `groups`
    query heads per KV head; None: rows, a one-token step) over K/V of `head_dim` and `dtype`. On CUDA, decode and
    verify steps (at most SPLIT_MAX_ROWS rows) split the key axis (`cuda_decode_impl`), and a formulation in
    `skip` (it failed to compile for this step) gives way to the next one, named or not. On the CPU, for a step of
    at most SPLIT_MAX_ROWS rows: "decode_kernel" where the kernel takes the shapes and is built (SmolLM2-135M decode
    attention at 8k keys, 30 layers, 2 threads: 20 ms against split_key's 32 and sdpa_folded's 38,
    profiles/RESULTS.md); else "split_key" when the batch's KV heads, the work items SDPA's CPU kernel then has, do
    not spread evenly over torch's threads (SmolLM2 at 8k: 9% faster than sdpa_folded; Llama-3.1-8B's 8 KV heads:
    2-4% slower); else "sdpa_folded", as for prefill chunks (384 rows: enough query blocks) and on other devices."""
    kernel = cpu_kernel.supports(rows, head_dim, dtype, device)
    if device.type == "cuda" and (impl == AUTO and rows <= SPLIT_MAX_ROWS or impl in skip):
        G = rows if groups is None else max(1, groups)
        return cuda_decode_impl(
            G, max(1, rows // G), head_dim, dtype, compiling=torch.compiler.is_compiling(), failed=skip
        )
    if impl == "decode_kernel":  # named: the kernel where it applies (and builds), the general formulation elsewhere
        return impl if kernel and cpu_kernel.available() else "sdpa_folded"
    if impl != AUTO:
        return impl
    if rows <= SPLIT_MAX_ROWS and kernel and cpu_kernel.available():
        return "decode_kernel"
    if device.type == "cpu" and rows <= SPLIT_MAX_ROWS and (batch * kv_heads) % _threads():
        return "split_key"
    return "sdpa_folded"


def _masked_softmax_(
    scores: torch.Tensor, visible: torch.Tensor, dim: int, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """softmax(scale * scores) over `dim` where `visible`, 0 elsewhere, in place on the fresh `scores`; `softcap`:
    the scaled scores capped to softcap * tanh(scores / softcap) first (transformers' Gemma 2 order).

    A fully masked slot has max -inf; it is shifted by the finite dtype minimum instead, so exp(-inf) gives 0
    weights (and the clamped denominator a 0 row), never NaN.
    """
    scores.mul_(scale)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    scores.masked_fill_(~visible, -math.inf)
    top = scores.amax(dim=dim, keepdim=True).clamp_(min=torch.finfo(scores.dtype).min)
    scores.sub_(top).exp_()
    return scores.div_(scores.sum(dim=dim, keepdim=True).clamp_(min=torch.finfo(scores.dtype).tiny))


def _matmul(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepMask, softcap: float | None = None
) -> torch.Tensor:
    # Keys-major scores: K [S, d] @ Q^T [d, G*T] streams K's rows in memory order, which the BLAS GEMM turns
    # into a sequential read; Q @ K^T (query-major, "matmul_qk") reads the same bytes 1.2-2x slower from DRAM
    # here (profiles/attention_cpu.md).
    B, Hq, T, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qf = q.reshape(B, Hkv, G * T, d)  # [B, Hkv, G*T, d]: a group's queries share one KV head
    scores = torch.matmul(k, qf.transpose(-1, -2))  # [B, Hkv, S, G*T]; K^T never materialised
    visible = step.visible.transpose(-1, -2)[:, None, :, None, :]  # [B, 1, S, 1, T]
    _masked_softmax_(scores.view(B, Hkv, S, G, T), visible, dim=2, scale=1.0 / math.sqrt(d), softcap=softcap)
    return torch.matmul(scores.transpose(-1, -2), v).view(B, Hq, T, d)  # [B, Hkv, G*T, S] @ [B, Hkv, S, d]


def _matmul_qk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepMask, softcap: float | None = None
) -> torch.Tensor:
    B, Hq, T, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qf = q.reshape(B, Hkv, G * T, d)  # [B, Hkv, G*T, d]
    scores = torch.matmul(qf, k.transpose(-1, -2))  # [B, Hkv, G*T, S]: K^T as a transposed view
    visible = step.visible[:, None, None]  # [B, 1, 1, T, S]
    _masked_softmax_(scores.view(B, Hkv, G, T, S), visible, dim=-1, scale=1.0 / math.sqrt(d), softcap=softcap)
    return torch.matmul(scores, v).view(B, Hq, T, d)  # [B, Hq, T, d]


def _sdpa_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: StepMask) -> torch.Tensor:
    B, Hq, T, d = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qf = q.reshape(B, Hkv, G * T, d)  # [B, Hkv, G*T, d]: the group folded into the query axis, no enable_gqa
    # The additive [B, 1, G*T, S] mask, shared by the layers; SDPA would turn a bool mask into it per call.
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask.bias).view(B, Hkv, G, T, d)
    real = mask.real[:, None, None, :, None]  # [B, 1, 1, T, 1]; a padded slot's row is all -inf (NaN in SDPA)
    out = torch.where(real, out, torch.zeros((), dtype=out.dtype, device=out.device))  # [B, Hkv, G, T, d]
    # reshape, not view: CUDA's fused SDPA kernels return [B, Hkv, G*T, d] laid out as [B, G*T, Hkv, d], so
    # merging (Hkv, G) into Hq needs a copy there (of the output only: B*Hq*T*d elements, never K or V).
    return out.reshape(B, Hq, T, d)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: StepMask) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.visible[:, None], enable_gqa=True)  # [B, Hq, T, d]
    real = mask.real[:, None, :, None]  # [B, 1, T, 1]
    return torch.where(real, out, torch.zeros((), dtype=out.dtype, device=out.device))


def _causal_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    T = q.shape[2]
    if k.shape[2] != T:
        raise ValueError(f"a fresh (causal) chunk reads exactly its own {T} keys, got a read of {k.shape[2]}")
    if q.device.type == "cpu":
        # The CPU flash kernel maps query head h to KV head h // G itself (no repeat; checked with the profiler):
        # one call, 5% faster than one per group member on SmolLM2's prefill.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, Hq, T, d]
    return _causal_per_group(q, k, v)


def _causal_per_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # Off the CPU enable_gqa may take a path that repeats K/V: one causal SDPA per group member instead, query
    # head kv*G + g against KV head kv, K/V read in place.
    B, Hq, T, d = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.view(B, Hkv, G, T, d)  # [B, Hkv, G, T, d]
    outs = [F.scaled_dot_product_attention(qg[:, :, g], k, v, is_causal=True) for g in range(G)]  # G x [B, Hkv, T, d]
    return torch.stack(outs, dim=2).view(B, Hq, T, d)  # [B, Hq, T, d]


def _flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, n_new: torch.Tensor, window: int | None
) -> torch.Tensor:
    # Imported here: flex_attention pulls in torch._dynamo, which the eager paths (and a CLI's --help) never need.
    from torch.nn.attention.flex_attention import flex_attention

    T = q.shape[2]
    start = lens - n_new  # [B] absolute position of slot 0 of each row

    def offset_mask(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, t: torch.Tensor, s: torch.Tensor):
        # The same rule as chunk_mask, per (row, query slot, key): key s visible from slot t's position.
        return torch.where((s <= start[b] + t) & (t < n_new[b]), score, -math.inf)

    def window_mask(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, t: torch.Tensor, s: torch.Tensor):
        # ... and no older than the window: start[b] + t - W < s.
        pos = start[b] + t
        return torch.where((s <= pos) & (s > pos - window) & (t < n_new[b]), score, -math.inf)

    mod = offset_mask if window is None else window_mask
    out = flex_attention(q, k, v, score_mod=mod, enable_gqa=True)  # [B, Hq, T, d]
    real = (torch.arange(T, device=q.device) < n_new[:, None])[:, None, :, None]  # [B, 1, T, 1]
    return torch.where(real, out, torch.zeros((), dtype=out.dtype, device=out.device))


def _split_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: StepMask) -> torch.Tensor:
    return split_key_attention(
        q, k, v, mask.bias, mask.visible, mask.real, window=mask.window, first_block=mask.first_block
    )


def _decode_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, n_new: torch.Tensor, window: int | None
) -> torch.Tensor:
    # resolve_impl chose it only where the kernel is built and takes these shapes; the mask is the lengths (and the
    # window), read inside the kernel, which never reads a key before a row's window.
    if window is None:
        return cpu_kernel.decode_attention(q, k, v, lens, n_new)
    return cpu_kernel.decode_attention(q, k, v, lens, n_new, window=window)


_IMPL_FNS = {
    "matmul": _matmul, "sdpa": _sdpa, "matmul_qk": _matmul_qk, "sdpa_folded": _sdpa_folded,
    "split_key": _split_key,
}


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: torch.Tensor,
    n_new: torch.Tensor,
    *,
    impl: str = DEFAULT_IMPL,
    mask: StepMask | None = None,
    window: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Device-only attention: q [B, Hq, T, d], k/v [B, Hkv, S, d] (views, S = read length), lens/n_new [B].

    `mask`: the step's `step_mask` for these lengths, shapes and `window` (the layer's sliding window, None: off),
    shared by a step's layers of that window; built here if None. `softcap`: scores capped to
    softcap * tanh(scores / softcap) (only SOFTCAP_IMPLS; "auto" is then "matmul"). No checks of the tensors and
    no host reads: this is what a captured step runs. Returns [B, Hq, T, d].
    `scales`: an int8 cache's (k_scale, v_scale) views [B, Hkv, S] (core/kv_quant.py; k/v then hold its codes): the
    CPU decode kernel reads codes and scales in place, every other formulation a float32 dequantized copy of the read.
    """
    if impl not in CHOICES:
        raise ValueError(f"impl must be one of {CHOICES}, got {impl!r}")
    check_window(window)
    if softcap is not None:
        impl = "matmul" if impl == AUTO else impl
        if impl not in SOFTCAP_IMPLS:
            raise ValueError(f"attention formulation {impl!r} cannot softcap the scores; use one of {SOFTCAP_IMPLS}")
        if mask is not None and mask.causal:
            mask = None  # causal SDPA cannot softcap: the offset mask instead
    if mask is not None and not mask.causal and mask.window != window:
        raise ValueError(f"the step mask was built for window {mask.window!r}, this layer's is {window!r}")
    groups = q.shape[1] // max(1, k.shape[1])
    impl = resolve_impl(
        impl, q.shape[0], k.shape[1], groups * q.shape[2], q.device, q.shape[3], kv_quant.attention_dtype(k.dtype),
        groups=groups,
    )
    if k.shape[2] == 0 or q.shape[2] == 0:  # nothing cached, or no query slot (static shapes: fine under compile)
        return torch.zeros_like(q)
    if scales is not None:  # an int8 cache: the kernel reads it as it is, the others a dequantized copy of the read
        if impl == "decode_kernel":
            return cpu_kernel.decode_attention_int8(q, k, v, *scales, lens, n_new, window=window)
        k, v = kv_quant.dequantize(k, scales[0]), kv_quant.dequantize(v, scales[1])  # [B, Hkv, S, d] float32
    if k.dtype != q.dtype and impl != "decode_kernel":
        # A cache in another dtype (Llama.kv_dtype): the SDPA formulations take one dtype, so the queries join the
        # cache's (never the other way: converting K/V would copy the whole read) and the output returns to q's.
        return grouped_attention(
            q.to(k.dtype), k, v, lens, n_new, impl=impl, mask=mask, window=window, softcap=softcap
        ).to(q.dtype)
    if mask is not None and mask.causal:
        if window is None or q.shape[2] <= window:  # the fresh chunk fits in the window: causal is exact
            return _causal_fresh(q, k, v)
        mask = None  # a fresh chunk longer than the window: the window's mask, built below
    if impl == "flex":  # its mask is a function of the lengths, evaluated inside the kernel
        return _flex(q, k, v, lens, n_new, window)
    if impl == "decode_kernel":
        return _decode_kernel(q, k, v, lens, n_new, window)
    if mask is None:
        groups = q.shape[1] // k.shape[1]
        mask = step_mask(
            lens, n_new, q.shape[2], k.shape[2], groups=groups, dtype=q.dtype, impl=impl, window=window
        )
    if softcap is not None:
        return _IMPL_FNS[impl](q, k, v, mask, softcap)
    return _IMPL_FNS[impl](q, k, v, mask)


def gqa_attention(
    q: torch.Tensor,
    cache: StaticKVCache,
    n_new: IntsLike,
    *,
    layer: int = 0,
    read_len: int | None = None,
    impl: str = DEFAULT_IMPL,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the n_new[b] tokens just appended to `cache` (their queries q: [B, Hq, T, d]).

    Reads `cache.k[layer, ..., :read_len, :]` only (a view); read_len defaults to the longest row of the host
    mirror and must cover it. Query head h reads KV head h // (Hq // Hkv). `window`: a sliding window of that many
    keys (None: every key up to the query's position). Returns [B, Hq, T, d].
    """
    if impl not in CHOICES:
        raise ValueError(f"impl must be one of {CHOICES}, got {impl!r}")
    check_window(window)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a rank-4 tensor [B, Hq, T, d], got {getattr(q, 'shape', type(q))}")
    B, Hq, T, d = q.shape
    if cache.batch != B or d != cache.head_dim:
        raise ValueError(f"q has shape {tuple(q.shape)}; the cache has batch {cache.batch}, head_dim {cache.head_dim}")
    if Hq % cache.kv_heads:
        raise ValueError(f"Hq={Hq} query heads is not a multiple of Hkv={cache.kv_heads}")
    if not q.dtype.is_floating_point or (q.dtype != cache.dtype and not cache.quantized):  # int8: any float q
        raise TypeError(f"q has dtype {q.dtype}, the cache holds {cache.dtype}")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device}, the cache is on {cache.device}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cache.layers:
        raise ValueError(f"layer={layer!r} must be an int in 0..{cache.layers - 1}")
    n = host_ints(n_new, "n_new")
    if n.shape[0] != B:
        raise ValueError(f"n_new has {n.shape[0]} entries, q has batch {B}")
    for b in range(B):
        if not 0 <= n[b] <= min(T, cache.host_lens[b]):
            raise ValueError(
                f"n_new[{b}]={n[b]} must lie in 0..min(T={T}, row length {cache.host_lens[b]}): "
                "attention covers tokens already appended"
            )
    read_len = cache.check_read_len(read_len)
    k, v = cache.layer_view(layer, read_len)  # [B, Hkv, read_len, d] views
    scales = cache.layer_scales(layer, read_len)  # an int8 cache's [B, Hkv, read_len] views; None otherwise
    return grouped_attention(q, k, v, cache.lens, cache.device_ints(n), impl=impl, window=window, scales=scales)
