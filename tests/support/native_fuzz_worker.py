"""The body of tests/kernels/test_native_fuzz.py, run in a subprocess of its own: a crash (a segfault, a SIGFPE, an
abort) ends this process, not pytest's, and the test fails on its exit code.

`python -m tests.support.native_fuzz_worker EXAMPLES [TRAIL [FAMILY,...]]` (attention, layers, gemv, quant, sampling)
draws EXAMPLES cases per op with hypothesis (derandomised: the same cases every run) over the CPU kernels' public ops
and their wrappers: shapes (zero sizes included), dtypes, strides (rows padded, transposed), lengths anywhere
(negative, past the cache, 10**9), element counts that do not match the batch. Each case states, independently of the
kernels, whether the call is valid; the property: a valid call succeeds with the float64 reference's values (NaN where
the reference has NaN) and writes only the slot it should; an invalid one raises a Python exception and leaves every
tensor it was given bit-identical, the guard rows around the cache included (an out-of-bounds write lands there).
Prints one line per op with the counts; exit 0 when every case held. TRAIL, a file: each case is written there before
it runs (the last line names the case that crashed).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from static_decode.core.reference import attention_vectorised
from static_decode.kernels import cpu_kernel
from tests.support.native_fuzz_linear import check_linear_q_cases
from tests.support.native_fuzz_quant import Harness, check_gemv_q_cases
from tests.support.native_fuzz_quant_layers import check_layers_q_cases
from tests.support.native_fuzz_sampling import check_sampling_cases

OPS = torch.ops.static_decode_cpu
KERNEL_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
DTYPES = (*KERNEL_FLOATS, torch.float64, torch.int64)
GUARD = 2  # rows of sentinel values either side of the cache's key axis
counts: dict[str, list[int]] = {}


TRAIL = open(sys.argv[2], "w") if len(sys.argv) > 2 else None  # noqa: SIM115  # each case before its call


def note(op: str, case: dict) -> None:
    """Write the case about to run where a crash leaves it (the process may not get to say anything after)."""
    if TRAIL is not None:
        TRAIL.write(f"{op}: {case}\n")
        TRAIL.flush()


def tally(op: str, accepted: bool) -> None:
    counts.setdefault(op, [0, 0])[0 if accepted else 1] += 1


def guarded(shape: tuple[int, ...], dtype: torch.dtype, layout: str, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A cache-like tensor of `shape` (key axis -2, rows -1) inside a buffer with GUARD sentinel rows either side of
    the key axis: (view, buffer). layout: "dense" rows, "padded" rows (stride(-2) > d), "transposed" (stride(-1)
    > 1)."""
    *lead, S, d = shape
    if layout == "transposed":
        buf = torch.full((*lead, d, S + 2 * GUARD), 7.0).to(dtype)
        view = buf[..., GUARD:GUARD + S].transpose(-1, -2)
    else:
        pad = 3 if layout == "padded" else 0
        buf = torch.full((*lead, S + 2 * GUARD, d + pad), 7.0).to(dtype)
        view = buf[..., GUARD:GUARD + S, :d]
    if view.numel():
        view.copy_(torch.randn(view.shape, generator=gen).to(dtype))
    return view, buf


def lengths_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(dtype) if values else torch.zeros(0, dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN included)."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)

    return a.shape == b.shape and torch.equal(raw(a), raw(b))


def raises(fn) -> BaseException | None:
    try:
        fn()
    except Exception as err:  # any Python exception is a refusal; a crash never gets here
        return err
    return None


length = st.one_of(st.integers(-2, 12), st.sampled_from([10**9, -(10**9), 2**40]))
head_dim = st.sampled_from([0, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 256, 272])


def breaks(draw, options: list[str]) -> set[str]:
    """What a case gets wrong: nothing half the time, else one or two of `options` (each case's validity is still
    decided from the values drawn, not from this list)."""
    return draw(st.one_of(st.just(set()), st.sets(st.sampled_from(options), min_size=1, max_size=2)))


