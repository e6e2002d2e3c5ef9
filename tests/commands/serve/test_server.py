"""`static-decode serve` against live servers on 127.0.0.1 (subprocesses on free ports, the embedded model, eager).

The reference is the library itself in this process: `Generator.generate` on the same checkpoint (greedy), its
ids decoded by the same tokenizer; the chat prompt is the template rendered here. Pins: both endpoints, streamed
and not, through the official `openai` client and raw httpx (SSE chunk format, [DONE], usage); every refusal has
OpenAI's error body and changes nothing (the prefix cache still holds the previous request); stop strings; a
client that leaves mid-stream stops its request early and the next one is correct; concurrent clients are all
answered or refused with 429 + Retry-After, with correct outputs and flat resident memory; five chat turns each
prefill only the new turn and equal a fresh generate of the whole conversation; a lone surrogate gets a 400 body
naming its field; fields the server does not compute are refused (400 naming the field), their neutral values
accepted; bad sampling defaults stop `serve` at startup in one line; SIGTERM / SIGINT end the server within a
second, answering the open requests.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from static_decode import Generator, load_model  # noqa: E402
from static_decode.checkpoints.loading import default_model_path, load_tokenizer  # noqa: E402
from static_decode.text.chat_template import load_chat_template  # noqa: E402
from tests.support.servers import MAX_LEN, ROOT, Server, _post, client  # noqa: E402


@pytest.fixture(scope="module")
def ref(chat_model):
    """(generate ids -> text, prompt text -> ids, messages -> prompt ids) on the same checkpoint, in process."""
    model = load_model(chat_model)
    gen = Generator(model, max_len=MAX_LEN)
    tok = load_tokenizer(chat_model)
    template = load_chat_template(chat_model)

    class Ref:
        eos = set(gen.eos_token_ids)

        def ids(self, text: str) -> list[int]:
            return tok.encode(text).ids

        def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
            return tok.encode(template.render(messages), add_special_tokens=False).ids

        def new_ids(self, prompt: list[int], n: int, **kw: float) -> list[int]:
            return gen.generate(prompt, n, **kw)

        def text(self, prompt: list[int], n: int, **kw: float) -> tuple[str, str]:
            """(the reply's text, its finish_reason) for a greedy request."""
            out = self.new_ids(prompt, n, **kw)
            eos = bool(out) and out[-1] in self.eos
            return tok.decode(out[:-1] if eos else out, skip_special_tokens=True), "stop" if eos else "length"

    return Ref()


PROMPTS = ["def fib(n):", "import os\n\nclass ", "    return self."]


def test_address_line_models_and_health(server):
    assert server.url.startswith("http://127.0.0.1:")
    models = client(server).models.list()
    assert [m.id for m in models.data] == [Path(server.line.split(": ", 1)[1].split(" on ")[0]).name]
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completions_equal_generate(server, ref):
    c = client(server)
    model = c.models.list().data[0].id
    for prompt in PROMPTS:
        want, finish = ref.text(ref.ids(prompt), 24)
        got = c.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == want and got.choices[0].finish_reason == finish
        assert got.usage.prompt_tokens == len(ref.ids(prompt))
        assert got.usage.completion_tokens == len(ref.new_ids(ref.ids(prompt), 24))
        chunks = list(c.completions.create(model=model, prompt=prompt, max_tokens=24, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == want
        assert chunks[-1].choices[0].finish_reason == finish
    ids = ref.ids(PROMPTS[0])  # a prompt of token ids
    got = c.completions.create(model=model, prompt=ids, max_tokens=10)
    assert got.choices[0].text == ref.text(ids, 10)[0]
    # extensions in the body: repeat_penalty (after a reused prefix), ignore_eos
    got = c.completions.create(model=model, prompt=ids, max_tokens=20, extra_body={"repeat_penalty": 1.5})
    assert got.usage.prompt_tokens_details.cached_tokens > 0
    assert got.choices[0].text == ref.text(ids, 20, repeat_penalty=1.5)[0]
    got = c.completions.create(model=model, prompt=ids, max_tokens=20, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 20 == len(ref.new_ids(ids, 20, stop_at_eos=False))


def test_chat_equals_generate(server, ref):
    c = client(server)
    messages = [{"role": "system", "content": "python"}, {"role": "user", "content": "a sorting function"}]
    want, finish = ref.text(ref.chat_ids(messages), 30)
    got = c.chat.completions.create(model=c.models.list().data[0].id, messages=messages, max_tokens=30)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    assert got.choices[0].finish_reason == finish and got.object == "chat.completion"
    stream = c.chat.completions.create(model=got.model, messages=messages, max_tokens=30, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == got.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == finish


def test_raw_sse_chunks(server, ref):
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text(ref.ids(PROMPTS[1]), 12)[0]
    assert [c["choices"][0]["finish_reason"] for c in chunks][:-1] == [None] * (len(chunks) - 1)


def test_stop_strings_cut_the_text(server, ref):
    prompt = PROMPTS[0]
    full, _ = ref.text(ref.ids(prompt), 40)
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # three characters in the middle of the reply
    assert stop and stop in full
    want = full[: full.index(stop)]
    c = client(server)
    model = c.models.list().data[0].id
    got = c.completions.create(model=model, prompt=prompt, max_tokens=40, stop=[stop, "\x01never"])
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=model, prompt=prompt, max_tokens=40, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == want


def test_errors_have_openai_bodies_and_change_nothing(server, ref):
    prompt = ref.ids(PROMPTS[2])
    first = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5}).json()
    cases = [  # (path, body, status, words the message must contain)
        ("/v1/completions", b"{not json", 400, ["not valid JSON"]),
        ("/v1/completions", b"[1, 2]", 400, ["JSON object"]),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, ["'gpt-4'", "does not exist"]),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, ["max_tokens", "'ten'"]),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, ["temperature"]),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, ["stream"]),
        ("/v1/completions", {"prompt": 7}, 400, ["prompt"]),
        ("/v1/completions", {"prompt": ["a", 7]}, 400, ["prompt[1]", "prompt must be"]),
        ("/v1/completions", {"prompt": ["a", [1, 999]]}, 400, ["prompt[1]", "255"]),
        ("/v1/completions", {"prompt": [1, 2, 999]}, 400, ["prompt", "255"]),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, ["stop"]),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens", ">= 1"]),
        ("/v1/completions", {"prompt": "x", "max_tokens": MAX_LEN}, 400, ["(1 tokens)", f"({MAX_LEN})", str(MAX_LEN)]),
        ("/v1/completions", {"prompt": "x" * 300, "max_tokens": 300}, 400, ["(300 tokens)", "(300)", "600"]),
        ("/v1/completions", {"prompt": "x", "n": 2}, 400, ["n must be 1"]),
        ("/v1/chat/completions", {"messages": []}, 400, ["messages"]),
        ("/v1/chat/completions", {"messages": "hi"}, 400, ["messages"]),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, ["role"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, ["content"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
         400, ["max_completion_tokens"]),
        ("/v1/nowhere", {}, 404, ["/v1/nowhere"]),
    ]
    for path, body, status, words in cases:
        r = _post(server, path, body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"], err
        assert all(w in err["message"] for w in words), (words, err["message"])
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    with pytest.raises(openai.BadRequestError):  # the client raises its own class for the 400 body
        client(server).completions.create(model=first["model"], prompt="x", max_tokens=0)
    again = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5}).json()
    assert again["choices"] == first["choices"]
    # the refusals did not touch the cache: the same prompt reuses all of it but the token it must prefill
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1


