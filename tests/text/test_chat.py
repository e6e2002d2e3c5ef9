"""Chat: the checkpoint's template rendered with jinja2, `generate --chat`, and `static-decode chat` driven through
stdin for two turns, the second appending only its own tokens to the cache and equal to a single-shot generate
of the whole rendered conversation."""

from __future__ import annotations

import io
import json
import re
import sys

import pytest

from static_decode import Generator, load_model
from static_decode.commands import cli
from static_decode.text.chat_template import load_chat_template
from tests.support.checkpoints import byte_tokenizer, hf_llama, save

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NEW = 6


@pytest.fixture(scope="module")
def chatty(tmp_path_factory):
    """Byte-level tokenizer (ids = bytes) over a 128-token model: every reply is ASCII text."""
    path = save(hf_llama(seed=8, vocab=128, eos=None), tmp_path_factory.mktemp("chatty"))
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "^", "eos_token": "$"}))
    return path


def test_template_renders_like_transformers(chatty) -> None:
    t = load_chat_template(chatty)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert t.render(msgs) == "^<|user|>hi<|end|>\n<|assistant|>yo<|end|>\n<|assistant|>"
    assert t.render(msgs[:1], add_generation_prompt=False) == "^<|user|>hi<|end|>\n"
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(chatty / "tokenizer.json"), bos_token="^", eos_token="$")
    hf.chat_template = TEMPLATE
    assert t.render(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        t.render([{"role": "robot", "content": "x"}])


def test_template_from_tokenizer_config_and_none(tmp_path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}!"}], "eos_token": {
            "content": "</s>"}}))
    t = load_chat_template(tmp_path)
    assert t.render([{"role": "user", "content": "a"}]) == "a!" and t.eos_token == "</s>"
    assert load_chat_template(tmp_path / "nowhere") is None


def _run(capsys, monkeypatch, argv, stdin=""):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_chat_renders_one_user_message(chatty, capsys, monkeypatch) -> None:
    rc, out, err = _run(capsys, monkeypatch, ["generate", "--model", str(chatty), "--chat", "--prompt", "hello",
                                              "--max-new-tokens", str(NEW), "--max-len", "64"])
    assert rc == 0, err
    tok = byte_tokenizer()
    ids = tok.encode(load_chat_template(chatty).render([{"role": "user", "content": "hello"}])).ids
    expected = Generator(load_model(chatty), max_len=64, eos_token_ids=[]).generate(ids, NEW)
    assert out == tok.decode(expected) + "\n"


def test_chat_without_a_template_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    path = save(hf_llama(seed=8, vocab=128, eos=None), tmp_path)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    capsys.readouterr()  # transformers' save progress bar
    for argv in (["chat", "--model", str(path)], ["generate", "--model", str(path), "--chat", "--prompt", "x"]):
        rc, _, err = _run(capsys, monkeypatch, argv)
        assert rc == 2 and "needs a chat template" in err and len(err.strip().splitlines()) == 1


def test_chat_two_turns_reuse_the_cache_and_equal_a_single_shot_generate(chatty, capsys, monkeypatch) -> None:
    rc, out, err = _run(capsys, monkeypatch, ["chat", "--model", str(chatty), "--max-new-tokens", str(NEW),
                                              "--max-len", "160", "--chunk-size", "8"], "hello\nmore please\n")
    assert rc == 0, err
    tok, template = byte_tokenizer(), load_chat_template(chatty)
    fresh = Generator(load_model(chatty), max_len=160, eos_token_ids=[])
    msgs = [{"role": "user", "content": "hello"}]
    ids1 = tok.encode(template.render(msgs)).ids
    reply1 = fresh.generate(ids1, NEW)
    msgs += [{"role": "assistant", "content": tok.decode(reply1)}, {"role": "user", "content": "more please"}]
    rendered2 = template.render(msgs)
    ids2 = tok.encode(rendered2).ids  # the whole conversation, rendered and tokenized in one go
    reply2 = fresh.generate(ids2, NEW)
    assert out == tok.decode(reply1) + "\n" + tok.decode(reply2) + "\n"
    turns = re.findall(r"\[turn (\d): prefilled (\d+) tokens (on (\d+) cached|from scratch)", err)
    assert [(t[0], t[1]) for t in turns] == [("1", str(len(ids1))), ("2", str(len(ids2) - len(ids1) - NEW + 1))]
    assert turns[1][3] == str(len(ids1) + NEW - 1)  # turn 2 appended to turn 1 and all but the last reply token


def test_chat_reset_and_a_turn_too_long(chatty, capsys, monkeypatch) -> None:
    rc, out, err = _run(capsys, monkeypatch, ["chat", "--model", str(chatty), "--max-new-tokens", str(NEW),
                                              "--max-len", "40"], "hi\n/reset\nhi\n" + "x" * 50 + "\nhi\n")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == lines[1]  # after /reset the same message gets the same (greedy) reply
    assert "[conversation reset]" in err and "does not fit" in err


def test_chat_with_speculation_prints_the_same_replies(chatty, capsys, monkeypatch) -> None:
    argv = ["chat", "--model", str(chatty), "--max-new-tokens", str(NEW), "--max-len", "160", "--chunk-size", "8"]
    rc, plain_out, _ = _run(capsys, monkeypatch, argv, "hello\nmore please\n")
    assert rc == 0
    rc, out, err = _run(capsys, monkeypatch, [*argv, "--speculate", "prompt-lookup:3:2"], "hello\nmore please\n")
    assert rc == 0, err
    assert out == plain_out and "[turn 2: prefilled" in err


def test_chat_refuses_a_line_that_is_not_utf8_and_keeps_the_conversation(chatty, capsys, monkeypatch) -> None:
    argv = ["chat", "--model", str(chatty), "--max-new-tokens", str(NEW), "--max-len", "160", "--chunk-size", "8"]
    rc, want, _ = _run(capsys, monkeypatch, argv, "hello\nmore please\n")
    assert rc == 0
    raw = b"hello\n\xff\xfebad\nmore please\n"
    for errors in ("strict", "surrogateescape"):  # stdin as the locale would decode it
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors=errors))
        rc = cli.main(argv)
        out, err = capsys.readouterr()
        assert rc == 0 and out == want, err
        assert "error: the line is not valid UTF-8 (byte 0xff at offset 0); nothing was sent" in err
        assert "[turn 2: prefilled" in err  # the second message continued the conversation
    # a text stream holding lone surrogates (no bytes beneath it)
    rc, out, err = _run(capsys, monkeypatch, argv, "hello\n\udcffbad\nmore please\n")
    assert rc == 0 and out == want
    assert "error: the line is not valid UTF-8 (character 0xdcff at 0); nothing was sent" in err
