"""The server's logprobs, top_logprobs and echo, in OpenAI's two formats, against a live server.

References: the library in this process (`Generator.generate(..., logprobs=k)` on the same checkpoint, greedy,
whose records tests/steps/test_logprobs.py pins to transformers' logits) and, for echo, transformers' own
cross-entropy over the prompt and `perplexity`'s mean NLL. Pins, through the official `openai` client and raw
httpx: /v1/completions' legacy logprobs (tokens, token_logprobs, top_logprobs as token -> logprob objects,
text_offset) equal the library's records, streamed chunks adding up to the whole answer; echo returns the prompt's
text and, with logprobs, its tokens' logprobs (the first null) with max_tokens 0 scoring the prompt alone, its
mean NLL equal to transformers' and perplexity's within 1e-4; /v1/chat/completions' logprobs.content entries
({token, logprob, bytes, top_logprobs}) equal the records, streamed and not; k past 20, top_logprobs without
logprobs, a non-boolean chat logprobs, echo on a chat and top_logprobs on a completion get a 400 naming the field.
"""

from __future__ import annotations

import json
import shutil

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from static_decode import Generator, load_model  # noqa: E402
from static_decode.checkpoints.loading import default_model_path, load_tokenizer  # noqa: E402
from static_decode.commands.perplexity import perplexity  # noqa: E402
from static_decode.text.chat_template import load_chat_template  # noqa: E402
from tests.support.servers import MAX_LEN, TEMPLATE, Server  # noqa: E402

PROMPT = "def fib(n):\n    return"
N = 8
K = 3


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The embedded model with test_server's chat template (it has none of its own)."""
    d = tmp_path_factory.mktemp("served_logprobs")
    for f in default_model_path().iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    return d


@pytest.fixture(scope="module")
def ref(chat_model):
    """(generator with logprobs kept, tokenizer, chat template) on the same checkpoint, in process."""
    model = load_model(chat_model)
    return Generator(model, max_len=MAX_LEN, max_logprobs=20), load_tokenizer(chat_model), load_chat_template(
        chat_model)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def text_of(tok, token: int) -> str:
    """The embedded tokenizer's token `token` is the byte of that value: as text, U+FFFD for a piece of a
    character (OpenAI's token strings; the bytes field has the byte)."""
    return bytes([token]).decode("utf-8", errors="replace")


def check_legacy(lp, recs, tok, k: int, first_offset: int) -> None:
    """A legacy logprobs object (the client's, or a dict) against the library's records."""
    get = (lambda name: lp[name]) if isinstance(lp, dict) else (lambda name: getattr(lp, name))
    assert get("tokens") == [text_of(tok, r.token) for r in recs]
    assert get("token_logprobs") == pytest.approx([r.logprob for r in recs], abs=1e-5)
    for top, r in zip(get("top_logprobs"), recs, strict=True):
        assert list(top) == [text_of(tok, t) for t, _ in r.top[:k]]
        assert list(top.values()) == pytest.approx([v for _, v in r.top[:k]], abs=1e-5)
    offsets = [first_offset]
    for t in get("tokens")[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert get("text_offset") == offsets


def test_completion_logprobs_equal_the_library(server, ref):
    gen, tok, _ = ref
    recs = gen.generate(tok.encode(PROMPT).ids, N, logprobs=K, stop_at_eos=False)
    c = client(server)
    r = c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=N, logprobs=K,
                             extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.text == tok.decode([x.token for x in recs])
    check_legacy(choice.logprobs, recs, tok, K, 0)
    assert all(x.token == x.top[0][0] for x in recs)  # greedy: the best alternative is the token

    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in c.completions.create(model=r.model, prompt=PROMPT, max_tokens=N, logprobs=K, stream=True,
                                      extra_body={"ignore_eos": True}):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            for name in streamed:
                streamed[name] += getattr(lp, name)
    check_legacy(streamed, recs, tok, K, 0)


def test_echo_scores_the_prompt_as_transformers_and_perplexity_do(server, ref, chat_model):
    gen, tok, _ = ref
    ids = tok.encode(PROMPT).ids
    c = client(server)
    r = c.completions.create(model=c.models.list().data[0].id, prompt=PROMPT, max_tokens=0, logprobs=2, echo=True)
    choice = r.choices[0]
    assert choice.text == PROMPT and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [text_of(tok, t) for t in ids] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    gen.generate(ids, 1, prompt_logprobs=2)
    check_legacy({name: getattr(lp, name)[1:] for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")},
                 gen.prompt_logprobs[1:], tok, 2, 1)
    nll = -sum(lp.token_logprobs[1:]) / (len(ids) - 1)
    assert nll == pytest.approx(perplexity(load_model(chat_model), ids, 4).nll, abs=1e-4)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()  # [T, V]
    assert nll == pytest.approx(float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))),
                                abs=1e-4)

    # echo with a completion: the prompt's text and records, then the completion's, offsets running on
    body = {"prompt": PROMPT, "max_tokens": 4, "logprobs": 1, "echo": True, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    new = gen.generate(ids, 4, logprobs=1, stop_at_eos=False)
    assert whole["text"] == PROMPT + tok.decode([x.token for x in new])
    assert whole["logprobs"]["text_offset"][len(ids)] == len(PROMPT)
    check_legacy({k: v[len(ids):] for k, v in whole["logprobs"].items()}, new, tok, 1, len(PROMPT))
    plain = httpx.post(server.url + "/v1/completions", json={**body, "logprobs": None}, timeout=60).json()
    assert plain["choices"][0]["text"] == whole["text"] and plain["choices"][0]["logprobs"] is None

    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    assert [t for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]] \
        == whole["logprobs"]["tokens"]


