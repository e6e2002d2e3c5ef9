"""The command line as a llama.cpp user drives it: threads, system message, stop strings, a prompt file, the
repetition penalty, special tokens, Ctrl-C, `chat` over stdin, piped tables, output paths, numpy scalars.

Pins: each flag equals what the Generator does with the same option; special tokens are hidden unless asked for;
Ctrl-C (even wrapped by a library) is one line and status 130; argument errors are one line and the help hint.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from static_decode import Generator, load_model
from static_decode.checkpoints.loading import default_model_path
from static_decode.commands import cli, generate
from tests.support.checkpoints import byte_tokenizer, hf_llama, save
from tests.support.cli import PROMPT_IDS, run

# ---- the habits of a llama.cpp user: threads, system, stop, prompt file, penalty, special tokens, Ctrl-C -----------

SPECIAL = "<|im_end|>"


@pytest.fixture(scope="module")
def special(tmp_path_factory):
    """A byte-level checkpoint whose tokenizer has the special token <|im_end|> (id 256, the EOS), and a model that
    emits it right after the prompt "hello" (its lm_head row is the first greedy token's, scaled up)."""
    import json

    import torch

    from tests.support.checkpoints import hf_greedy

    tok = byte_tokenizer()
    tok.add_special_tokens([SPECIAL])
    hf = hf_llama(seed=44, vocab=257, eos=256)
    ids = tok.encode("hello").ids
    first = hf_greedy(hf, ids, 1, eos=None)[0]
    with torch.no_grad():
        hf.lm_head.weight[256] = 1.5 * hf.lm_head.weight[first]
    assert hf_greedy(hf, ids, 3, eos=256) == [256]  # the test depends on it
    path = save(hf, tmp_path_factory.mktemp("special"))
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIAL}))
    assert tok.token_to_id(SPECIAL) == 256
    return path


@pytest.mark.parametrize("chat", [[], ["--chat"]])
def test_special_tokens_are_hidden_unless_asked_for(special, capsys, chat):
    base = ["generate", "--model", str(special), "--prompt", "hello", "--max-new-tokens", "4", *chat]
    rc, out, err = run(capsys, *base)
    assert rc == 0, err
    shown = "" if chat else "hello"  # --chat shows only the reply
    assert out == shown + "\n"
    rc, out, _ = run(capsys, *base, "--show-special")
    assert rc == 0 and out == shown + SPECIAL + "\n"


def test_timing_line_shows_load_prefill_and_per_token_time(plain, capsys):
    rc, _, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "3,1,4,1,5,9,2,6",
                     "--max-new-tokens", "12", "--device", "cpu")
    assert rc == 0
    line = err.strip().splitlines()[-1]
    assert re.fullmatch(r"load \d+\.\d\d s, prefill \d+\.\d ms \(8 tokens\), \d+\.\d\d ms per decoded token "
                        r"\(11 tokens\), \d+\.\d tokens/s \(12 new tokens\)", line), line


def test_timing_line_puts_speculative_steps_in_brackets(plain, capsys):
    rc, _, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "3,1,4,1,3,1,4,1,3,1,4",
                     "--max-new-tokens", "16", "--device", "cpu", "--speculate", "prompt-lookup:3:2")
    assert rc == 0
    m = re.search(r"ms per decoded token \(15 tokens \[(\d+) steps, (\d+) verify steps at", err)
    assert m is not None, err
    assert int(m.group(1)) < 15  # what the brackets are for: fewer steps than tokens


def test_stop_string_cuts_the_output(texty, capsys):
    base = ["generate", "--model", str(texty), "--prompt", "def f(x):", "--max-new-tokens", "24"]
    rc, full, _ = run(capsys, *base)
    reply = full[len("def f(x):") : -1]
    assert rc == 0 and len(reply) >= 8
    stop = reply[5:8]
    cut = reply[: reply.index(stop)]
    rc, out, err = run(capsys, *base, "--stop", stop)
    assert rc == 0, err
    assert out == "def f(x):" + cut + "\n" and "stopped at a --stop string" in err
    rc, out, _ = run(capsys, *base, "--stop", "never in it \x01", "--stop", stop)  # either of several
    assert out == "def f(x):" + cut + "\n"


