"""The sampling thresholds' share of tests/support/native_fuzz_worker.py (its "sampling" family): `top_k_key` and
`top_p_key` (csrc/sample_keys.cpp), drawn by hypothesis and run in the worker's process with its helpers (`Harness`).

Keys anywhere in int32 (negative, NaN patterns above +inf's, +inf's itself, zeros, ties), probabilities of any sign,
NaN included, k anywhere in int64, p anywhere in float32; broken calls: other dtypes, ranks, sizes, a transposed
(non-contiguous) key tensor, zero-width rows. Each case's validity is decided from the tensors passed; a valid call
must equal the bisection over the key range (`_largest_key`'s rule stated here in numpy, the masses in float64), an
invalid one must raise and change nothing it was given.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.native_fuzz_quant import Harness

OPS = torch.ops.static_decode_cpu
TOP = 0x7F800000  # +inf's pattern: the largest threshold
KEY = st.one_of(st.integers(0, 64), st.integers(TOP - 4, TOP + 4), st.integers(-(2**31), 2**31 - 1),
                st.sampled_from([0, 1, TOP, 0x7FC00000, -1, 0x3F800000]))


def ref_threshold(keys: np.ndarray, weights: np.ndarray, target: float) -> int:
    """The largest b in [0, TOP] with sum(weights[keys < b]) < target over the keys in [0, TOP] (a bisection's answer:
    the predicate holds at 0 and is monotone)."""
    ok = (keys >= 0) & (keys <= TOP)
    k, w = keys[ok].astype(np.int64), weights[ok].astype(np.float64)
    lo, hi = 0, TOP + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if w[k < mid].sum() < target:
            lo = mid
        else:
            hi = mid
    return lo


@st.composite
def case(draw):
    bad = draw(st.one_of(st.just(set()), st.sets(st.sampled_from(
        ["keys_dtype", "rank", "V0", "rows", "transposed", "row_dtype", "probs_shape", "probs_dtype"]), max_size=2)))
    B = draw(st.integers(0, 3))
    V = 0 if "V0" in bad else draw(st.integers(1, 40))
    return dict(
        op=draw(st.sampled_from(["top_k_key", "top_p_key"])), bad=sorted(bad), B=B, V=V,
        keys=draw(st.lists(KEY, min_size=B * V, max_size=B * V)),
        probs=draw(st.lists(st.floats(-1, 2, width=32) | st.just(float("nan")), min_size=B * V, max_size=B * V)),
        k=draw(st.lists(st.integers(-3, 45) | st.sampled_from([10**12, -(2**63)]), min_size=B + 1, max_size=B + 1)),
        p=draw(st.lists(st.floats(-1, 2, width=32) | st.sampled_from([float("nan"), float("inf"), 1.0]),
                        min_size=B + 1, max_size=B + 1)),
    )


def check_sampling_cases(h: Harness, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case())
    def one(c: dict) -> None:
        B, V, bad = c["B"], c["V"], set(c["bad"])
        keys = torch.tensor(c["keys"], dtype=torch.int64).to(torch.int32).reshape(B, V)
        probs = torch.tensor(c["probs"], dtype=torch.float32).reshape(B, V)
        k = torch.tensor(c["k"][:B], dtype=torch.int64)
        p = torch.tensor(c["p"][:B], dtype=torch.float32)
        if "keys_dtype" in bad:
            keys = keys.to(torch.int64)
        if "rank" in bad:
            keys = keys.reshape(-1)
        if "transposed" in bad and B > 1 and V > 1:
            keys = keys.t().contiguous().t()
        if "rows" in bad:
            k, p = torch.tensor(c["k"], dtype=torch.int64), torch.tensor(c["p"], dtype=torch.float32)
        if "row_dtype" in bad:
            k, p = k.to(torch.int32), p.double()
        if "probs_shape" in bad:
            probs = probs[:, :-1] if V > 0 else probs[:0]
        if "probs_dtype" in bad:
            probs = probs.double()
        args = (keys, k) if c["op"] == "top_k_key" else (keys, probs, p)
        saved = [t.clone() for t in args]
        out: list[torch.Tensor] = []
        h.note(c["op"], c)
        err = h.raises(lambda: out.append(getattr(OPS, c["op"])(*args)))
        assert all(map(h.same_bits, saved, args)), f"an argument changed: {c}"
        row = k if c["op"] == "top_k_key" else p
        valid = (keys.dtype == torch.int32 and keys.dim() == 2 and keys.is_contiguous() and keys.shape[1] > 0
                 and row.dim() == 1 and row.shape[0] == keys.shape[0]
                 and row.dtype == (torch.int64 if c["op"] == "top_k_key" else torch.float32)
                 and (c["op"] == "top_k_key" or (probs.dtype == torch.float32 and probs.shape == keys.shape)))
        h.tally(c["op"], err is None)
        assert (err is None) == valid, f"valid={valid} but the call {'raised ' + repr(err) if err else 'ran'}: {c}"
        if err is not None:
            assert isinstance(err, RuntimeError) and c["op"] in str(err), f"refused by {err!r}: {c}"
            return
        got = out[0].tolist()
        for b in range(B):
            kb = keys[b].numpy()
            if c["op"] == "top_k_key":
                want = 0 if k[b] <= 0 else ref_threshold(kb, np.ones(V), float(k[b]))
            else:
                pb = float(p[b])
                want = 0 if not pb > 0 else TOP if pb >= 1 else ref_threshold(kb, probs[b].numpy(), pb)
            # a NaN probability makes the float64 sums NaN in both: the comparisons then fail alike
            assert got[b] == want, f"row {b}: {got[b]} != {want}: {c}"

    one()
