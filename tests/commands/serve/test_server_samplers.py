"""The server's `min_p`, `presence_penalty`, `frequency_penalty` and `logit_bias` (string token ids, as OpenAI
sends them), and the matching `serve` defaults.

The reference is the library in this process: `Generator.generate` on the same checkpoint with the same
SamplingParams. Pins: through the official `openai` client (and raw JSON for `min_p`, an extension), each field
gives exactly the library's tokens, on both endpoints, greedy and seeded; a server started with defaults applies
them to a request that leaves the field out, and a request's own value (its neutral one included) goes over
them; bad values get a 400 naming the field (ranges, non-integer keys, ids past the vocabulary, more than 64
entries, a repeated id, a non-object), checked in-process by `api.parse` before anything is queued; a
speculating server refuses each field by name; bad defaults stop `serve` at startup in one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from static_decode import Generator, load_model  # noqa: E402
from static_decode.checkpoints.loading import default_model_path, load_tokenizer  # noqa: E402
from static_decode.commands.serve import api  # noqa: E402
from static_decode.text.chat_template import load_chat_template  # noqa: E402
from tests.support.servers import MAX_LEN, ROOT, TEMPLATE, Server  # noqa: E402

PROMPT = "def fib(n):"
DEFAULTS = ["--frequency-penalty", "0.8", "--logit-bias", "LATER"]  # LATER: filled with the banned id


@pytest.fixture(scope="module")
def ref():
    """generate(prompt ids, n, **options) and the tokenizer, on the embedded model in process."""
    model = load_model(default_model_path())
    gen = Generator(model, max_len=MAX_LEN)
    return gen, load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def banned(ref):
    """The greedy reply's first token: a bias of -100 on it must change the reply."""
    gen, tok = ref
    return gen.generate(tok.encode(PROMPT).ids, 1)[0]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The embedded model with test_server's chat template (it has none of its own)."""
    d = tmp_path_factory.mktemp("served_samplers")
    for f in default_model_path().iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


@pytest.fixture(scope="module")
def defaults_server(banned):
    s = Server(default_model_path(), *[f"{banned}=-100" if f == "LATER" else f for f in DEFAULTS])
    yield s
    s.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"}, timeout=60)


def reply_ids(ref, ids: list[int], n: int, **options) -> list[int]:
    gen, _ = ref
    out = gen.generate(ids, n, **options)
    return out[:-1] if out and out[-1] in gen.eos_token_ids else out


def text_of(ref, ids: list[int]) -> str:
    return ref[1].decode(ids, skip_special_tokens=True)


def test_completion_fields_equal_the_library(server, ref, banned):
    c = client(server)
    model = c.models.list().data[0].id
    ids = ref[1].encode(PROMPT).ids
    plain = reply_ids(ref, ids, 16)
    cases = [
        (dict(logit_bias={str(banned): -100}), dict(logit_bias={banned: -100})),
        (dict(presence_penalty=1.5), dict(presence_penalty=1.5)),
        (dict(frequency_penalty=2.0, logit_bias={str(banned): -100, "10": 3}),
         dict(frequency_penalty=2.0, logit_bias={banned: -100, 10: 3})),
        (dict(temperature=1.0, seed=7, presence_penalty=-1.0), dict(temperature=1.0, seed=7, presence_penalty=-1.0)),
    ]
    for fields, options in cases:
        want = reply_ids(ref, ids, 16, **options)
        got = c.completions.create(model=model, prompt=PROMPT, max_tokens=16, **fields)
        assert got.choices[0].text == text_of(ref, want), fields
    assert reply_ids(ref, ids, 16, logit_bias={banned: -100}) != plain  # the bias changed the reply
    assert banned not in reply_ids(ref, ids, 16, logit_bias={banned: -100})
    # min_p: an extension in the body (vLLM's and llama.cpp's field), seeded sampling
    for min_p in (0.05, 0.5):
        want = reply_ids(ref, ids, 16, temperature=1.2, seed=3, min_p=min_p)
        r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.2, "seed": 3,
                                             "min_p": min_p})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text_of(ref, want), r.text
    assert reply_ids(ref, ids, 16, temperature=1.2, seed=3, min_p=0.5) != reply_ids(ref, ids, 16, temperature=1.2,
                                                                                      seed=3)


