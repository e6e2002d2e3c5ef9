"""`response_format` on a live `serve --structured` (the embedded model, eager), through the official `openai` client.

References: jsonschema validates every json_schema reply and json.loads parses every json_object one; the library
in this process (Generator with grammar tables, the same Grammar) gives the server's exact text for a seed.
Pins: json_schema replies validate for several seeds at temperature 0.8 on both endpoints (the device automaton);
json_object replies parse as objects (the host mask); streamed == non-streamed for a seed; each schema compiles
once (a cache keyed by its canonical JSON); refusals are 400s naming response_format (a bad type, a missing or
non-object schema, a schema neither library compiles, a server without --structured, a speculating server), and
`serve --structured --speculate` stops at startup in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("outlines_core")
pytest.importorskip("xgrammar")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from static_decode import Generator, load_model  # noqa: E402
from static_decode.checkpoints.loading import load_tokenizer  # noqa: E402
from static_decode.commands.serve import api  # noqa: E402
from static_decode.commands.serve.structured import GrammarCache  # noqa: E402
from static_decode.generation.structured import DEFAULT_GRAMMAR_TABLES, Grammar  # noqa: E402
from static_decode.text.chat_template import load_chat_template  # noqa: E402
from tests.support.servers import MAX_LEN, ROOT, Server, client  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["a", "b", "c"]},
        "ok": {"type": "boolean"},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "kind", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "an item, as JSON"}]
PROMPT = "item = "
SEEDS = range(5)


@pytest.fixture(scope="module")
def server(chat_model):  # noqa: F811
    s = Server(chat_model, "--structured")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def c(server) -> openai.OpenAI:
    return client(server)


def _model(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def test_json_schema_replies_validate_for_every_seed(c):
    for seed in SEEDS:
        chat = c.chat.completions.create(model=_model(c), messages=MESSAGES, max_tokens=120, temperature=0.8,
                                         seed=seed, response_format=FORMAT)
        done = c.completions.create(model=_model(c), prompt=PROMPT, max_tokens=120, temperature=0.8, seed=seed,
                                    extra_body={"response_format": FORMAT})
        for text, finish in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                             (done.choices[0].text, done.choices[0].finish_reason)):
            assert finish == "stop", (seed, text)
            jsonschema.validate(json.loads(text), SCHEMA)


def test_the_server_gives_the_librarys_constrained_text(c, chat_model):  # noqa: F811
    model, tok = load_model(chat_model), load_tokenizer(chat_model)
    gen = Generator(model, max_len=MAX_LEN, grammar_tables=DEFAULT_GRAMMAR_TABLES)
    grammar = Grammar.json_schema(SCHEMA, tok, vocab_size=model.config.vocab_size)
    prompt = tok.encode(load_chat_template(chat_model).render(MESSAGES), add_special_tokens=False).ids
    for seed in (1, 4):
        ids = gen.generate(prompt, 120, temperature=0.8, seed=seed, grammar=grammar)
        assert gen.structured_path == "device"
        want = tok.decode([t for t in ids if t not in gen.eos_token_ids], skip_special_tokens=True)
        got = c.chat.completions.create(model=_model(c), messages=MESSAGES, max_tokens=120, temperature=0.8,
                                        seed=seed, response_format=FORMAT)
        assert got.choices[0].message.content == want


def test_json_object_replies_parse(c):
    fmt = {"type": "json_object"}
    for seed in (1, 2, 4):  # the toy model ends its object within max_tokens for these (it may also pad forever)
        r = c.completions.create(model=_model(c), prompt=PROMPT, max_tokens=200, temperature=0.5, seed=seed,
                                 extra_body={"response_format": fmt})
        assert r.choices[0].finish_reason == "stop", r.choices[0].text
        assert isinstance(json.loads(r.choices[0].text), dict)
    r = c.chat.completions.create(model=_model(c), messages=MESSAGES, max_tokens=40, temperature=0.8, seed=0,
                                  response_format=fmt)
    assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("fmt", [FORMAT, {"type": "json_object"}])
def test_streamed_equals_non_streamed(c, fmt):
    kw = {"model": _model(c), "max_tokens": 200, "temperature": 0.8, "seed": 2}
    whole = c.chat.completions.create(messages=MESSAGES, response_format=fmt, **kw).choices[0].message.content
    parts = c.chat.completions.create(messages=MESSAGES, response_format=fmt, stream=True, **kw)
    assert "".join(ch.choices[0].delta.content or "" for ch in parts if ch.choices) == whole
    whole = c.completions.create(prompt=PROMPT, extra_body={"response_format": fmt}, **kw).choices[0].text
    parts = c.completions.create(prompt=PROMPT, extra_body={"response_format": fmt}, stream=True, **kw)
    assert "".join(ch.choices[0].text for ch in parts if ch.choices) == whole
    json.loads(whole)


def test_free_text_still_works_on_a_structured_server(c):
    r = c.completions.create(model=_model(c), prompt="def ", max_tokens=8,
                             extra_body={"response_format": {"type": "text"}})
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def _ctx(chat_model, **kw) -> api.Context:  # noqa: F811
    tok = load_tokenizer(chat_model)
    return api.Context(model_name="m", tokenizer=tok, template=load_chat_template(chat_model), vocab_size=256,
                       max_len=MAX_LEN, **kw)


def test_each_schema_compiles_once(chat_model):  # noqa: F811
    tok = load_tokenizer(chat_model)
    cache = GrammarCache(tok, 256, [0])
    ctx = _ctx(chat_model, grammars=cache)
    reordered = {"json_schema": {"schema": dict(reversed(list(SCHEMA.items()))), "name": "other"},
                 "type": "json_schema"}
    got = [api.parse(json.dumps({"prompt": "x", "max_tokens": 4, "response_format": f}).encode(), ctx, chat=False)
           for f in (FORMAT, reordered, FORMAT)]
    assert got[0].grammar is got[1].grammar is got[2].grammar and cache.compiled == 1
    obj = api.parse(json.dumps({"prompt": "x", "max_tokens": 4, "response_format": {"type": "json_object"}}).encode(),
                    ctx, chat=False)
    assert obj.grammar.kind == "json_object" and cache.compiled == 2
    plain = api.parse(json.dumps({"prompt": "x", "max_tokens": 4, "response_format": {"type": "text"}}).encode(),
                      ctx, chat=False)
    assert plain.grammar is None and cache.compiled == 2


@pytest.mark.parametrize(("fmt", "words"), [
    ({"type": "xml"}, "response_format type must be text, json_object or json_schema, got 'xml'"),
    ("json", "response_format must be an object with a type"),
    ({"type": "json_schema"}, "response_format json_schema needs json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema must be a JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "json_schema.schema must be a JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "json_schema.name must be a string"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "json_schema.strict must be a boolean"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
     "response_format: the schema cannot be compiled"),
])
def test_bad_response_formats_are_400s_naming_the_field(server, fmt, words):
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": PROMPT})):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 4, "response_format": fmt}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format" and words in err["message"], err


def test_without_structured_or_with_speculation_response_format_is_refused(chat_model):  # noqa: F811
    for kw, words in (({}, "response_format is not supported by this server"),
                      ({"draft_slots": 4}, "which decodes speculatively (--speculate)")):
        for fmt in (FORMAT, {"type": "json_object"}):
            with pytest.raises(api.APIError) as e:
                api.parse(json.dumps({"prompt": "x", "max_tokens": 4, "response_format": fmt}).encode(),
                          _ctx(chat_model, **kw), chat=False)
            assert e.value.status == 400 and e.value.param == "response_format" and words in e.value.message


def test_serve_refuses_structured_with_speculation_at_startup():
    proc = subprocess.run([sys.executable, "-m", "static_decode", "serve", "--port", "0", "--structured",
                           "--speculate", "prompt-lookup"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--structured (response_format) is not supported with speculative" in lines[0]