@pytest.fixture(scope="module")
def plain_server():
    """The embedded model as it is: no chat template."""
    s = Server(default_model_path())
    yield s
    s.stop()


def test_chat_without_template_is_refused(plain_server):
    r = _post(plain_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    ok = _post(plain_server, "/v1/completions", {"prompt": "def ", "max_tokens": 3})
    assert ok.status_code == 200


def test_prefix_reuse_on_completions(server, ref):
    a, b = ref.ids("def area(r):\n    return"), ref.ids("\n\ndef volume(r, h):\n")
    first = _post(server, "/v1/completions", {"prompt": a, "max_tokens": 6}).json()
    held = a + ref.new_ids(a, 6)[:-1]
    n = 0
    while n < min(len(held), len(a + b)) and held[n] == (a + b)[n]:
        n += 1
    second = _post(server, "/v1/completions", {"prompt": a + b, "max_tokens": 6}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == n >= len(a)
    assert second["choices"][0]["text"] == ref.text(a + b, 6)[0]
    assert first["usage"]["prefill_ms"] > 0 and second["usage"]["ms_per_token"] >= 0


def test_five_turn_chat_prefills_only_each_new_turn(server, ref):
    c = client(server)
    model = c.models.list().data[0].id
    c.completions.create(model=model, prompt="x", max_tokens=1)  # something else in the cache first
    messages = [{"role": "system", "content": "You write Python."}]
    prev = None
    for turn, ask in enumerate(["a loop", "a class", "a dict", "a try block", "a with block"]):
        messages.append({"role": "user", "content": ask})
        prompt = ref.chat_ids(messages)
        want, _ = ref.text(prompt, 16)
        got = c.chat.completions.create(model=model, messages=messages, max_tokens=16)
        u = got.usage
        assert got.choices[0].message.content == want, turn
        assert u.prompt_tokens == len(prompt)
        if prev is not None:  # the cache held the previous prompt and reply (its last token not fed back)
            assert u.prompt_tokens_details.cached_tokens == prev.prompt_tokens + prev.completion_tokens - 1
            assert u.prompt_tokens - u.prompt_tokens_details.cached_tokens < len(ask) + 40  # the new turn only
        prev = u
        messages.append({"role": "assistant", "content": got.choices[0].message.content})


@pytest.fixture(scope="module")
def long_prompt(ref) -> tuple[list[int], int]:
    """A prompt whose greedy continuation runs 300 tokens without EOS (so only a cancel can end it early)."""
    for text in ["class Parser:\n    def __init__(self", "def main():\n    for i in range(", *PROMPTS]:
        ids = ref.ids(text)
        if len(ref.new_ids(ids, 300)) == 300:
            return ids, 300
    pytest.skip("no prompt here decodes 300 tokens without EOS")


def test_disconnect_mid_stream_stops_it_and_the_next_request_is_correct(server, ref, long_prompt):
    prompt, n = long_prompt
    before = httpx.get(server.url + "/health").json()
    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": n,
                                                                     "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first text: leave
    deadline = time.monotonic() + 20
    while httpx.get(server.url + "/health").json()["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.02)
    after = httpx.get(server.url + "/health").json()
    assert after["decoded_tokens"] - before["decoded_tokens"] < n  # stopped early, at a read-back
    got = _post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 20}).json()
    assert got["choices"][0]["text"] == ref.text(ref.ids(PROMPTS[0]), 20)[0]


def test_concurrent_clients_answered_or_refused(server, ref):
    clients, per_client, n = 8, 12, 8
    expected = {p: ref.text(ref.ids(p), n)[0] for p in PROMPTS}

    def one_client(k: int) -> list[tuple[int, bool, str | None]]:
        out = []
        with httpx.Client(timeout=60) as h:
            for i in range(per_client):
                prompt = PROMPTS[(k + i) % len(PROMPTS)]
                r = h.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": n})
                if r.status_code == 429:
                    out.append((429, int(r.headers["retry-after"]) >= 1, r.json()["error"]["code"]))
                else:
                    out.append((r.status_code, r.json()["choices"][0]["text"] == expected[prompt], None))
        return out

    with ThreadPoolExecutor(clients) as pool:  # warm: the server's allocations reach their steady state
        list(pool.map(one_client, range(clients)))
    rss0 = server.rss_kb()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for xs in pool.map(one_client, range(clients)) for x in xs]
    rss1 = server.rss_kb()
    assert len(results) == clients * per_client
    assert all(ok for _, ok, _ in results), [r for r in results if not r[1]][:3]
    assert {status for status, _, _ in results} <= {200, 429}
    assert all(code == "queue_full" for status, _, code in results if status == 429)
    assert sum(status == 200 for status, _, _ in results) >= clients  # every client got answers
    print(f"server RSS {rss0} -> {rss1} KiB over {len(results)} requests")
    assert rss1 - rss0 < 16 * 1024, (rss0, rss1)  # KiB: flat, not growing with the requests served


