"""The AVX2 kernels on every machine that executes them: the kernel tests rerun with AVX2 forced
(tests/support/isa_runs.py). On an AVX-512 machine this is what a Zen 3 or an Intel Core without AVX-512 runs; on an
AVX2-only machine the suite's own kernel tests are the AVX2 ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.isa_runs import lower_isas, run_kernel_tests, skip_unless_lower


def test_lower_isas() -> None:
    assert lower_isas("AVX512") == ("AVX2", "DEFAULT")
    assert lower_isas("AVX2") == ("DEFAULT",)
    assert lower_isas("DEFAULT") == ()


@pytest.mark.isa
@skip_unless_lower("AVX2")
def test_the_kernel_tests_pass_on_avx2(tmp_path: Path) -> None:
    print("\nAVX2:", run_kernel_tests("AVX2", tmp_path))
