"""The quantized ops' share of tests/support/native_fuzz_worker.py (its "quant" family), drawn by hypothesis as the
worker draws the other ops, run in its process, counted and traced by its helpers (`Harness`: passed in, since importing
the worker by name from here would load a second copy of it beside the `__main__` one). Here `gemv_q`
(csrc/gemv_quant.cpp) and what both ops' cases share (the formats, stated independently of the kernels);
tests/support/native_fuzz_quant_layers.py has `decode_layers_q`'s.

gemv_q: random codes (int8 -128..127; int4 0..15, two a byte, or realistic ones from `QuantWeight`) and scales
(s [N], or (s, z) [N, K / group, 2]) in float32 or bfloat16, one row x of any of the four float dtypes in any of
the shapes [..., K] takes (strided too), NaN or inf in it; broken calls: a group outside {0, 32, 64, 128} or not
the tensors' own, codes, scales and x of other dtypes, codes and scales of other shapes, int4's K not a multiple of
64 or of the group, non-contiguous codes or scales, zero sizes, x with the wrong number of elements. The reference
is the float64 product by the weight built here from the codes and scales (`dequantized`: int8 q * s, int4
(q - 8) * s + z with the codes unpacked by the layout csrc/gemv_quant.cpp documents, not by quant.py's code), by x
as the kernel reads it (`reads_x_as_bf16`: a bfloat16 row stays bfloat16 either way).

Every case's validity is decided from the tensors passed (`quant_shape`, `gemv_q_valid`), not from the list of what
was broken; a refusal must be a RuntimeError from the op's own checks; every tensor a call is given is compared bit
for bit afterwards. After the drawn cases, a sweep runs each break in each of its forms alone, in every format:
hypothesis's draws leave some forms unmet.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from static_decode.kernels import cpu_kernel
from static_decode.model import quant
from tests.support.row_codes import row_codes

OPS = torch.ops.static_decode_cpu
GROUPS = (0, 32, 64, 128)  # 0: int8 per output channel; else int4's group along K
X_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what gemv_q's row may be
SCALE_DTYPES = (torch.float32, torch.bfloat16)
BAD_GROUPS = (16, -1, 1, 96, 256, 2**40)
# gemv_q's error bound: ACC of sum |w| |x| (float32 accumulation; the int4 offset term z - 8 s, or z - 136 s on the
# bfloat16 path, cancels against the codes' sum, so the error follows the terms' size, not the result's) plus the
# output's rounding to x's dtype (half an ulp, relative; float16's subnormals: an absolute 2^-25).
ACC = 1e-5
OUT_ROUNDING = {torch.float32: 2**-24, torch.float64: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}


@dataclass(frozen=True)
class Harness:
    """The worker's helpers: `note(op, case)` before each call, `tally(op, ran)`, `guarded(shape, dtype, layout,
    gen) -> (view, buffer)`, `same_bits(a, b)`, `raises(fn) -> exception | None`, and its `length` strategy
    (lengths anywhere: negative, past the cache, 10**9)."""

    note: Callable[[str, dict], None]
    tally: Callable[[str, bool], None]
    guarded: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    same_bits: Callable[[torch.Tensor, torch.Tensor], bool]
    raises: Callable[[Callable[[], Any]], BaseException | None]
    length: st.SearchStrategy[int]


# ---- the formats, stated here independently of the kernel -------------------------------------------------------
def quant_shape(q: torch.Tensor, s: torch.Tensor, group: int, scale_dtypes: tuple[torch.dtype, ...]
                ) -> tuple[int, int] | None:
    """The float weight's [N, K] when codes q and scales s are a weight the kernels take with `group`, else None:
    int8 q [N, K] with s [N]; int4 q uint8 [N, K / 2] (K a multiple of 64 and of the group) with s [N, K / group, 2];
    both contiguous, no zero size, s in one of `scale_dtypes`."""
    if group not in GROUPS or s.dtype not in scale_dtypes or q.dim() != 2 or 0 in q.shape:
        return None
    if not (q.is_contiguous() and s.is_contiguous()):
        return None
    N = q.shape[0]
    if group == 0:
        ok, K = q.dtype == torch.int8 and tuple(s.shape) == (N,), q.shape[1]
    else:
        K = 2 * q.shape[1]
        ok = q.dtype == torch.uint8 and K % 64 == 0 and K % group == 0 and tuple(s.shape) == (N, K // group, 2)
    return (N, K) if ok else None


def unpacked(packed: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (int64) from the bytes [N, K / 2]: in each chunk of 64 columns, byte j holds column j in
    its low nibble and column j + 32 in its high one (the layout as csrc/gemv_quant.cpp and quant.pack_int4 state
    it)."""
    N, half = packed.shape
    b = packed.to(torch.int64).view(N, half // 32, 32)  # [N, chunks, 32]
    return torch.cat([b & 15, b >> 4], dim=2).view(N, 2 * half)  # [N, chunks, 64] -> [N, K]


def dequantized(q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """The weight [N, K] in float64 from valid codes and scales (quant_shape's formats)."""
    if group == 0:
        return q.double() * s.double()[:, None]
    codes = unpacked(q).double()  # [N, K]
    N, K = codes.shape
    scale, zero = s.double().unbind(-1)  # [N, K / group] each
    return ((codes.view(N, K // group, group) - 8) * scale[..., None] + zero[..., None]).view(N, K)


def reads_x_as_bf16(group: int, scale_dtype: torch.dtype) -> bool:
    """Whether the kernel rounds the row to bfloat16 first: never any more (int4's bfloat16 path takes only a
    bfloat16 row, csrc/gemv_quant.cpp's int4_bf16_path; other rows take the float32 path)."""
    return False


def multiplies_codes(x: torch.Tensor, group: int, scale_dtype: torch.dtype) -> bool:
    """Whether the kernel multiplies the row's int8 codes (cpu_kernel.row_codes8): a bfloat16 row where the kernel
    multiplies codes (cpu_kernel.int8_codes), times int8 weights, or int4 weights with bfloat16 scales
    (csrc/gemv_quant.cpp, int8_dot_path)."""
    if x.dtype != torch.bfloat16:
        return False
    return cpu_kernel.int8_codes(8) if group == 0 else scale_dtype == torch.bfloat16 and cpu_kernel.int8_codes(4)


def breaks(draw: Callable[[st.SearchStrategy[Any]], Any], options: list[str]) -> set[str]:
    """What a case gets wrong: nothing in about a third of the cases, else one of `options`, sometimes two. Drawn
    from an even list rather than hypothesis's sets, which here left most cases valid and some options unmet."""
    first = draw(st.sampled_from([None] * (len(options) // 2) + options))
    second = draw(st.sampled_from([None] * len(options) + options))
    return {b for b in (first, second) if b is not None} if first is not None else set()


def drawn(examples: int) -> settings:
    """hypothesis's settings for `examples` drawn cases, derandomised: the same cases every run."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


# The sweep's: the first case drawn that meets its condition (not shrunk, which cost seconds).
FIRST = settings(max_examples=1000, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                 suppress_health_check=list(HealthCheck))


def refused_by_check(err: BaseException, op: str) -> bool:
    """A refusal as the ops' checks make it: a RuntimeError whose message starts with the op's name (not an error
    from some torch call half-way through)."""
    return isinstance(err, RuntimeError) and str(err).startswith(op)


# ---- gemv_q --------------------------------------------------------------------------------------------------------
# What a gemv_q case can get wrong, and in how many forms (its `variant`): gemv_q_tensors applies them.
GEMV_BREAKS = {"group": 2, "other_group": 1, "codes_dtype": 5, "scales_dtype": 5, "x_dtype": 5, "codes_shape": 5,
               "scales_shape": 5, "K": 2, "layout": 2, "zero": 2, "x_shape": 5}


@st.composite
def gemv_q_case(draw, h: Harness, forced: tuple[str, int, int] | None = None) -> dict:
    """A gemv_q case; `forced`: (break, form, group) instead of drawn ones."""
    bad = {forced[0]} if forced else breaks(draw, list(GEMV_BREAKS))
    variant = forced[1] if forced else draw(st.integers(0, 4))  # which form a break takes
    group = forced[2] if forced else draw(st.sampled_from(GROUPS))  # the format the tensors are made in
    if "K" in bad:  # int4 whose K is a multiple of the group but not of 64, or of 64 but not of the group
        group = (32, 128)[variant % 2]
        K = 64 * draw(st.integers(0, 3)) + 32 if group == 32 else 64 * draw(st.sampled_from([1, 3, 5]))
    elif "group" in bad and variant % 2:  # int4 in groups of 16, called so: only the group is wrong
        group, K = 16, 64 * draw(st.integers(1, 4))
    elif group == 0:
        K = draw(st.integers(1, 200))
    else:
        K = math.lcm(64, group) * draw(st.integers(1, 4))
    return dict(
        group=group, K=K, N=draw(st.integers(1, 20)), bad=sorted(bad), seed=draw(st.integers(0, 2**16)),
        source=draw(st.sampled_from(["random", "random", "extreme", "quantized"])),
        scale_dtype=draw(st.sampled_from(SCALE_DTYPES)), x_dtype=draw(st.sampled_from(X_DTYPES)),
        x_shape=draw(st.sampled_from(["flat", "row", "row3", "strided"])), nan=draw(st.sampled_from(
            [None] * 5 + ["nan", "inf", "-inf"])),
        call_group=16 if group == 16 else draw(st.sampled_from(BAD_GROUPS) if "group" in bad else st.sampled_from(
            [g for g in GROUPS if g != group]) if "other_group" in bad else st.just(group)),
        variant=variant,
    )


def gemv_q_tensors(c: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, codes, scales) of a case: valid ones in its format, then its breaks applied."""
    gen = torch.Generator().manual_seed(c["seed"])
    group, K, N, bad, var = c["group"], c["K"], c["N"], c["bad"], c["variant"]
    if "zero" in bad:
        N, K = (0, K) if var % 2 else (N, 0)
    half = K // 2
    if c["source"] == "quantized" and group in GROUPS and "K" not in bad and N and K:
        w = (torch.randn(N, K, generator=gen) * torch.linspace(0.1, 2, K)).to(c["scale_dtype"])
        qw = quant.QuantWeight(w, quant.Scheme(8) if group == 0 else quant.Scheme(4, group))
        q, s = qw.qweight, qw.scales
    elif group == 0:
        q = torch.randint(-128, 128, (N, K), generator=gen, dtype=torch.int8)
        if c["source"] == "extreme":
            q.fill_(-128 if var % 2 else 127)
        s = (torch.randn(N, generator=gen) * 0.02).to(c["scale_dtype"])
    else:
        q = torch.randint(0, 256, (N, half), generator=gen, dtype=torch.int16).to(torch.uint8)  # two codes a byte
        if c["source"] == "extreme":
            q.fill_(0 if var % 2 else 255)
        G = K // group
        s = torch.stack([torch.rand(N, G, generator=gen) * 0.1, torch.randn(N, G, generator=gen) * 0.1], -1)
        s = s.to(c["scale_dtype"])
    n = q.shape[0]
    if "codes_dtype" in bad:
        q = [q.view(torch.uint8 if q.dtype == torch.int8 else torch.int8), q.to(torch.int32), q.float(),
             q.to(torch.int16), q.bool()][var]
    if "scales_dtype" in bad:
        s = s.to([torch.float16, torch.float64, torch.int32, torch.float16, torch.int8][var])
    if "codes_shape" in bad:
        q = [lambda: torch.cat([q, q[:1]]), lambda: q.flatten(), lambda: q[None], lambda: q[:, :-1].contiguous(),
             lambda: q.reshape(-1, 2) if q.numel() % 2 == 0 else q[None]][var]()
    if "scales_shape" in bad:
        if s.dim() == 1:
            s = [lambda: s[:-1] if n > 1 else torch.cat([s, s]), lambda: s[:, None], lambda: torch.cat([s, s[:1]]),
                 lambda: s[None], lambda: s.reshape(1, -1)][var]()
        else:
            s = [lambda: s[:, :-1].contiguous() if s.shape[1] > 1 else torch.cat([s, s], 1),
                 lambda: s[..., :1].contiguous(), lambda: s.reshape(n, -1), lambda: s[None],
                 lambda: torch.cat([s, s[:1]])][var]()
    if "layout" in bad:  # strided views of the same values
        if var % 2:
            s = torch.stack([s, s], -1)[..., 0]  # every other element
        else:
            q = q.t().contiguous().t() if q.dim() == 2 and min(q.shape) > 1 else torch.stack([q, q], -1)[..., 0]
    x_dtype = [torch.int64, torch.int32, torch.bool, torch.complex64, torch.uint8][var] if "x_dtype" in bad else (
        c["x_dtype"])
    x = torch.randn(K, generator=gen)
    if c["nan"] and K:
        x[(K - 1) // 2] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[c["nan"]]
    x = x.to(x_dtype)
    if "x_shape" in bad:
        x = [lambda: torch.cat([x, x[:1]]) if K else x[:0][None], lambda: x[:-1] if K else x[None, None],
             lambda: x[:, None] if K > 1 else torch.cat([x, x]), lambda: x.reshape(()) if K == 1 else x[None, ::2],
             lambda: torch.stack([x, x])][var]()  # the last: [2, K], K values a row
    else:
        x = {"flat": lambda: x, "row": lambda: x[None], "row3": lambda: x[None, None],
             "strided": lambda: torch.stack([x, x], -1)[:, 0]}[c["x_shape"]]()
    return x, q, s


def gemv_q_valid(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int) -> bool:
    shape = quant_shape(q, s, group, SCALE_DTYPES)
    return (shape is not None and x.dtype in X_DTYPES and x.dim() >= 1 and x.shape[-1] == shape[1]
            and x.numel() == shape[1])


def check_gemv_q_values(c: dict, out: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """A call that ran: [N] in x's dtype, the float64 reference within ACC of sum |w| |x| plus the output's rounding;
    non-finite exactly where the reference is (NaN where it is NaN; an inf in x may come out NaN where the reference
    has inf: the kernel sums the codes and the offsets apart, inf - inf)."""
    group = c["call_group"]
    w = dequantized(q, s, group)  # [N, K]
    xr = x.reshape(-1).to(torch.bfloat16) if reads_x_as_bf16(group, s.dtype) else x.reshape(-1)
    xr = row_codes(xr) if multiplies_codes(x, group, s.dtype) else xr.double()  # [K] float64
    want = w @ xr  # [N]
    assert out.shape == (q.shape[0],) and out.dtype == x.dtype, f"out {out.dtype} {tuple(out.shape)}: {c}"
    got = out.double()
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite) and (got.isnan() | ~want.isnan()).all(), (
        f"non-finite where the reference is not, or the reverse: {got.tolist()} against {want.tolist()}: {c}")
    tiny = 2**-25 if x.dtype == torch.float16 else 0.0
    bound = ACC * (w.abs() @ xr.abs()) + OUT_ROUNDING[x.dtype] * want.abs() + tiny  # [N]
    err = (got - want).abs()
    assert (err[finite] <= bound[finite]).all(), (
        f"error {(err / bound.clamp(min=1e-300)).max().item():.3g} of the bound: {got.tolist()} against "
        f"{want.tolist()}: {c}")


def check_call(h: Harness, op: str, c: dict, tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               valid: Callable[..., bool], check_values: Callable[..., None]) -> None:
    """One case of a quantized op taking (x, codes, scales, group): run where `valid` says so (its values checked by
    `check_values`), refused by the op's own checks otherwise, its arguments unchanged either way."""
    x, q, s = tensors
    saved = [t.clone() for t in tensors]
    out = None

    def call() -> None:
        nonlocal out
        out = getattr(OPS, op)(x, q, s, c["call_group"])

    h.note(op, c)
    err = h.raises(call)
    assert all(map(h.same_bits, saved, tensors)), f"an argument changed: {c}"
    ok = valid(x, q, s, c["call_group"])
    h.tally(op, err is None)
    assert (err is None) == ok, f"valid={ok} but the call {'raised ' + repr(err) if err else 'ran'}: {c}"
    if err is not None:
        assert refused_by_check(err, op), f"refused by {err!r}, not by the op's checks: {c}"
    else:
        check_values(c, out, x, q, s)


def check_gemv_q(h: Harness, c: dict) -> None:
    check_call(h, "gemv_q", c, gemv_q_tensors(c), gemv_q_valid, check_gemv_q_values)


def check_gemv_q_cases(h: Harness, examples: int) -> None:
    """`examples` drawn cases, then each break in each of its forms alone, in each format, in the first case drawn
    with a few rows and columns (a break of a 1 x 1 weight can be a no-op); the sweep's cases are picked without
    the validity rule, so that a wrong rule cannot pick the cases that hide it."""

    @drawn(examples)
    @given(gemv_q_case(h))
    def cases(c: dict) -> None:
        check_gemv_q(h, c)

    cases()
    for bad, forms in GEMV_BREAKS.items():
        for form, group in itertools.product(range(forms), GROUPS[:1] if bad == "K" else GROUPS):  # K: its form's
            check_gemv_q(h, find(gemv_q_case(h, (bad, form, group)), lambda c: c["N"] >= 3 and c["K"] >= 3,
                                 settings=FIRST))
