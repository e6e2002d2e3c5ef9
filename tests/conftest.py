"""Suite-wide settings: one intra-op thread, and no structured compile trace under pytest's log capture.

The test models are tiny; with two OpenMP threads on a 2-core machine every small op pays a fork/join and
spin-wait (measured ~5x slower per decode step here), so the suite runs single-threaded. Timings belong in
profiles/, not here.
"""

import logging
import os

import pytest
import torch

torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    """Build the CPU kernels once, in the controller, before any xdist worker starts: otherwise the first workers
    (and the subprocesses their tests spawn) race each other for the build and wait on its lock."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        from static_decode.kernels import cpu_kernel

        cpu_kernel.available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The forced-ISA kernel runs first (each a few minutes in one file of its own): xdist's loadfile hands files
    out in this order, so they run beside the rest instead of after it."""
    items.sort(key=lambda item: item.get_closest_marker("isa") is None)


@pytest.fixture(scope="session", autouse=True)
def _no_trace_log_capture():
    """pytest's log capture makes torch build its structured compile trace (graph dumps): ~2x compile time."""
    log = logging.getLogger("torch.__trace")
    saved, log.propagate = log.propagate, False
    yield
    log.propagate = saved


def pytest_report_header(config: pytest.Config) -> str:
    """The ISA this run's CPU kernels are built for and run (torch's capability, forced lower by
    ATEN_CPU_CAPABILITY), with the optional instructions they use: tests/support/isa_runs.py reads it."""
    from static_decode.kernels import cpu_kernel

    return (f"static-decode CPU kernels: {cpu_kernel.capability()} (AVX512-BF16 dot: {cpu_kernel.bf16_dot()}, "
            f"AVX512-VNNI: {cpu_kernel.int8_dot()}, bfloat16 rows: {cpu_kernel.bf16_rows()}, "
            f"int8 row codes: {cpu_kernel.int8_codes(8)})")