@st.composite
def attention_case(draw):
    bad = breaks(draw, ["B", "H", "M", "d", "slots", "k_d", "q_dtype", "kv_dtype", "v_dtype", "len_dtype", "layout",
                        "lens_count", "lens", "n_new", "window"])
    B = 0 if "B" in bad else draw(st.integers(1, 3))
    H = 0 if "H" in bad else draw(st.integers(1, 3))
    slots = draw(st.integers(-1, 0)) if "slots" in bad else draw(st.integers(1, 3))
    G = draw(st.integers(1, 4))
    M = draw(st.sampled_from([0, G * max(slots, 1) + 1, 65])) if "M" in bad else G * max(slots, 1)
    d = draw(head_dim if "d" in bad else st.sampled_from(cpu_kernel.head_dims()))
    S = draw(st.integers(0, 12))
    n_new, lens = [], []
    for _ in range(B + 1):  # one spare value for a lens longer than the batch
        n = draw(length if "n_new" in bad else st.integers(0, min(max(slots, 0), S)))
        n_new.append(n)
        lens.append(draw(length if "lens" in bad or not 0 <= n <= S else st.integers(n, S)))
    return dict(
        B=B, H=H, M=M, d=d, S=S, slots=slots, lens=lens, n_new=n_new,
        lens_count=draw(st.sampled_from([0, B + 1, max(B - 1, 0)])) if "lens_count" in bad else B,
        q_dtype=draw(st.sampled_from(DTYPES if "q_dtype" in bad else KERNEL_FLOATS)),
        kv_dtype=draw(st.sampled_from(DTYPES if "kv_dtype" in bad else KERNEL_FLOATS)),
        v_dtype_same="v_dtype" not in bad, len_dtype=torch.int32 if "len_dtype" in bad else torch.int64,
        layout=draw(st.sampled_from(["transposed", "dense"] if "layout" in bad else ["dense", "padded"])),
        k_d=draw(st.sampled_from([16, 32, 0])) if "k_d" in bad else d,
        nan=draw(st.sampled_from([None] * 4 + ["q", "k"])), wrapper=draw(st.booleans()),
        # the op's sliding window: 0 none, else the keys a query sees; negative refused
        window=draw(st.sampled_from([-1, -(2**63)])) if "window" in bad else draw(
            st.sampled_from([0, 0, 1, 2, 5, 2**62])),
    )


def attention_valid(c: dict) -> bool:
    lens, n_new = c["lens"][:c["lens_count"]], c["n_new"][:c["lens_count"]]
    return (
        c["B"] >= 1 and c["H"] >= 1 and c["M"] >= 1 and c["d"] in cpu_kernel.head_dims() and c["k_d"] == c["d"]
        and c["q_dtype"] in KERNEL_FLOATS and c["kv_dtype"] in KERNEL_FLOATS and c["v_dtype_same"]
        and c["slots"] >= 1 and c["M"] % c["slots"] == 0 and c["M"] <= 64 and c["layout"] != "transposed"
        and c["len_dtype"] == torch.int64 and c["lens_count"] == c["B"] and c["window"] >= 0
        and all(0 <= n <= c["slots"] and n <= length <= c["S"] for length, n in zip(lens, n_new, strict=True))
    )


@settings(max_examples=int(sys.argv[1]) if len(sys.argv) > 1 else 100, deadline=None, derandomize=True,
          database=None, suppress_health_check=list(HealthCheck))
