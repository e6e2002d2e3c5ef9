"""Every ISA's kernels on every machine: the kernels' value tests and native-boundary fuzz run again, in a subprocess,
for each ISA below this CPU's best that it can execute (an AVX-512 machine: AVX2, then the portable build; an
AVX2-only one: the portable build), with torch's `ATEN_CPU_CAPABILITY` forcing the lower ISA, so the kernel builds
for it (`cpu_kernel.capability()` is torch's capability). The run's header names the ISA it built and ran, and the
test checks that header: a run that fell back to this CPU's own ISA fails. The best ISA's tests are the suite's own.

A lower ISA's build is made once per machine and source version, as the best one's is (the first on a 2-vCPU
machine: profiles/RESULTS.md, "First kernel build").
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
    "tests/kernels/test_native_boundary.py", "tests/kernels/test_native_fuzz.py",
    "tests/model/test_fused_decode.py", "tests/model/test_fused_quant.py", "tests/model/test_linear_quant.py",
    "tests/model/test_window_fused.py", "tests/model/test_fused_projections.py", "tests/model/test_kv_int8_model.py",
    "tests/steps/test_sample_keys.py",
)


def lower_isas(best: str) -> tuple[str, ...]:
    """The ISAs below `best` (a CPU's own) that a CPU with it executes."""
    return ISAS[ISAS.index(best) + 1:] if best in ISAS else ()


def test_lower_isas() -> None:
    assert lower_isas("AVX512") == ("AVX2", "DEFAULT")
    assert lower_isas("AVX2") == ("DEFAULT",)
    assert lower_isas("DEFAULT") == ()


HEADER = re.compile(r"^static-decode CPU kernels: (\w+) ", re.M)


# What the kernel tests do that is not the kernels': whole Generators compiled (the capture machinery, tested on this
# CPU's own ISA by the suite; a minute each).
NOT_KERNELS = "not generator and not compiled_greedy and not compiled_steps"


@pytest.mark.parametrize("isa", lower_isas(cpu_kernel.capability()) or [pytest.param(
    "none", marks=pytest.mark.skip(reason="this CPU runs only the portable build, which the suite's own tests ran"))])
def test_the_kernel_tests_pass_with_a_lower_isa_forced(isa: str, tmp_path: Path) -> None:
    """The kernel tests, run with `isa` forced: all pass, and the run says it built and ran `isa`. Inductor's cache
    is the run's own: torch 2.13 reuses an FX graph compiled under another ATEN_CPU_CAPABILITY (its key leaves the
    capability out), and such a graph computed wrong values here."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": isa.lower(), "OMP_NUM_THREADS": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=-ra", "-k", NOT_KERNELS,
         *KERNEL_TESTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )
    out = proc.stdout + proc.stderr
    assert HEADER.findall(proc.stdout)[:1] == [isa], out[-3000:]
    print(f"\n{isa}: {out.strip().splitlines()[-1]}")
    assert proc.returncode == 0, out[-6000:]
    assert re.search(r"\d+ passed", proc.stdout), out[-3000:]
