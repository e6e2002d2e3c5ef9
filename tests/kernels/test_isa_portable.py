"""The portable kernels (DEFAULT: at::vec's generic vectors, no ISA flags; what an ARM machine builds) on every
machine: the kernel tests rerun with DEFAULT forced (tests/support/isa_runs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.isa_runs import run_kernel_tests, skip_unless_lower


@pytest.mark.isa
@skip_unless_lower("DEFAULT")
def test_the_kernel_tests_pass_on_the_portable_build(tmp_path: Path) -> None:
    print("\nDEFAULT:", run_kernel_tests("DEFAULT", tmp_path))