@given(attention_case())
def check_attention(c: dict) -> None:
    gen = torch.Generator().manual_seed(0)
    B, H, M, d, S = c["B"], c["H"], c["M"], c["d"], c["S"]
    q = torch.randn(B, H, M, d, generator=gen).to(c["q_dtype"])
    k, kbuf = guarded((B, H, S, c["k_d"]), c["kv_dtype"], c["layout"], gen)
    v, vbuf = guarded((B, H, S, c["k_d"]), c["kv_dtype"] if c["v_dtype_same"] else torch.float64, c["layout"], gen)
    if c["nan"] == "q" and q.numel() and q.is_floating_point():
        q[0, 0, 0, 0] = math.nan
    if c["nan"] == "k" and k.numel() and k.is_floating_point():
        k[0, 0, 0, 0] = math.nan
    lens = lengths_tensor(c["lens"][:c["lens_count"]], c["len_dtype"])
    n_new = lengths_tensor(c["n_new"][:c["lens_count"]], c["len_dtype"])
    saved = [t.clone() for t in (q, kbuf, vbuf, lens, n_new)]
    valid = attention_valid(c)
    out = None

    def call() -> None:
        nonlocal out
        if c["wrapper"] and c["slots"] >= 1 and M % c["slots"] == 0:  # the wrapper's q: [B, Hq, T, d]
            qh = q.reshape(B, H * (M // c["slots"]), c["slots"], d)
            window = c["window"] or None  # the wrapper's spelling of no window
            out = cpu_kernel.decode_attention(qh, k, v, lens, n_new, window=window).reshape(q.shape)
        else:
            out = OPS.decode_attention(q, k, v, lens, n_new, c["slots"], 1.0 / math.sqrt(max(d, 1)), c["window"])

    note("decode_attention", c)
    err = raises(call)
    assert all(map(same_bits, saved, (q, kbuf, vbuf, lens, n_new))), f"an argument changed: {c}"
    tally("decode_attention", err is None)
    assert (err is None) == valid, f"valid={valid} but the call {'raised ' + repr(err) if err else 'ran'}: {c}"
    if err is None:
        T = c["slots"]
        qr = q.double().reshape(B, H * (M // T), T, d).numpy()
        want = np.zeros((B, H, M, d)) if S == 0 else attention_vectorised(  # no key: every slot is empty
            qr, k.double().numpy(), v.double().numpy(), np.array(c["lens"][:B]), np.array(c["n_new"][:B]),
            window=c["window"] or None,
        ).reshape(B, H, M, d)
        tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[c["q_dtype"]]
        np.testing.assert_allclose(out.double().numpy(), want, atol=tol, rtol=tol, equal_nan=True, err_msg=str(c))


@st.composite
def layers_case(draw):
    bad = breaks(draw, ["L", "Hkv", "G", "d", "inner", "n", "lens", "after", "read_len", "dtype", "kv_dtype", "layout",
                        "weight", "count", "windows"])
    max_len = draw(st.integers(1, 10))
    n = draw(length if "n" in bad else st.integers(0, 1))
    lens = draw(length if "lens" in bad or n not in (0, 1) else st.integers(0, max_len - n))
    floor = max(1, lens + n) if -(10**6) < lens + n <= max_len else 1
    return dict(
        L=0 if "L" in bad else draw(st.integers(1, 2)), Hkv=0 if "Hkv" in bad else draw(st.integers(1, 2)),
        G=draw(st.sampled_from([0, 65])) if "G" in bad else draw(st.integers(1, 3)),
        d=draw(head_dim if "d" in bad else st.sampled_from([16, 32, 48, 64, 80, 96])), D=draw(st.sampled_from([8, 32])),
        inner=0 if "inner" in bad else draw(st.sampled_from([16, 24])), max_len=max_len, n=n, lens=lens,
        after_delta=draw(st.sampled_from([1, -1, 10**9])) if "after" in bad else 0,
        read_len=draw(st.one_of(st.integers(-1, 12), length)) if "read_len" in bad else draw(
            st.integers(min(floor, max_len), max_len)),
        dtype=draw(st.sampled_from([torch.float64, torch.float16] if "dtype" in bad else [torch.float32,
                                                                                           torch.bfloat16])),
        kv_dtype=torch.float64 if "kv_dtype" in bad else draw(st.sampled_from([None, None, *KERNEL_FLOATS])),
        layout=draw(st.sampled_from(["transposed"] if "layout" in bad else ["dense", "dense", "padded"])),
        bad_weight=draw(st.integers(0, 8)) if "weight" in bad else None,
        bad_kind=draw(st.sampled_from(["rows", "dtype", "transposed", "layer1_rows"])),
        extra_weight=draw(st.sampled_from([-1, 1])) if "count" in bad else 0,
        # per-layer sliding windows (0: none; [] no layer slides); refused: one too many, or a negative one
        windows=draw(st.sampled_from(["extra", "negative"])) if "windows" in bad else draw(
            st.sampled_from(["none", "some"])),
    )


def layers_valid(c: dict) -> bool:
    d, max_len, n, kv = c["d"], c["max_len"], c["n"], c["kv_dtype"] or c["dtype"]
    model_ok = c["dtype"] == torch.float32 or (c["dtype"] == torch.bfloat16 and cpu_kernel.bf16_rows())
    lens_after = c["lens"] + n + c["after_delta"]
    return (
        model_ok and kv in KERNEL_FLOATS and c["L"] >= 1 and c["Hkv"] >= 1 and 1 <= c["G"] <= 64
        and d in cpu_kernel.head_dims() and c["inner"] >= 1 and c["layout"] != "transposed"
        and c["bad_weight"] is None and c["extra_weight"] == 0 and 1 <= c["read_len"] <= max_len
        and n in (0, 1) and 0 <= c["lens"] <= max_len - n and lens_after == c["lens"] + n
        and lens_after <= c["read_len"] and c["windows"] in ("none", "some")
    )


@settings(max_examples=int(sys.argv[1]) if len(sys.argv) > 1 else 100, deadline=None, derandomize=True,
          database=None, suppress_health_check=list(HealthCheck))
@given(layers_case())
def check_layers(c: dict) -> None:
    gen = torch.Generator().manual_seed(1)
    L, Hkv, d, D, inner, dtype = c["L"], c["Hkv"], c["d"], c["D"], c["inner"], c["dtype"]
    Nq, Nkv = Hkv * c["G"] * d, Hkv * d
    shapes = [(D,), (Nq, D), (Nkv, D), (Nkv, D), (D, Nq), (D,), (inner, D), (inner, D), (D, inner)]
    weights = [(torch.randn(s, generator=gen) * 0.2).to(dtype) for _ in range(L) for s in shapes]
    if c["bad_weight"] is not None and weights:
        i = c["bad_weight"] + (9 if c["bad_kind"] == "layer1_rows" and L > 1 else 0)
        w = weights[i]
        weights[i] = {"rows": lambda: torch.cat([w, w[:1]]), "dtype": lambda: w.double(),
                      "transposed": lambda: w.t() if w.dim() == 2 else w[::2],
                      "layer1_rows": lambda: torch.cat([w, w])}[c["bad_kind"]]()
    if c["extra_weight"] > 0:
        weights.append(weights[0] if weights else torch.zeros(1))
    elif c["extra_weight"] < 0 and weights:
        weights.pop()
    k, kbuf = guarded((L, 1, Hkv, c["max_len"] + 1, d), c["kv_dtype"] or dtype, c["layout"], gen)
    v, vbuf = guarded((L, 1, Hkv, c["max_len"] + 1, d), c["kv_dtype"] or dtype, c["layout"], gen)
    x = torch.randn(1, 1, D, generator=gen).to(dtype)
    cos, sin = (torch.randn(1, 1, 1, max(d // 2, 0), generator=gen).to(dtype) for _ in range(2))
    lens = torch.tensor([c["lens"]])
    n_new = torch.tensor([c["n"]])
    lens_after = torch.tensor([c["lens"] + c["n"] + c["after_delta"]])
    saved_k, saved_v = kbuf.clone(), vbuf.clone()
    note("decode_layers", c)
    windows = {"none": [], "some": [1, 0, 3][:L], "extra": [2] * (L + 1), "negative": [-1] * L}[c["windows"]]
    err = raises(lambda: OPS.decode_layers(x, cos, sin, k, v, lens, n_new, lens_after, c["read_len"], weights, 1e-5,
                                           windows))
    valid = layers_valid(c)
    tally("decode_layers", err is None)
    assert (err is None) == valid, f"valid={valid} but the call {'raised ' + repr(err) if err else 'ran'}: {c}"
    if err is not None:
        assert same_bits(kbuf, saved_k) and same_bits(vbuf, saved_v), f"a refused call wrote the cache: {c}"
        return
    pos = c["lens"] if c["n"] else c["max_len"]  # the slot's row; a padded slot goes to the spare row
    for buf, saved in ((kbuf, saved_k), (vbuf, saved_v)):
        changed = (buf != saved).flatten(0, -3).any(-1).any(0).nonzero().flatten().tolist()  # key-axis rows
        assert set(changed) <= {GUARD + pos}, f"rows {changed} written, only {GUARD + pos} may be: {c}"


@st.composite
def gemv_case(draw):
    bad = breaks(draw, ["w_K", "x_shape", "x_dtype", "w_dtype", "transposed", "rows"])
    K = draw(st.integers(0, 40))
    rows = [draw(st.integers(0, 20))] * 3 if "rows" not in bad else [draw(st.integers(0, 20)) for _ in range(3)]
    return dict(
        op=draw(st.sampled_from(["gemv_bf16", "gemv_bf16_cat3", "gemv_bf16_glu"])), K=K,
        rows=[rows[0], *(draw(st.integers(0, 20)) for _ in range(2))] if "rows" not in bad else rows,
        glu_same=True if "rows" not in bad else draw(st.booleans()),
        w_K=[draw(st.sampled_from([K, K + 1])) if "w_K" in bad else K for _ in range(3)],
        x_shape=draw(st.sampled_from([(2, max(K // 2, 0)), (K + 1,), (K, 1), ()] if "x_shape" in bad else
                                     [(K,), (1, K), (1, 1, K)])),
        x_dtype=draw(st.sampled_from([torch.int64, torch.int32] if "x_dtype" in bad else
                                     [*KERNEL_FLOATS, torch.float64])),
        w_dtype=torch.float32 if "w_dtype" in bad else torch.bfloat16, transposed="transposed" in bad,
    )


def gemv_valid(c: dict, x: torch.Tensor, ws: list[torch.Tensor]) -> bool:
    K = ws[0].shape[1]
    return (
        cpu_kernel.bf16_rows() and c["x_dtype"] in (*KERNEL_FLOATS, torch.float64)
        and all(w.dtype == torch.bfloat16 and w.is_contiguous() and w.shape[1] == K for w in ws)
        and x.dim() >= 1 and x.shape[-1] == K and x.numel() == K
        and (c["op"] != "gemv_bf16_glu" or ws[0].shape[0] == ws[1].shape[0])
    )


@settings(max_examples=int(sys.argv[1]) if len(sys.argv) > 1 else 100, deadline=None, derandomize=True,
          database=None, suppress_health_check=list(HealthCheck))
@given(gemv_case())
def check_gemv(c: dict) -> None:
    gen = torch.Generator().manual_seed(2)
    count = {"gemv_bf16": 1, "gemv_bf16_cat3": 3, "gemv_bf16_glu": 2}[c["op"]]
    rows = list(c["rows"])
    if c["op"] == "gemv_bf16_glu" and c["glu_same"]:
        rows[1] = rows[0]  # gate and up of one size
    ws = [torch.randn(rows[i], c["w_K"][i], generator=gen).to(c["w_dtype"]) for i in range(count)]
    if c["transposed"]:
        ws[0] = ws[0].t().contiguous().t() if ws[0].shape[0] > 1 and ws[0].shape[1] > 1 else ws[0][:, ::2]
    x = torch.randn(c["x_shape"], generator=gen).to(c["x_dtype"])
    saved = [t.clone() for t in (x, *ws)]
    fn = getattr(cpu_kernel, c["op"])
    out = None

    def call() -> None:
        nonlocal out
        out = fn(x, *ws)

    note(c["op"], c)
    err = raises(call)
    assert all(map(same_bits, saved, (x, *ws))), f"an argument changed: {c}"
    valid = gemv_valid(c, x, ws)
    tally(c["op"], err is None)
    assert (err is None) == valid, f"valid={valid} but the call {'raised ' + repr(err) if err else 'ran'}: {c}"
    if err is None:
        xr = x.to(torch.bfloat16).double().flatten()
        prods = [w.double() @ xr for w in ws]
        want = prods[0] * torch.sigmoid(prods[0]) * prods[1] if c["op"] == "gemv_bf16_glu" else torch.cat(prods)
        tol = 1e-3 if c["x_dtype"] in (torch.float32, torch.float64) else 2e-2
        torch.testing.assert_close(out.double(), want, atol=tol * max([1.0, *want.abs().tolist()]), rtol=tol)


def check_quantized() -> None:
    """gemv_q, linear_q and decode_layers_q (tests/support/native_fuzz_quant.py, native_fuzz_linear.py,
    native_fuzz_quant_layers.py), counted and traced here."""
    harness = Harness(note, tally, guarded, same_bits, raises, length)
    examples = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    check_gemv_q_cases(harness, examples)
    check_linear_q_cases(harness, examples)
    check_layers_q_cases(harness, examples, GUARD)


def check_sampling() -> None:
    """top_k_key and top_p_key (tests/support/native_fuzz_sampling.py), counted and traced here."""
    harness = Harness(note, tally, guarded, same_bits, raises, length)
    check_sampling_cases(harness, int(sys.argv[1]) if len(sys.argv) > 1 else 100)


if __name__ == "__main__":
    torch.set_num_threads(1)
    assert cpu_kernel.available(), "the CPU kernels did not build"
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else ["attention", "layers", "gemv", "quant", "sampling"]
    families = {"attention": check_attention, "layers": check_layers, "gemv": check_gemv, "quant": check_quantized,
                "sampling": check_sampling}
    for name in only:
        families[name]()
    for op, (ok, refused) in sorted(counts.items()):
        print(f"{op}: {ok} ran, {refused} refused")
