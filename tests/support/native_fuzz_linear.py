"""linear_q's share of tests/support/native_fuzz_worker.py's "quant" family (csrc/linear_quant.cpp: several rows times
a quantized weight), drawn like gemv_q's cases (tests/support/native_fuzz_quant.py: the same weights and their breaks)
with rows x of any float dtype in any of these forms: [M, K] (strided too), and the broken [K], [0, K], [M, K + 1],
[1, M, K]. Valid: a weight the kernels take, x float32 or bfloat16 [M >= 1, K]. The reference is the float64 product
by the weight built there from the codes and scales, rounded to x's dtype as the kernel rounds it (each value computed
in float32, then rounded once to x's dtype: float32 first, then to bfloat16, the same double rounding)."""

from __future__ import annotations

import itertools

import torch
from hypothesis import find, given
from hypothesis import strategies as st

from tests.support.native_fuzz_quant import (
    ACC,
    FIRST,
    GROUPS,
    OUT_ROUNDING,
    SCALE_DTYPES,
    X_DTYPES,
    Harness,
    check_call,
    dequantized,
    drawn,
    gemv_q_case,
    gemv_q_tensors,
    quant_shape,
)

X_FORMS = ("rows", "rows", "strided", "flat", "empty", "wide", "batched")
LINEAR_X_DTYPES = (torch.float32, torch.bfloat16)


@st.composite
def linear_q_case(draw, h: Harness, forced: tuple[str, torch.dtype] | None = None) -> dict:
    """A gemv_q case's weight (its breaks of x left out) with M rows in one of X_FORMS; `forced`: (form, dtype)."""
    c = draw(gemv_q_case(h))
    return {**c, "bad": [b for b in c["bad"] if b not in ("x_dtype", "x_shape")], "M": draw(st.integers(1, 5)),
            "x_form": forced[0] if forced else draw(st.sampled_from(X_FORMS)),
            "x_dtype": forced[1] if forced else draw(st.sampled_from(X_DTYPES))}


def linear_q_tensors(c: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, codes, scales) of a case."""
    _, q, s = gemv_q_tensors({**c, "x_shape": "flat"})
    K = c["K"]  # the columns the weight was made with (before any break of its shape)
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    M = c["M"]
    x = torch.randn(M, K, generator=gen)
    if c["nan"] and K:
        x[M // 2, (K - 1) // 2] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}[c["nan"]]
    x = x.to(c["x_dtype"])
    x = {"rows": lambda: x, "strided": lambda: torch.stack([x, x], -1)[..., 0], "flat": lambda: x[0],
         "empty": lambda: x[:0], "wide": lambda: torch.cat([x, x[:, :1]], 1), "batched": lambda: x[None]}[
        c["x_form"]]()
    return x, q, s


def linear_q_valid(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int) -> bool:
    shape = quant_shape(q, s, group, SCALE_DTYPES)
    return (shape is not None and x.dtype in LINEAR_X_DTYPES and x.dim() == 2 and x.shape[0] >= 1
            and x.shape[1] == shape[1])


def check_linear_q_values(c: dict, out: torch.Tensor, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """A call that ran: [M, N] in x's dtype, within ACC of sum |w| |x| plus the output's rounding of the float64
    product by the rounded weight; non-finite exactly where that product is."""
    w = dequantized(q, s, c["call_group"]).float().to(x.dtype).double()  # [N, K]
    xd = x.double()  # [M, K]
    want = xd @ w.t()  # [M, N]
    assert out.shape == (x.shape[0], q.shape[0]) and out.dtype == x.dtype, f"out {out.dtype} {tuple(out.shape)}: {c}"
    got = out.double()
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite), f"non-finite where the reference is not, or the reverse: {c}"
    bound = ACC * (xd.abs() @ w.abs().t()) + OUT_ROUNDING[x.dtype] * want.abs()  # [M, N]
    err = (got - want).abs()
    assert (err[finite] <= bound[finite]).all(), (
        f"error {(err / bound.clamp(min=1e-300)).max().item():.3g} of the bound: {c}")


def check_linear_q(h: Harness, c: dict) -> None:
    check_call(h, "linear_q", c, linear_q_tensors(c), linear_q_valid, check_linear_q_values)


def check_linear_q_cases(h: Harness, examples: int) -> None:
    """`examples` drawn cases, then each form of x in each of its dtypes, in the first valid weight drawn of each
    format with a few rows and columns."""

    @drawn(examples)
    @given(linear_q_case(h))
    def cases(c: dict) -> None:
        check_linear_q(h, c)

    cases()
    for form, dtype in itertools.product(sorted(set(X_FORMS)), X_DTYPES):
        for group in GROUPS:
            check_linear_q(h, find(linear_q_case(h, (form, dtype)), lambda c, g=group: (
                c["group"] == g and c["call_group"] == g and not c["bad"] and c["N"] >= 3 and c["K"] >= 3),
                settings=FIRST))