def _shutdown(s: Server, sig: int, long_prompt: tuple[list[int], int]) -> None:
    prompt, n = long_prompt
    answers: list[object] = []

    def open_request(stream: bool) -> None:
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": n,
                                                                       "stream": stream}, timeout=30) as r:
                answers.append((r.status_code, r.read()))
        except httpx.HTTPError as e:  # the connection closed: an answer too (not a hang)
            answers.append(e)

    threads = [threading.Thread(target=open_request, args=(stream,)) for stream in (True, False, False)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    t0 = time.monotonic()
    s.proc.send_signal(sig)
    code = s.proc.wait(timeout=10)
    took = time.monotonic() - t0
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads), "a request was left hanging"
    assert len(answers) == 3
    assert code == 0 and took < 1.0, (code, took)


# The last tests: each stops its server (the fixtures' teardown then finds it gone).
def test_a_lone_surrogate_or_a_failing_template_gets_an_openai_error(server, ref):
    """JSON allows "\\ud800"; the tokenizer does not: 400 naming the field, OpenAI's body, the server unharmed."""
    cases = [("/v1/completions", b'{"prompt": "def \\ud800", "max_tokens": 2}', "prompt"),
             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\udfff"}], "max_tokens": 2}',
              "messages")]
    for path, raw, param in cases:
        r = _post(server, path, raw)
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
        err = r.json()["error"]
        assert err["param"] == param and "lone surrogate" in err["message"], err
    ok = _post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref.text(ref.ids(PROMPTS[0]), 4)[0]


