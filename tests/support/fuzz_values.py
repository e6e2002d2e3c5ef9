"""Broadly drawn values for the fuzz tests (hypothesis): ints (negative, huge like 2**70, numpy ints of every width),
floats (nan, inf, denormals), junk (None, bools, strings, bytes, containers, tensors), and the settings of a fuzz
test. V is the tiny models' vocabulary, so that some drawn ids are valid and some just past it."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

V = 96
INT64_MAX = 2**63 - 1


def fuzz(examples: int) -> settings:
    """Hypothesis settings of a fuzz test: `examples` cases, no per-case deadline (the CPU is shared)."""
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


HUGE = [2**31, 2**32, INT64_MAX, 2**63, 2**64 - 1, 2**64, 2**70, 10**30, -(2**63), -(2**70)]
ints = st.one_of(st.integers(-3, 100), st.sampled_from(HUGE), st.integers())
np_ints = st.one_of(
    st.integers(-128, 127).map(np.int8),
    st.integers(0, 255).map(np.uint8),
    st.integers(-(2**31), 2**31 - 1).map(np.int32),
    st.integers(-(2**63), INT64_MAX).map(np.int64),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.integers(0, V + 4).map(np.int64),
)
floats = st.one_of(
    st.floats(),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 1e-45, 1e-310, 1e29, 1e30, 1e300, math.nan, math.inf, -math.inf]),
    st.floats(-2, 2).map(np.float32),
    st.floats(-2, 2).map(np.float64),
)
junk = st.one_of(
    st.none(), st.booleans(), st.text(max_size=3), st.binary(max_size=3), st.just(object()), st.just({}),
    st.just(()), st.just([]), st.just(range(3)), st.just(torch.tensor(3)), st.complex_numbers(max_magnitude=3),
)
scalars = st.one_of(ints, np_ints, floats, junk)


@st.composite
def corrupted(draw, valid: dict, bad: dict) -> dict:
    """`valid`'s arguments with 0, 1 or 2 of those named in `bad` drawn from `bad` instead."""
    n = draw(st.integers(0, 2))
    names = draw(st.permutations(sorted(bad)))[:n]
    event(f"corrupted arguments: {n}")
    return {k: draw(bad[k] if k in names else s) for k, s in valid.items()}
