"""The kernel build says how long it has taken so far (cpu_kernel._ticking), so a build of a minute, inside a first
command's "load" line, never looks like a hang; and it stops saying so when the build ends."""

from __future__ import annotations

import time

import pytest

from static_decode.kernels import cpu_kernel


def test_a_long_body_is_ticked_and_the_ticks_stop_with_it(capsys: pytest.CaptureFixture[str]) -> None:
    with cpu_kernel._ticking("building the CPU kernels", every=0.05):
        time.sleep(0.32)
    lines = capsys.readouterr().err.splitlines()
    assert 3 <= len(lines) <= 7, lines  # one per 0.05 s, not on a terminal: a line each
    assert all(line.startswith("static_decode: building the CPU kernels: ") and line.endswith(" s so far")
               for line in lines), lines
    time.sleep(0.15)
    assert capsys.readouterr().err == ""  # the ticker ended with the body


def test_a_short_body_says_nothing_and_an_error_still_ends_the_ticker(capsys: pytest.CaptureFixture[str]) -> None:
    with cpu_kernel._ticking("building", every=5.0):
        pass
    with pytest.raises(RuntimeError, match="compiler"), cpu_kernel._ticking("building", every=0.05):
        time.sleep(0.12)
        raise RuntimeError("compiler failed")
    err = capsys.readouterr().err
    time.sleep(0.15)
    assert err.count("so far") >= 1 and capsys.readouterr().err == ""