def test_prompt_file_equals_prompt(texty, tmp_path, capsys, monkeypatch):
    import io

    f = tmp_path / "prompt.txt"
    f.write_text("def g(y):\n    return")
    base = ["generate", "--model", str(texty), "--max-new-tokens", "8"]
    want = run(capsys, *base, "--prompt", f.read_text())[1]
    assert run(capsys, *base, "-f", str(f))[1] == want
    monkeypatch.setattr(sys, "stdin", io.StringIO(f.read_text()))
    assert run(capsys, *base, "--prompt-file", "-")[1] == want
    rc, _, err = run(capsys, *base, "-f", str(tmp_path / "missing.txt"))
    assert rc == 2 and "missing.txt" in err and "Traceback" not in err


def test_repeat_penalty_flag_equals_the_generator(plain, capsys):
    rc, out, _ = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "3,1,4,1,5,9,2,6",
                     "--max-new-tokens", "12", "--repeat-penalty", "1.5")
    assert rc == 0
    want = Generator(load_model(plain), max_len=20).generate(PROMPT_IDS, 12, repeat_penalty=1.5)
    assert want != Generator(load_model(plain), max_len=20).generate(PROMPT_IDS, 12)
    assert out.splitlines()[1] == "new ids: " + " ".join(map(str, want))
    rc, _, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "1", "--repeat-penalty", "0")
    assert rc == 2 and "repeat_penalty" in err


def test_system_message_is_rendered_before_the_prompt(special, capsys):
    from static_decode.text.chat_template import load_chat_template

    rc, out, err = run(capsys, "generate", "--model", str(special), "--system", "be brief. ", "--prompt", "hi",
                       "--max-new-tokens", "6", "--show-special")
    assert rc == 0, err
    tok = byte_tokenizer()
    tok.add_special_tokens([SPECIAL])
    text = load_chat_template(special).render([{"role": "system", "content": "be brief. "},
                                               {"role": "user", "content": "hi"}])
    assert text == "be brief. hi"
    ids = Generator(load_model(special), max_len=40).generate(tok.encode(text).ids, 6)
    assert out == tok.decode(ids, skip_special_tokens=False) + "\n"


def test_max_len_zero_and_a_directory_without_config_are_refused(plain, tmp_path, capsys):
    for value in ("0", "-1"):
        rc, _, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "1,2", "--max-len", value)
        assert rc == 2 and f"--max-len must be >= 1 (or left out for the default), got {value}" in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    for cmd in (["generate", "--prompt-ids", "1"], ["chat"], ["capture-report"]):
        rc, _, err = run(capsys, cmd[0], "--model", str(empty), *cmd[1:])
        assert rc == 2 and f"no config.json in {empty}" in err and "Traceback" not in err, (cmd, err)


def test_demo_says_what_the_toy_model_is(texty, capsys, monkeypatch):
    monkeypatch.setattr(generate, "default_model_path", lambda: texty)
    rc, _, err = run(capsys, "demo", "--max-new-tokens", "4")
    assert rc == 0 and err.startswith(generate.DEMO_NOTE) and "Python-looking text" in err


