"""`--chat-template-kwargs JSON` on the commands that render a chat (generate --chat, chat, serve).

The checkpoint is a tiny random model over a Qwen3-shaped tokenizer with Qwen3's real chat template
(tests/support/qwen3.py). The reference is transformers' `apply_chat_template(messages,
add_generation_prompt=True, **kwargs)` on the same directory: the command's reply must be the generator's greedy
reply to exactly those ids, with enable_thinking false (the template's empty <think></think>) and true. A bad value
stops the command before it loads anything, in one line naming it.
"""

from __future__ import annotations

import io
import json
import sys

import pytest

from static_decode import Generator, load_model
from static_decode.checkpoints.loading import load_tokenizer
from tests.support.checkpoints import hf_llama, save
from tests.support.cli import run
from tests.support.qwen3 import qwen3_tokenizer_dir

transformers = pytest.importorskip("transformers")
NEW = 6


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    return qwen3_tokenizer_dir(save(hf_llama(seed=5, vocab=272, eos=None), tmp_path_factory.mktemp("qwen3_cli")))


def _reply(path, messages, **kwargs) -> str:
    """The greedy reply, decoded, to transformers' rendering of `messages`."""
    hf = transformers.AutoTokenizer.from_pretrained(path)
    out = hf.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    ids = list(out["input_ids"]) if hasattr(out, "keys") else list(out)
    new = Generator(load_model(path), max_len=len(ids) + NEW, eos_token_ids=[]).generate(ids, NEW)
    return load_tokenizer(path).decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("thinking", [False, True])
def test_generate_chat_passes_them_to_the_template(qwen3_model, capsys, thinking) -> None:
    kwargs = json.dumps({"enable_thinking": thinking})
    rc, out, err = run(capsys, "generate", "--model", str(qwen3_model), "--system", "Be brief.", "--prompt", "hi",
                       "--max-new-tokens", str(NEW), "--chat-template-kwargs", kwargs)
    assert rc == 0, err
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert out == _reply(qwen3_model, messages, enable_thinking=thinking) + "\n"


def test_the_kwargs_change_the_prompt(qwen3_model, capsys) -> None:
    """Without them Qwen3's template leaves thinking on: the prompt differs from thinking off by its <think></think>."""
    hf = transformers.AutoTokenizer.from_pretrained(qwen3_model)
    msgs = [{"role": "user", "content": "hi"}]
    off = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert off == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) + "<think>\n\n</think>\n\n"
    argv = ["generate", "--model", str(qwen3_model), "--chat", "--prompt", "hi", "--max-new-tokens", str(NEW)]
    rc, plain, _ = run(capsys, *argv)
    assert rc == 0 and plain == _reply(qwen3_model, msgs) + "\n"


def test_chat_renders_every_turn_with_them(qwen3_model, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    rc, out, err = run(capsys, "chat", "--model", str(qwen3_model), "--max-new-tokens", str(NEW),
                       "--chat-template-kwargs", '{"enable_thinking": false}')
    assert rc == 0, err
    assert out == _reply(qwen3_model, [{"role": "user", "content": "hello"}], enable_thinking=False) + "\n"


@pytest.mark.parametrize(("command", "value", "words"), [
    ("generate", "{not json", "'{not json' is not valid JSON"),
    ("generate", "[1, 2]", "--chat-template-kwargs must be a JSON object of template variables, got [1, 2]"),
    ("chat", '{"messages": []}', "--chat-template-kwargs may not set 'messages'"),
    ("serve", '{"add_generation_prompt": false}', "--chat-template-kwargs may not set 'add_generation_prompt'"),
    ("serve", '{"x": NaN}', "--chat-template-kwargs['x'] must be a JSON value"),
])
def test_bad_values_stop_the_command_in_one_line(qwen3_model, capsys, command, value, words) -> None:
    with pytest.raises(SystemExit) as stop:  # argparse's refusal of what the option's type does not take
        run(capsys, command, "--model", str(qwen3_model), "--chat-template-kwargs", value)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert stop.value.code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"static-decode {command}: error: argument --chat-template-kwargs: {words}"), err


def test_without_a_chat_they_are_refused(qwen3_model, texty, capsys) -> None:
    rc, _, err = run(capsys, "generate", "--model", str(qwen3_model), "--prompt", "hi",
                     "--chat-template-kwargs", "{}")
    assert rc == 2 and "give --chat (or --system)" in err and len(err.strip().splitlines()) == 1, err
    rc, _, err = run(capsys, "serve", "--model", str(texty), "--port", "0", "--chat-template-kwargs", "{}")
    assert rc == 2 and "has no chat template to pass them to" in err, err
