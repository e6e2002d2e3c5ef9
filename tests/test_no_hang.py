"""No run of the suite can hang: a test that crashes its worker fails and ends the run, and a test stuck in native
code is ended at the per-test time limit.

Each check runs the README's test command (`pytest -q -n auto --dist loadfile`, here `-n 2`) in a temporary copy
of the suite's configuration (pyproject.toml, tests/conftest.py) with one deliberately broken test file beside a
good one, in a subprocess bounded by its own timeout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

GOOD = """
def test_one():
    assert 1 + 1 == 2
"""
CRASH = """
import ctypes

def test_segfaults():
    ctypes.string_at(0)  # a real SIGSEGV in native code, as a peer library's crash would be

def test_after():
    pass
"""
STUCK = """
import ctypes

def test_stuck_in_native_code():
    ctypes.CDLL(None).sleep(3600)  # libc sleep: no Python frame runs, SIGALRM alone would not end it
"""


def _suite(tmp_path: Path, broken: str) -> Path:
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for name in ("__init__.py", "conftest.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path / "tests" / name)
    (tmp_path / "tests" / "test_good.py").write_text(GOOD)
    (tmp_path / "tests" / "test_broken.py").write_text(broken)
    return tmp_path


def _run(root: Path, *extra: str, bound: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
                           "-p", "no:cacheprovider", *extra], cwd=root, capture_output=True, text=True, timeout=bound)
    return proc, time.monotonic() - t0


def test_a_test_that_crashes_its_worker_fails_once_and_the_run_ends(tmp_path):
    proc, took = _run(_suite(tmp_path, CRASH))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "crashed while running 'tests/test_broken.py::test_segfaults'" in out
    assert out.count("FAILED tests/test_broken.py::test_segfaults") == 1, out  # not rerun on a fresh worker
    assert took < 120, took


def test_a_test_stuck_in_native_code_is_ended_at_the_time_limit(tmp_path):
    proc, took = _run(_suite(tmp_path, STUCK), "-o", "timeout=5")  # the suite's limit, shortened for the check
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    # the watchdog dumps the stacks (into the worker's stderr, which xdist does not relay) and ends the worker
    assert "crashed while running 'tests/test_broken.py::test_stuck_in_native_code'" in out, out
    assert "1 failed, 1 passed" in out
    assert 5 < took < 120, took


def test_the_suite_sets_a_time_limit_and_ends_on_a_crash():
    """The limit itself, the watchdog thread (SIGALRM waits for Python code to run) and the crash policy."""
    tomllib = pytest.importorskip("tomllib")
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["timeout_method"] == "thread" and 600 <= ini["timeout"] <= 3600
    assert "--max-worker-restart=0" in ini["addopts"].split()
