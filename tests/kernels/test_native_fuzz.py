"""Fuzzing the CPU kernels' ops and wrappers (hypothesis) in a subprocess: tests/support/native_fuzz_worker.py draws the
cases (tests/support/native_fuzz_quant.py those of the quantized ops) and checks each against a validity rule of its own
and the float64 reference (the quantized layers: the eager ones); a crash ends that process with a signal, and this
test fails naming the case it was running.

Before the ops checked their arguments (csrc/checks.h) this failed at once: an empty `lens` for a batch of one
segfaulted decode_attention, zero layers segfaulted decode_layers, and gemv_bf16 ran an x [0, 1] against a
[0, 0] weight.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from static_decode.kernels import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = 150  # per op (and a sweep of the quantized ops' broken forms): ~25 s here, each case one call


@pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernels did not build here")
def test_any_call_computes_the_reference_or_is_refused_without_a_trace(tmp_path: Path) -> None:
    trail = tmp_path / "trail.txt"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.native_fuzz_worker", str(EXAMPLES), str(trail)], cwd=ROOT,
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    last = trail.read_text().splitlines()[-1:] if trail.exists() else []
    assert proc.returncode == 0, (
        f"exit {proc.returncode} (negative: killed by that signal) during {last}\n{proc.stdout[-4000:]}"
        f"{proc.stderr[-4000:]}"
    )
    counts = dict(re.findall(r"^(\w+): (\d+ ran, \d+ refused)$", proc.stdout, re.M))
    ops = ["decode_attention", "decode_layers", "gemv_bf16", "gemv_bf16_cat3", "gemv_bf16_glu", "decode_layers_q",
           "gemv_q", "linear_q", "top_k_key", "top_p_key"]
    assert set(counts) == set(ops), proc.stdout
    ran = {op: int(counts[op].split()[0]) for op in ops}
    refused = {op: int(counts[op].split()[2]) for op in ops}
    assert all(refused.values()), counts  # every op met bad calls
    # and good ones, compared with the reference (the gemv ops refuse everything without AVX512-BF16 or AVX2)
    assert all(ran[op] > 10 for op in ("decode_attention", "decode_layers", "decode_layers_q", "gemv_q", "linear_q",
                                       "top_k_key", "top_p_key")), counts
    assert not cpu_kernel.bf16_rows() or all(ran[op] for op in ops[2:5]), counts
