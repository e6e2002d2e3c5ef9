"""The `static-decode` command line: generate and demo print what the Generator produces plus a timing line.

Pins: --prompt-ids and --prompt (through the checkpoint's tokenizer) give the Generator's tokens; the timing
summary goes to stderr; user errors exit with status 2 and a message naming the problem, not a traceback;
`demo` uses the embedded default model; subcommands from other modules register through `add_parser`;
`python -m static_decode` works.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from static_decode import Generator, load_model
from static_decode.checkpoints.loading import default_model_path
from static_decode.commands import cli, generate
from tests.support.checkpoints import byte_tokenizer
from tests.support.cli import PROMPT_IDS, run


def test_generate_prompt_ids(plain, capsys):
    rc, out, err = run(
        capsys,
        "generate",
        "--model",
        str(plain),
        "--prompt-ids",
        "3,1,4,1,5,9,2,6",
        "--max-new-tokens",
        "12",
        "--chunk-size",
        "4",
        "--device",
        "cpu",
    )
    assert rc == 0
    expected = Generator(load_model(plain), max_len=20).generate(PROMPT_IDS, 12)
    assert out.splitlines() == ["prompt ids: 3,1,4,1,5,9,2,6", "new ids: " + " ".join(map(str, expected))]
    assert "load" in err and "prefill" in err and "ms per decoded token" in err and "tokens/s" in err


def test_generate_text_through_the_tokenizer(texty, capsys):
    rc, out, _ = run(
        capsys,
        "generate",
        "--model",
        str(texty),
        "--prompt",
        "def f(x):",
        "--max-new-tokens",
        "10",
        "--temperature",
        "0.9",
        "--seed",
        "3",
        "--read-every",
        "3",
    )
    assert rc == 0
    tok = byte_tokenizer()
    ids = Generator(load_model(texty), max_len=19).generate(tok.encode("def f(x):").ids, 10, temperature=0.9, seed=3)
    assert out == "def f(x):" + tok.decode(ids) + "\n"


def test_demo_runs_generate_on_the_embedded_model(texty, capsys, monkeypatch):
    monkeypatch.setattr(generate, "default_model_path", lambda: texty)
    rc, out, err = run(capsys, "demo", "--max-new-tokens", "8")
    assert rc == 0 and out.startswith(generate.DEMO_PROMPT) and "tokens/s" in err


@pytest.mark.skipif(not (default_model_path() / "model.safetensors").is_file(), reason="not trained yet")
def test_demo_with_the_shipped_model(capsys):
    rc, out, _ = run(capsys, "demo", "--max-new-tokens", "40")
    assert rc == 0 and out.startswith("def ") and len(out) > 20


def test_user_errors_exit_2_with_a_message(plain, tmp_path, capsys):
    for argv, word in [
        (["generate", "--model", str(plain), "--prompt", "hi"], "tokenizer.json"),
        (["generate", "--model", str(tmp_path / "none"), "--prompt-ids", "1"], "no checkpoint"),
        (["generate", "--model", str(plain)], "--prompt"),
        (["generate", "--model", str(plain), "--prompt-ids", "1", "--max-new-tokens", "0"], "max-new-tokens"),
        (["generate", "--model", str(plain), "--prompt-ids", "1,2", "--max-len", "3"], "max_len=3"),
        (["generate", "--model", str(plain), "--prompt-ids", "1", "--dtype", "float8"], "float8"),
        (["generate", "--model", str(plain), "--prompt-ids", "1", "--top-p", "1.5"], "top_p"),
    ]:
        rc, _, err = run(capsys, *argv)
        assert rc == 2 and word in err and "Traceback" not in err, (argv, err)
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--prompt-ids", "1,x"])
    assert info.value.code == 2 and "comma-separated" in capsys.readouterr().err


@pytest.mark.parametrize("how", [["--speculate", "prompt-lookup:3:2"], ["--draft-model", "SELF"],
                                 ["--speculate", "draft:2", "--draft-model", "SELF"]])
def test_generate_with_speculation_prints_the_plain_tokens(plain, capsys, how):
    argv = [str(plain) if a == "SELF" else a for a in how]
    rc, out, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "3,1,4,1,3,1,4", "--max-new-tokens",
                       "16", "--device", "cpu", *argv)
    assert rc == 0, err
    expected = Generator(load_model(plain), max_len=40).generate([3, 1, 4, 1, 3, 1, 4], 16)
    assert out.splitlines()[1] == "new ids: " + " ".join(map(str, expected))
    assert "verify steps at" in err and "tokens per step" in err


def test_speculation_argument_errors(plain, capsys):
    base = ["generate", "--model", str(plain), "--prompt-ids", "1,2", "--device", "cpu"]
    for extra, word in [
        (["--speculate", "draft"], "--draft-model"),
        (["--speculate", "prompt-lookup", "--draft-model", str(plain)], "--draft-model goes with"),
        (["--speculate", "prompt-lookup:0"], "tokens must be"),
        (["--draft-model", str(plain / "nope")], "no checkpoint"),
    ]:
        rc, _, err = run(capsys, *base, *extra)
        assert rc == 2 and word in err and "Traceback" not in err, (extra, err)
    for bad in ("lookup", "prompt-lookup:x", "draft:1:2", "prompt-lookup:1:2:3"):
        with pytest.raises(SystemExit):
            cli.main([*base, "--speculate", bad])
        assert "prompt-lookup[:TOKENS[:NGRAM]]" in capsys.readouterr().err


def test_compile_flag_is_boolean_optional():
    parser = cli.build_parser()
    assert parser.parse_args(["generate", "--compile"]).compile is True
    assert parser.parse_args(["generate", "--no-compile"]).compile is False
    assert parser.parse_args(["demo"]).compile is False


def test_other_modules_register_subcommands(monkeypatch, capsys):
    plugin = types.ModuleType("fake_plugin")

    def add_parser(subparsers):
        p = subparsers.add_parser("hello", help="say hello")
        p.add_argument("--name", default="world")
        p.set_defaults(run=lambda args: print(f"hello {args.name}") or 0)

    plugin.add_parser = add_parser
    monkeypatch.setitem(sys.modules, "fake_plugin", plugin)
    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "fake_plugin"))
    assert run(capsys, "hello", "--name", "you")[:2] == (0, "hello you\n")


def test_a_listed_command_module_that_is_missing_raises(monkeypatch):
    """Nothing is skipped silently: a module named in COMMAND_MODULES that is not there (a file left out of a
    wheel, a typo) fails the parser, naming it."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "static_decode.commands.no_such_command"))
    with pytest.raises(ModuleNotFoundError, match="static_decode.commands.no_such_command"):
        cli.build_parser()
    monkeypatch.setitem(sys.modules, "no_add_parser", types.ModuleType("no_add_parser"))
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("no_add_parser",))
    with pytest.raises(AttributeError, match="add_parser"):
        cli.build_parser()


def test_python_dash_m():
    done = subprocess.run(
        [sys.executable, "-m", "static_decode", "--help"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],  # the checkout, installed or not
        check=False,
    )
    assert done.returncode == 0 and "generate" in done.stdout and "demo" in done.stdout


def test_generate_long_chunk_flag(plain, capsys):
    base = ["generate", "--model", str(plain), "--prompt-ids", "3,1,4,1,5,9,2,6,5,3", "--max-new-tokens", "6",
            "--chunk-size", "2", "--device", "cpu"]
    expected = Generator(load_model(plain), max_len=16, long_chunk=0).generate([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 6)
    for long in ("4", "0"):  # 10 prompt tokens: two long chunks of 4 then one of 2; or five of 2
        rc, out, err = run(capsys, *base, "--long-chunk", long)
        assert rc == 0, err
        assert out.splitlines()[1] == "new ids: " + " ".join(map(str, expected))
    rc, _, err = run(capsys, *base, "--long-chunk", "2")
    assert rc == 2 and "long_chunk=2 must exceed chunk_size=2" in err and "Traceback" not in err


