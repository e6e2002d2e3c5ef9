"""The kernel tests run again with a lower ISA forced (tests/kernels/test_isa_avx2.py, test_isa_portable.py).

`run_kernel_tests(isa, tmp)` runs KERNEL_TESTS in a subprocess with torch's `ATEN_CPU_CAPABILITY` set to `isa`, so
the kernels build for it (`cpu_kernel.capability()` is torch's capability), and checks that the run's header
(tests/conftest.py's report header) names that ISA: a run that fell back to the CPU's own ISA fails. The run has an
inductor cache of its own: torch 2.13 reuses an FX graph compiled under another ATEN_CPU_CAPABILITY (its key leaves
the capability out), and such a graph computed wrong values in tests. Inductor's own kernels are compiled for the
forced ISA too (TORCHINDUCTOR_CPP_MARCH, MARCH): with its default -march=native on an AVX-512 machine, its AVX2
kernels (at::vec's AVX2 types beside the compiler's AVX-512 macros) indexed out of bounds in a compiled speculative
step, which the same step compiled for -march=znver3 (a Zen 3's native) did not.
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
ISAS = ("AVX512", "AVX2", "DEFAULT")  # what the kernels are built for, best first (cpu_kernel._ISA_FLAGS, portable)
# The kernel tests: the ops' values against float64 or eager references, the fused layers, the quantized products,
# the sampling keys, the native boundary and its fuzz (what differs by ISA is compiled code, so all of it reruns).
KERNEL_TESTS = (
    "tests/kernels/test_cpu_kernel.py", "tests/kernels/test_kv_int8_kernel.py", "tests/kernels/test_window_kernel.py",
    "tests/kernels/test_native_boundary.py", "tests/kernels/test_native_fuzz.py", "tests/kernels/test_gguf_kernel.py",
    "tests/model/test_fused_decode.py", "tests/model/test_fused_quant.py", "tests/model/test_linear_quant.py",
    "tests/model/test_window_fused.py", "tests/model/test_fused_projections.py", "tests/model/test_kv_int8_model.py",
    "tests/model/test_fused_gguf.py",
    "tests/steps/test_sample_keys.py",
)
# What the kernel tests do that is not the kernels': graphs compiled by inductor around the ops (the capture
# machinery, tested on this CPU's own ISA by the suite).
NOT_KERNELS = "not compile"
MARCH = {"AVX2": "x86-64-v3", "DEFAULT": "x86-64"}  # gcc's -march for inductor's kernels under a forced ISA
HEADER = re.compile(r"^static-decode CPU kernels: (\w+) ", re.M)


def lower_isas(best: str) -> tuple[str, ...]:
    """The ISAs below `best` (a CPU's own) that a CPU with it executes."""
    return ISAS[ISAS.index(best) + 1:] if best in ISAS else ()


def skip_unless_lower(isa: str) -> pytest.MarkDecorator:
    """Run a forced-`isa` test only where `isa` is below this CPU's own ISA (its own ran in the suite itself)."""
    best = cpu_kernel.capability()
    why = (f"{isa} is this CPU's own ISA: the suite's kernel tests ran it" if isa == best
           else f"this CPU ({best}) cannot execute {isa}")
    return pytest.mark.skipif(isa not in lower_isas(best), reason=why)


def run_kernel_tests(isa: str, tmp: Path) -> str:
    """Run KERNEL_TESTS with `isa` forced; assert the run built and ran `isa` and passed. Returns its summary line."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa.lower(), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), "TORCHINDUCTOR_CPP_MARCH": MARCH[isa]}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=-ra", "-k", NOT_KERNELS,
         *KERNEL_TESTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )
    out = proc.stdout + proc.stderr
    assert HEADER.findall(proc.stdout)[:1] == [isa], out[-3000:]
    assert proc.returncode == 0, out[-6000:]
    assert re.search(r"\d+ passed", proc.stdout), out[-3000:]
    return out.strip().splitlines()[-1]
