"""--json-schema FILE and --json-object on `generate` and `chat` (the embedded model, in process).

References: jsonschema validates what `generate --json-schema` prints (the reply alone) for several seeds at
temperature 0.8 and each reply of a two-turn `chat`; json.loads parses `--json-object` output; the library in this
process (Generator with grammar tables, the same Grammar) prints the same tokens. Refusals stop the command in
one line naming the flag, before anything is printed: a missing file, a file that is not JSON, JSON that is not a
schema object, a schema neither library compiles, --speculate, a checkpoint without a tokenizer, both flags.
"""

from __future__ import annotations

import io
import json
import sys

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("outlines_core")
pytest.importorskip("xgrammar")

from static_decode import Generator, load_model  # noqa: E402
from static_decode.checkpoints.loading import default_model_path, load_tokenizer  # noqa: E402
from static_decode.generation.structured import DEFAULT_GRAMMAR_TABLES, Grammar  # noqa: E402
from tests.support.cli import run  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "kind": {"enum": ["a", "b", "c"]},
                   "ok": {"type": "boolean"}},
    "required": ["name", "kind", "ok"],
    "additionalProperties": False,
}
PROMPT = "item = "


@pytest.fixture(scope="module")
def schema_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("schema") / "item.json"
    path.write_text(json.dumps(SCHEMA))
    return path


def test_generate_prints_json_that_validates(schema_file, capsys):
    for seed in range(3):
        rc, out, err = run(capsys, "generate", "--prompt", PROMPT, "--json-schema", str(schema_file),
                           "--temperature", "0.8", "--seed", str(seed), "--max-new-tokens", "120")
        assert rc == 0, err
        jsonschema.validate(json.loads(out), SCHEMA)


def test_generate_prints_the_librarys_constrained_tokens(schema_file, capsys):
    rc, out, err = run(capsys, "generate", "--prompt", PROMPT, "--json-schema", str(schema_file),
                       "--temperature", "0.8", "--seed", "5", "--max-new-tokens", "120")
    assert rc == 0, err
    model, tok = load_model(default_model_path()), load_tokenizer(default_model_path())
    prompt = tok.encode(PROMPT).ids
    gen = Generator(model, max_len=len(prompt) + 120, batch=1, grammar_tables=DEFAULT_GRAMMAR_TABLES)
    ids = gen.generate(prompt, 120, temperature=0.8, seed=5,
                       grammar=Grammar.json_schema(SCHEMA, tok, vocab_size=model.config.vocab_size))
    assert ids[-1] in gen.eos_token_ids  # printed without it
    assert out == tok.decode(ids[:-1], skip_special_tokens=True) + "\n"


def test_generate_json_object_parses(capsys):
    for seed in (1, 2):  # the toy model closes its object within the budget for these (it may also pad forever)
        rc, out, err = run(capsys, "generate", "--prompt", PROMPT, "--json-object", "--temperature", "0.5",
                           "--seed", str(seed), "--max-new-tokens", "200")
        assert rc == 0, err
        assert isinstance(json.loads(out), dict)


def test_chat_replies_validate(chat_model, schema_file, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setattr(sys, "stdin", io.StringIO("an item\nanother one\n"))
    rc, out, err = run(capsys, "chat", "--model", str(chat_model), "--json-schema", str(schema_file),
                       "--temperature", "0.8", "--seed", "0", "--max-new-tokens", "120", "--max-len", "512")
    assert rc == 0, err
    replies = out.splitlines()
    assert len(replies) == 2, out
    for reply in replies:
        jsonschema.validate(json.loads(reply), SCHEMA)


@pytest.mark.parametrize(("content", "extra", "words"), [
    (None, (), "cannot read the file"),
    ("{not json", (), "the file is not JSON"),
    ("[1, 2]", (), "a JSON schema is a JSON object, the file holds list"),
    ('{"type": "foo"}', (), "the schema cannot be compiled"),
    (json.dumps(SCHEMA), ("--speculate", "prompt-lookup"), "structured output is not supported with speculative"),
])
def test_bad_schema_files_stop_generate_and_chat_in_one_line(tmp_path, chat_model, capsys, monkeypatch,  # noqa: F811
                                                             content, extra, words):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    for argv in (["generate", "--prompt", PROMPT], ["chat", "--model", str(chat_model)]):
        rc, out, err = run(capsys, *argv, "--json-schema", str(path), *extra)
        lines = err.strip().splitlines()
        assert rc == 2 and out == "", (argv, out, err)
        assert f"--json-schema {path}: {words}" in lines[-1] and "Traceback" not in err, err


def test_json_object_without_a_tokenizer_or_with_both_flags_is_refused(plain, schema_file, capsys):
    rc, out, err = run(capsys, "generate", "--model", str(plain), "--prompt-ids", "1,2,3", "--json-object")
    assert rc == 2 and out == "" and "--json-object needs a tokenizer.json" in err, err
    with pytest.raises(SystemExit) as e:
        run(capsys, "generate", "--prompt", PROMPT, "--json-object", "--json-schema", str(schema_file))
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
