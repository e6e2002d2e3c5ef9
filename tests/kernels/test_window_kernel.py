"""The CPU decode kernel (csrc/decode_attention.cpp) with a sliding window, against the float64 reference.

Pins: the op's `window` argument (0: none) gives the reference's windowed attention over ragged rows, several slots
and cache dtypes, across work-item splits (windows longer than one split of 512 keys); keys before each row's
window are never read (NaN written there does not reach the output); a window longer than every row is no window;
and hostile windows are refused by name before anything is read, in a subprocess (a crash fails the test, not
pytest).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from static_decode.core.reference import attention_vectorised
from static_decode.kernels import cpu_kernel

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")
ROOT = Path(__file__).resolve().parents[2]
OPS = torch.ops.static_decode_cpu


def case(rng: np.random.Generator, B: int, hkv: int, G: int, T: int, S: int, d: int):
    """Random q [B, Hq, T, d], k/v [B, Hkv, S, d] (float64) and ragged lengths: each row's n_new in 0..T."""
    q = rng.standard_normal((B, hkv * G, T, d))
    k, v = rng.standard_normal((2, B, hkv, S, d))
    n_new = rng.integers(0, T + 1, size=B)
    lens = np.array([int(rng.integers(max(n, 1), S + 1)) if n else int(rng.integers(0, S + 1)) for n in n_new])
    return q, k, v, lens, n_new


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("window", [1, 3, 37, 700])
def test_windowed_kernel_matches_the_reference(dtype: torch.dtype, atol: float, window: int) -> None:
    rng = np.random.default_rng(window)
    for B, hkv, G, T, S, d in ((3, 2, 3, 1, 90, 16), (2, 1, 4, 4, 1500, 64), (1, 3, 1, 7, 1200, 32)):
        q, k, v, lens, n_new = case(rng, B, hkv, G, T, S, d)
        qt, kt, vt = (torch.from_numpy(x).to(dtype) for x in (q, k, v))
        out = cpu_kernel.decode_attention(qt, kt, vt, torch.from_numpy(lens), torch.from_numpy(n_new), window=window)
        want = attention_vectorised(*(x.double().numpy() for x in (qt, kt, vt)), lens, n_new, window=window)
        np.testing.assert_allclose(out.double().numpy(), want, atol=atol, rtol=0)
        for b in range(B):
            assert not out[b, :, n_new[b]:].any(), "padded slots must be exact zeros"


def test_keys_before_the_window_are_never_read() -> None:
    """NaN in K and V before each row's oldest visible key (its slot 0's window): the output is the reference's over
    clean values, with no NaN."""
    rng = np.random.default_rng(0)
    W, T = 50, 3
    q, k, v, _, _ = case(rng, 3, 2, 2, T, 2000, 16)
    lens, n_new = np.array([2000, 1234, 40]), np.array([3, 1, 2])
    want = attention_vectorised(q, k, v, lens, n_new, window=W)
    kp, vp = k.copy(), v.copy()
    for b in range(3):
        first = max(0, lens[b] - n_new[b] - W + 1)
        kp[b, :, :first] = vp[b, :, :first] = np.nan
    out = cpu_kernel.decode_attention(*(torch.from_numpy(x).float() for x in (q, kp, vp)), torch.from_numpy(lens),
                                      torch.from_numpy(n_new), window=W)
    assert not torch.isnan(out).any()
    np.testing.assert_allclose(out.double().numpy(), want, atol=2e-5, rtol=0)
    # Without the window the same poisoned cache gives NaN: the keys are there, and only the window skips them.
    assert torch.isnan(cpu_kernel.decode_attention(*(torch.from_numpy(x).float() for x in (q, kp, vp)),
                                                   torch.from_numpy(lens), torch.from_numpy(n_new))).any()


def test_a_window_past_every_row_is_no_window() -> None:
    rng = np.random.default_rng(1)
    q, k, v, lens, n_new = (torch.from_numpy(x) for x in case(rng, 2, 2, 2, 2, 300, 32))
    q, k, v = q.float(), k.float(), v.float()
    scale = 1 / math.sqrt(32)
    qf = q.reshape(2, 2, 4, 32)
    none = OPS.decode_attention(qf, k, v, lens, n_new, 2, scale)
    for window in (300, 2**40, 2**63 - 1):
        assert torch.equal(OPS.decode_attention(qf, k, v, lens, n_new, 2, scale, window), none)
    assert torch.equal(OPS.decode_attention(qf, k, v, lens, n_new, 2, scale, 0), none)


HOSTILE = """
import torch
from static_decode.kernels import cpu_kernel
assert cpu_kernel.available()
OPS = torch.ops.static_decode_cpu
q, k = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 8, 16)
lens, n = torch.tensor([5]), torch.tensor([1])
saved = k.clone()
def say(name, fn):
    try:
        fn()
        print(name, "ran")
    except Exception as err:
        print(name, type(err).__name__, str(err).splitlines()[0])
for w in (-1, -(2**63)):
    say(f"attention {w}", lambda: OPS.decode_attention(q, k, k, lens, n, 1, 0.25, w))
say("wrapper 0", lambda: cpu_kernel.decode_attention(q, k, k, lens, n, window=0))
x, cs = torch.randn(1, 1, 32), torch.randn(1, 1, 1, 8)
kv = torch.randn(2, 1, 2, 9, 16)
kv_saved = kv.clone()
ws = []
for _ in range(2):
    for shape in ((32,), (64, 32), (32, 32), (32, 32), (32, 64), (32,), (48, 32), (48, 32), (32, 48)):
        ws.append(torch.randn(shape) * 0.2)
args = (x, cs, cs, kv, kv, torch.tensor([4]), n, torch.tensor([5]), 8, ws, 1e-5)
say("layers 3 windows", lambda: OPS.decode_layers(*args, [4, 4, 4]))
say("layers negative", lambda: OPS.decode_layers(*args, [4, -7]))
print("unchanged", torch.equal(k, saved) and torch.equal(kv, kv_saved))
say("layers ok", lambda: OPS.decode_layers(*args, [4, 0]))
"""


def test_hostile_windows_are_refused_by_name() -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(HOSTILE)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "attention -1 RuntimeError decode_attention: window = -1 (0 for no sliding window, else the keys a query " \
           "sees)" in lines
    assert any(line.startswith(f"attention {-(2**63)} RuntimeError decode_attention: window = {-(2**63)}")
               for line in lines), lines
    assert any(line.startswith("wrapper 0 ValueError decode_attention: window must be None or an int >= 1, got 0")
               for line in lines), lines
    assert "layers 3 windows RuntimeError decode_layers: 3 windows for 2 layers (none, or one a layer)" in lines
    assert any(line.startswith("layers negative RuntimeError decode_layers: windows[1] = -7") for line in lines), lines
    assert "layers ok ran" in lines and "unchanged True" in lines