def test_an_eos_token_has_its_record_like_every_sampled_token(server, ref):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1) where the one sampled token is
    EOS (forced by a logit bias): len(prompt) + 1 records, the last the EOS token's, its text as the tokenizer
    renders the token and its logprob the model's (before the bias), streamed and not; a chat reply ending at EOS
    lists its record last too. Leaving it out shifted lm-eval's continuation slice by one token."""
    gen, tok, template = ref
    ids = tok.encode(PROMPT).ids
    eos = gen.eos_token_ids[0]
    gen.generate([*ids, eos], 1, prompt_logprobs=1)
    want = gen.prompt_logprobs[-1]  # the model's logprob of EOS after the prompt
    assert want.token == eos
    body = {"prompt": PROMPT, "max_tokens": 1, "logprobs": 1, "echo": True, "logit_bias": {str(eos): 100}}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == 1
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["text_offset"]) == len(ids) + 1
    assert lp["tokens"][-1] == tok.decode([eos], skip_special_tokens=False) and lp["text_offset"][-1] == len(PROMPT)
    assert lp["token_logprobs"][-1] == pytest.approx(want.logprob, abs=1e-5)
    assert lp["top_logprobs"][-1] is not None
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [v for e in events if e["choices"][0]["logprobs"] for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]

    messages = [{"role": "user", "content": "write fib"}]
    chat = {"messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 1, "logit_bias": {str(eos): 100}}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    assert r["message"]["content"] == "" and r["finish_reason"] == "stop"
    entries = r["logprobs"]["content"]
    assert len(entries) == 1 and entries[0]["bytes"] == list(tok.decode([eos], skip_special_tokens=False).encode())
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    content = [c for e in events if e["choices"] and e["choices"][0].get("logprobs")
               for c in e["choices"][0]["logprobs"]["content"]]
    assert content == entries


def test_the_library_lists_the_eos_token_record_last(ref):
    """The Python API: a reply that ends at EOS has the EOS token's record as its last, as every sampled token."""
    gen, tok, _ = ref
    eos = gen.eos_token_ids[0]
    recs = gen.generate(tok.encode(PROMPT).ids, 5, logprobs=1, logit_bias={eos: 100})
    assert [r.token for r in recs] == [eos] and recs[0].logprob is not None and recs[0].logprob <= 0


def check_chat(content, recs, tok, k: int) -> None:
    assert len(content) == len(recs)
    for entry, r in zip(content, recs, strict=True):
        get = (lambda e, name: e[name]) if isinstance(entry, dict) else getattr
        raw = bytes([r.token])
        assert get(entry, "token") == text_of(tok, r.token) and get(entry, "bytes") == list(raw)
        assert get(entry, "logprob") == pytest.approx(r.logprob, abs=1e-5)
        tops = get(entry, "top_logprobs")
        assert [get(t, "token") for t in tops] == [text_of(tok, i) for i, _ in r.top[:k]]
        assert [get(t, "logprob") for t in tops] == pytest.approx([v for _, v in r.top[:k]], abs=1e-5)
        assert [get(t, "bytes") for t in tops] == [[i] for i, _ in r.top[:k]]


def test_chat_logprobs_equal_the_library(server, ref):
    gen, tok, template = ref
    messages = [{"role": "user", "content": "write fib"}]
    ids = tok.encode(template.render(messages), add_special_tokens=False).ids
    recs = gen.generate(ids, N, logprobs=K, stop_at_eos=False)
    c = client(server)
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=messages, max_tokens=N, logprobs=True,
                                  top_logprobs=K, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == tok.decode([x.token for x in recs])
    check_chat(r.choices[0].logprobs.content, recs, tok, K)
    content = []
    for chunk in c.chat.completions.create(model=r.model, messages=messages, max_tokens=N, logprobs=True,
                                           top_logprobs=K, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            content += chunk.choices[0].logprobs.content
    check_chat(content, recs, tok, K)
    bare = c.chat.completions.create(model=r.model, messages=messages, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)  # top_logprobs left out: none


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/completions", {"logprobs": 21}, "logprobs", "logprobs must be an integer in 0..20, got 21"),
    ("/v1/completions", {"logprobs": True}, "logprobs", "logprobs must be an integer in 0..20"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs applies to /v1/chat/completions"),
    ("/v1/completions", {"echo": "yes"}, "echo", "echo must be a boolean"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be an integer in 0..20, got 21"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "top_logprobs=2 needs logprobs: true"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs", "logprobs must be a boolean on /v1/chat/completions"),
    ("/v1/chat/completions", {"echo": True}, "echo", "echo is not supported by this server"),
])
def test_bad_logprob_fields_are_refused_by_name(server, path, body, param, words):
    base = {"prompt": "x", "max_tokens": 2} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(server.url + path, json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