def test_chat_takes_them_too(server, ref, chat_model):
    c = client(server)
    messages = [{"role": "user", "content": "hi"}]
    text = load_chat_template(chat_model).render(messages, add_generation_prompt=True)
    ids = ref[1].encode(text, add_special_tokens=False).ids
    first = reply_ids(ref, ids, 1)[0]
    options = dict(presence_penalty=2.0, frequency_penalty=1.0, logit_bias={first: -100})
    got = c.chat.completions.create(model=c.models.list().data[0].id, messages=messages, max_tokens=12,
                                    presence_penalty=2.0, frequency_penalty=1.0, logit_bias={str(first): -100})
    want = reply_ids(ref, ids, 12, **options)
    assert got.choices[0].message.content == text_of(ref, want) and want != reply_ids(ref, ids, 12)


def test_defaults_apply_and_a_request_goes_over_them(defaults_server, ref, banned):
    ids = ref[1].encode(PROMPT).ids
    r = post(defaults_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12})
    want = reply_ids(ref, ids, 12, frequency_penalty=0.8, logit_bias={banned: -100})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text_of(ref, want)
    r = post(defaults_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "frequency_penalty": 0,
                                                  "logit_bias": {}})
    assert r.json()["choices"][0]["text"] == text_of(ref, reply_ids(ref, ids, 12))  # neutral values: plain
    assert want != reply_ids(ref, ids, 12)


# ---- refusals, in process: api.parse before anything is queued --------------------------------------------------
class _Tok:
    def encode(self, text: str, **kw):  # never reached with token-id prompts
        raise AssertionError("tokenized")


CTX = api.Context(model_name="m", tokenizer=_Tok(), template=None, vocab_size=96, max_len=64)


def parse(body: dict, ctx: api.Context = CTX) -> api.Completion:
    return api.parse(json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, **body}).encode(), ctx, chat=False)


def test_parse_maps_the_fields():
    c = parse({"min_p": 0.1, "presence_penalty": -2, "frequency_penalty": 2, "logit_bias": {"7": -100, "3": 1.5}})
    assert (c.min_p, c.presence_penalty, c.frequency_penalty) == (0.1, -2.0, 2.0)
    assert c.logit_bias == ((3, 1.5), (7, -100.0))
    c = parse({})
    assert (c.min_p, c.presence_penalty, c.frequency_penalty, c.logit_bias) == (None, None, None, None)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"min_p": 1.5}, "min_p", "min_p must be a number in [0.0, 1.0], got 1.5"),
    ({"min_p": "0.1"}, "min_p", "min_p must be a number"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be a number in [-2.0, 2.0]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be a number in [-2.0, 2.0]"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias keys must be token ids (strings of digits), got 'abc'"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "got '-1'"),
    ({"logit_bias": {"96": 1}}, "logit_bias", "logit_bias names token id 96; token ids are 0..95"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias[5] must be a number in [-100, 100], got 101"),
    ({"logit_bias": {"5": "1"}}, "logit_bias", "logit_bias['5'] must be a number in [-100, 100], got \"1\""),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias", "logit_bias gives token id 5 twice"),
    ({"logit_bias": {str(i): 1 for i in range(65)}}, "logit_bias", "65 entries; at most 64"),
    ({"logit_bias": [[5, 1]]}, "logit_bias", "logit_bias must be an object of token id -> bias"),
])
def test_bad_values_are_400s_naming_the_field(body, param, words):
    with pytest.raises(api.APIError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


@pytest.mark.parametrize("body", [{"min_p": 0.1}, {"presence_penalty": 0.5}, {"frequency_penalty": -1},
                                  {"logit_bias": {"5": -100}}])
def test_a_speculating_server_refuses_each(body):
    ctx = api.Context(model_name="m", tokenizer=_Tok(), template=None, vocab_size=96, max_len=64, draft_slots=4)
    (name, _), = body.items()
    with pytest.raises(api.APIError) as e:
        parse(body, ctx)
    assert e.value.param == name and "decodes speculatively" in e.value.message
    neutral = {"min_p": 0, "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {"5": 0}}
    parse({name: neutral[name]}, ctx)  # neutral values are fine


@pytest.mark.parametrize(("flags", "words"), [
    (["--min-p", "2"], "--min-p 2.0: min_p must be a number in [0, 1]"),
    (["--presence-penalty", "-5"], "--presence-penalty -5.0: presence_penalty must be a number in [-2, 2]"),
    (["--logit-bias", "3=500"], "--logit-bias 3=500: logit_bias[3] must be a number in [-100, 100]"),
    (["--frequency-penalty", "0.5", "--speculate", "prompt-lookup"],
     "--frequency-penalty 0.5 is not supported with --speculate"),
])
def test_serve_refuses_bad_sampler_defaults_at_startup(flags, words):
    proc = subprocess.run([sys.executable, "-m", "static_decode", "serve", "--port", "0", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"static-decode serve: error: {words}"), proc.stderr