UNHONOURED = [  # (field, a value that changes the output, the endpoints that take it)
    ("echo", True, "chat"),
    ("response_format", {"type": "json_object"}, "both"),
    ("grammar", "root ::= \"a\"", "both"), ("best_of", 3, "completions"), ("typical_p", 0.5, "both"),
    ("guided_json", {"type": "object"}, "both"),
]


def test_fields_the_server_does_not_honour_are_refused_not_dropped(server):
    bodies = {"completions": {"prompt": "def ", "max_tokens": 2},
              "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    for field, value, where in UNHONOURED:
        for kind in (("completions", "chat") if where == "both" else (where,)):
            path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
            r = _post(server, path, {**bodies[kind], field: value})
            assert r.status_code == 400, (field, r.text)
            err = r.json()["error"]
            assert err["param"] == field and f"{field} is not supported" in err["message"], err
    # their neutral values change nothing and are accepted
    neutral = {"logprobs": None, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
               "response_format": {"type": "text"}, "min_p": 0, "tools": [], "top_logprobs": 0}
    for kind, body in bodies.items():
        path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
        r = _post(server, path, {**body, **neutral})
        assert r.status_code == 200, r.text
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="typical_p is not supported"):
        c.chat.completions.create(model=c.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=2, extra_body={"typical_p": 0.5})
    with pytest.raises(openai.BadRequestError, match="response_format is not supported"):
        c.completions.create(model=c.models.list().data[0].id, prompt="x", max_tokens=2,
                             extra_body={"response_format": {"type": "json_object"}})


@pytest.mark.parametrize(("flags", "words"), [
    (["--temperature", "-1"], "--temperature -1.0: temperature must be 0"),
    (["--top-p", "0"], "--top-p 0.0: top_p must be in (0, 1]"),
    (["--repeat-penalty", "0"], "--repeat-penalty 0.0: repeat_penalty must be"),
    (["--repeat-penalty", "1.3", "--speculate", "prompt-lookup"],
     "--repeat-penalty 1.3 is not supported with --speculate"),
])
def test_serve_refuses_bad_defaults_at_startup(flags, words):
    proc = subprocess.run([sys.executable, "-m", "static_decode", "serve", "--port", "0", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"static-decode serve: error: {words}"), proc.stderr


def test_sigint_stops_within_a_second(plain_server, long_prompt):
    _shutdown(plain_server, signal.SIGINT, long_prompt)


def test_sigterm_stops_within_a_second(server, long_prompt):
    _shutdown(server, signal.SIGTERM, long_prompt)

