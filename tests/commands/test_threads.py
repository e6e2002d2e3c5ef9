"""-t/--threads on every command that runs a model, and the default thread count.

Pins: generate, demo, chat, capture-report, perplexity and bench take -t/--threads N (N >= 1, else a usage error
naming the value); the flag sets torch's intra-op threads, which the CPU kernels' at::parallel_for shares; without it
the default is every usable core but one (at least one), and OMP_NUM_THREADS, when set, is left to decide.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from static_decode.commands import args as cli_args
from static_decode.commands import cli

MODEL_COMMANDS = ("generate", "demo", "chat", "capture-report", "bench", "perplexity")


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_model_command_takes_threads(command):
    parser = cli.build_parser()
    assert parser.parse_args([command, "--threads", "3"]).threads == 3
    if command != "bench":  # bench's own flag is long-only
        assert parser.parse_args([command, "-t", "2"]).threads == 2
    assert parser.parse_args([command]).threads is None


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_bad_thread_counts_are_usage_errors(bad, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--threads", bad])
    assert info.value.code == 2 and "expected an int >= 1" in capsys.readouterr().err


def test_the_flag_sets_torchs_threads(keep_threads, monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    rc = cli.main(["generate", "-t", "1", "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--device", "cpu"])
    assert rc == 0 and torch.get_num_threads() == 1, capsys.readouterr().err
    assert cli_args.apply_threads(argparse.Namespace(threads=2)) == 2 and torch.get_num_threads() == 2


@pytest.mark.parametrize(("cores", "want"), [(1, 1), (2, 1), (4, 3), (64, 63)])
def test_the_default_leaves_a_core_free(keep_threads, monkeypatch, cores, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cli_args, "usable_cores", lambda: cores)
    assert cli_args.default_threads() == want
    assert cli_args.apply_threads(argparse.Namespace(threads=None)) == want == torch.get_num_threads()


def test_omp_num_threads_is_left_to_decide(keep_threads, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(cli_args, "usable_cores", lambda: 64)
    assert cli_args.apply_threads(argparse.Namespace(threads=None)) == 1 == torch.get_num_threads()
    assert cli_args.apply_threads(argparse.Namespace(threads=2)) == 2  # the flag still wins
