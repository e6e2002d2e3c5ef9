"""Calling the command line in-process: `run` returns its exit status, stdout and stderr."""

from __future__ import annotations

import pytest

from static_decode.commands import cli

PROMPT_IDS = [3, 1, 4, 1, 5, 9, 2, 6]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err