def _interrupt(argv: list[str], ready: str, where: str, tmp_path: Path, **env: str) -> tuple[int, str, str]:
    """Run the CLI in a subprocess, send SIGINT to its process group (as a terminal's Ctrl-C does) once `ready`
    shows in its stdout or stderr (`where`), and return the status, stdout and stderr (ANSI codes stripped).
    `ready` comes after the CPU kernels are built: a build interrupted halfway would leave its lock behind."""
    import os
    import signal
    import time

    files = {name: tmp_path / f"{name}.txt" for name in ("stdout", "stderr")}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    with open(files["stdout"], "w") as out, open(files["stderr"], "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "static_decode", *argv], stdout=out, stderr=err, env=env,
                                cwd=Path(__file__).resolve().parents[2], start_new_session=True)
        deadline = time.monotonic() + 600
        while ready not in files[where].read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # inside the work now, not at its edge
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
    text = {k: re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", f.read_text()) for k, f in files.items()}
    return rc, text["stdout"], text["stderr"]


@pytest.mark.skipif(not (default_model_path() / "model.safetensors").is_file(), reason="not trained yet")
def test_ctrl_c_during_demo_is_one_line_and_status_130(tmp_path):
    rc, out, err = _interrupt(["demo", "--max-new-tokens", "1500", "--read-every", "1"], "def ", "stdout", tmp_path)
    assert rc == 130, err
    assert err.strip().splitlines() == [generate.DEMO_NOTE, "static-decode demo: interrupted"]
    assert out.startswith("def ")


@pytest.mark.skipif(not (default_model_path() / "model.safetensors").is_file(), reason="not trained yet")
def test_ctrl_c_during_capture_is_one_line_and_status_130(tmp_path):
    # FORCE_COLOR: rich draws its progress bar live, as on a terminal, so "capture" shows while it compiles
    rc, _, err = _interrupt(["capture-report", "--max-len", "64", "--kinds", "prefill,decode"], "capture", "stderr",
                            tmp_path, FORCE_COLOR="1")
    assert rc == 130, err
    assert err.strip().splitlines()[-1] == "static-decode capture-report: interrupted"
    assert "Traceback" not in err and "Error" not in err, err


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def talky(texty, tmp_path_factory):
    """texty with a chat template."""
    import shutil

    path = tmp_path_factory.mktemp("talky") / "model"
    shutil.copytree(texty, path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def _chat(capsys, monkeypatch, argv: list[str], stdin: str) -> tuple[int, str, str]:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return run(capsys, "chat", *argv)


def test_chat_first_turn_claims_no_earlier_turns(talky, capsys, monkeypatch):
    rc, _, err = _chat(capsys, monkeypatch, ["--model", str(talky), "--max-new-tokens", "4"], "hi\n")
    assert rc == 0
    assert re.search(r"\[turn 1: prefilled \d+ tokens from scratch; 4 new; \d+\.\d\d ms per decoded token", err), err
    assert "changed earlier turns" not in err


def test_chat_system_message_opens_the_conversation(talky, capsys, monkeypatch):
    from static_decode.text.chat_template import load_chat_template

    rc, _, err = _chat(capsys, monkeypatch, ["--model", str(talky), "--max-new-tokens", "4", "--system", "terse"],
                       "hi\n/reset\nhi\n")
    assert rc == 0
    rendered = load_chat_template(talky).render([{"role": "system", "content": "terse"},
                                                 {"role": "user", "content": "hi"}])
    assert rendered.startswith("<system>terse\n<user>hi")
    counts = re.findall(r"prefilled (\d+) tokens", err)
    assert counts == [str(len(rendered.encode()))] * 2  # and again after /reset


def test_chat_stop_string_cuts_a_reply_and_the_next_turn_says_why(talky, capsys, monkeypatch):
    argv = ["--model", str(talky), "--max-new-tokens", "12"]
    rc, out, _ = _chat(capsys, monkeypatch, argv, "hi\n")
    reply = out.splitlines()[0]
    assert rc == 0 and len(reply) >= 6
    stop = reply[3:5]
    cut = reply[: reply.index(stop)]
    rc, out, err = _chat(capsys, monkeypatch, [*argv, "--stop", stop], "hi\nmore\n")
    assert rc == 0, err
    assert out.splitlines()[0] == cut
    assert "[turn 1: stopped at a --stop string" in err
    assert "[turn 2: prefilled" in err and "from scratch (a stop string cut the last reply)" in err


def test_a_wide_table_is_whole_when_piped(capsys):
    from rich.table import Table

    from static_decode.commands.capture_report import print_whole

    table = Table(title="wide")
    headers = [f"column number {i}" for i in range(14)]
    for h in headers:
        table.add_column(h)
    table.add_row(*[f"value {i} " * 3 for i in range(14)])
    print_whole(table)  # capsys: stdout is not a terminal
    out = capsys.readouterr().out
    assert all(h in out for h in headers) and "…" not in out
    assert all(f"value {i} value {i} value {i}" in out for i in range(14))


def test_repeat_penalty_with_speculation_is_refused_up_front(talky, capsys, monkeypatch):
    rc, _, err = _chat(capsys, monkeypatch, ["--model", str(talky), "--speculate", "prompt-lookup",
                                             "--repeat-penalty", "1.2"], "hi\n")
    assert rc == 2 and "--repeat-penalty 1.2 is not supported with --speculate" in err
    rc, _, err = run(capsys, "generate", "--model", str(talky), "--prompt", "hi", "--speculate", "prompt-lookup",
                     "--repeat-penalty", "1.2")
    assert rc == 2 and "not supported with speculative decoding" in err


def test_per_token_time_leaves_out_the_steps_after_eos(plain):
    from static_decode.generation.stats import GenerationStats

    s = GenerationStats(prompt_tokens=40, new_tokens=8, prefill_s=0.1, decode_s=1.6, decode_steps=16, live_steps=7)
    assert s.ms_per_step == 100.0 and s.ms_per_token == 100.0  # 7 tokens from 7 live steps of 100 ms
    assert "100.00 ms per decoded token (7 tokens)," in s.summary()
    spec = GenerationStats(prompt_tokens=9, new_tokens=16, prefill_s=0.1, decode_s=0.6, decode_steps=6,
                           verify_steps=5, accepted_per_step=2.5, live_steps=6)
    assert spec.ms_per_token == 40.0 and "(15 tokens [6 steps, 5 verify steps at 2.50 tokens per step])" in (
        spec.summary())
    free = Generator(load_model(plain), max_len=40, eos_token_ids=[]).generate(PROMPT_IDS, 12)
    gen = Generator(load_model(plain), max_len=40, eos_token_ids=[free[2]], read_every=16)
    assert gen.generate(PROMPT_IDS, 12) == free[: free.index(free[2]) + 1]
    tokens = len(gen.generate(PROMPT_IDS, 12))
    assert gen.stats.live_steps == tokens - 1 < gen.stats.decode_steps  # steps ran on until the read-back
    assert gen.stats.ms_per_token == pytest.approx(gen.stats.ms_per_step)


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--prompt-ids", "1,2,x"], "argument --prompt-ids: expected comma-separated ints, got '1,2,x'"),
    (["generate", "--threads", "0"], "argument -t/--threads: expected an int >= 1, got 0"),
    (["generate", "--quantize", "int3"], "argument --quantize: invalid choice: 'int3'"),
    (["bench", "--contexts", "a"], "argument --contexts:"),
    (["nonsense"], "argument COMMAND: invalid choice: 'nonsense'"),
])
def test_an_argument_error_is_one_line_and_the_help_hint(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == ""
    prog = "static-decode" if argv[0] == "nonsense" else f"static-decode {argv[0]}"
    assert err.startswith(f"{prog}: error: {message}") and err.endswith(f" (see {prog} --help)\n"), err
    assert err.count("\n") == 1 and "usage:" not in err


@pytest.mark.parametrize("where", ["missing-dir", "directory", "read-only"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(plain, tmp_path, capsys, where):
    target = {"missing-dir": tmp_path / "nope" / "t.json", "directory": tmp_path,
              "read-only": Path("/proc/self/static-decode-trace.json")}[where]
    rc, out, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                       "--profile", str(target))
    assert rc == 2 and out == "" and err.startswith(f"static-decode generate: error: --profile {target}: "), err
    assert err.count("\n") == 1
    rc, out, err = run(capsys, "bench", "--json", str(target), "--quick", "--no-attention")
    assert rc == 2 and err.startswith(f"static-decode bench: error: --json {target}: ") and out == ""


def test_a_profile_is_written_where_asked(plain, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    rc, _, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "1,2", "--max-new-tokens", "3",
                     "--profile", str(trace))
    assert rc == 0 and f"torch.profiler Chrome trace: {trace}" in err
    assert trace.stat().st_size > 0 and "traceEvents" in trace.read_text()


def test_numpy_scalars_are_taken_wherever_a_python_number_is(plain):
    import numpy as np

    gen = Generator(load_model(plain), max_len=32)
    kw = dict(temperature=0.7, top_k=5, top_p=0.5, seed=3, repeat_penalty=1.2)
    as_numpy = dict(temperature=np.float32(0.7), top_k=np.int64(5), top_p=np.float32(0.5), seed=np.uint8(3),
                    repeat_penalty=np.float16(1.2))
    want = gen.generate([1, 2, 3], 6, **kw)
    # float32 0.7 and 0.5 round differently from the Python floats: compare with the same values as floats
    same = {k: (v if k in ("top_k", "seed") else float(v)) for k, v in as_numpy.items()}
    assert gen.generate([1, 2, 3], 6, **as_numpy) == gen.generate([1, 2, 3], 6, **same)
    assert len(want) == 6
    for name, bad in (("top_p", np.bool_(True)), ("temperature", np.bool_(True)), ("repeat_penalty", np.bool_(1))):
        with pytest.raises(ValueError, match=name):
            gen.generate([1, 2, 3], 2, **{name: bad})


@pytest.mark.parametrize("wrapper", [RuntimeError, ValueError])
def test_ctrl_c_wrapped_by_a_library_is_still_status_130(wrapper, capsys, monkeypatch):
    """Python 3.11 wraps an exception raised in __set_name__ (a KeyboardInterrupt during an import inside
    torch.compile), and dynamo wraps that again: the chain still holds the interrupt."""

    def interrupted_inside(args):
        try:
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as e:
                raise wrapper("Error calling __set_name__ on 'cached_property'") from e
        except Exception as e:
            raise RuntimeError("backend='inductor' raised") from e

    monkeypatch.setattr(generate, "run_generate", interrupted_inside)
    rc = cli.main(["generate", "--prompt-ids", "1,2"])
    out, err = capsys.readouterr()
    assert rc == 130 and err == "static-decode generate: interrupted\n"
