"""The small endpoints of `static-decode serve`: /tokenize and /detokenize (llama-server's), and `--metrics`'
Prometheus /metrics, against a live server.

The tokenizer is the byte tokenizer with "<think>" (256), "</think>" (257) and a BOS "<s>" (258) that its
post-processor adds when special tokens are asked for, so the ids of a text are its bytes: exact values. The
metrics are read with prometheus-client's own parser; their counts must follow the requests this test makes
(the server answers nothing else meanwhile), and the histograms hold the usage numbers the responses reported.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
prometheus = pytest.importorskip("prometheus_client.parser")

from tests.support.scripted import scripted_checkpoint  # noqa: E402
from tests.support.servers import Server, _post  # noqa: E402

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
SCRIPT = [ord(">"), *b"ok"]
BOS = 258


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = scripted_checkpoint(tmp_path_factory.mktemp("endpoints"), SCRIPT, added=["<think>", "</think>"],
                            template=TEMPLATE)
    s = Server(d, "--metrics")
    yield s
    s.stop()


def test_tokenize_and_detokenize(server) -> None:
    text = "a<think>é</think>"
    ids = [97, 256, 0xC3, 0xA9, 257]
    assert _post(server, "/tokenize", {"content": text}).json() == {"tokens": ids}
    assert _post(server, "/tokenize", {"content": text, "add_special": True}).json() == {"tokens": [BOS, *ids]}
    assert _post(server, "/tokenize", {"content": ""}).json() == {"tokens": []}
    assert _post(server, "/detokenize", {"tokens": [BOS, *ids]}).json() == {"content": "<s>" + text}
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"content": ""}


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/tokenize", {}, "content", ["content must be a string", "null"]),
    ("/tokenize", {"content": 5}, "content", ["content must be a string", "5"]),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special", ["add_special must be a boolean"]),
    ("/tokenize", {"content": "x", "with_pieces": True}, "with_pieces", ["with_pieces true is not supported"]),
    ("/tokenize", {"content": "x", "parse_special": False}, "parse_special", ["parse_special false"]),
    ("/tokenize", {"content": "x", "tokens": [1]}, "tokens", ["tokens is not a field", "content, add_special"]),
    ("/tokenize", b'{"content": "\\ud800"}', "content", ["lone surrogate 0xd800"]),
    ("/tokenize", b"[1]", None, ["JSON object"]),
    ("/detokenize", {"tokens": [97, 999]}, "tokens", ["tokens[1] = 999", "0..258"]),
    ("/detokenize", {"tokens": [97, -1]}, "tokens", ["tokens[1] = -1"]),
    ("/detokenize", {"tokens": [True]}, "tokens", ["tokens[0] = true"]),
    ("/detokenize", {"tokens": "97"}, "tokens", ["tokens must be a list", '"97"']),
    ("/detokenize", b"{not json", None, ["not valid JSON"]),
])
def test_bad_bodies_are_refused_naming_the_field(server, path, body, param, words) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


def _metrics(server) -> dict[str, dict[tuple, float]]:
    """name -> {labels as a sorted tuple: value} of every sample /metrics shows."""
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for family in prometheus.text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _count(m, endpoint: str, status: int) -> float:
    return m.get("static_decode_requests_total", {}).get((("endpoint", endpoint), ("status", str(status))), 0.0)


def test_metrics_count_requests_and_time_them(server) -> None:
    before = _metrics(server)
    usages = []
    for _ in range(3):
        r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
        usages.append(r.json()["usage"])
    assert _post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    assert _post(server, "/nowhere", {}).status_code == 404
    assert httpx.get(server.url + "/v1/completions", timeout=30).status_code == 405
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      json={"prompt": "<a>", "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: {")]
    usages.append(json.loads(events[-1][6:])["usage"])
    after = _metrics(server)
    assert _count(after, "/v1/chat/completions", 200) - _count(before, "/v1/chat/completions", 200) == 3
    assert _count(after, "/v1/chat/completions", 400) - _count(before, "/v1/chat/completions", 400) == 1
    assert _count(after, "other", 404) - _count(before, "other", 404) == 1
    assert _count(after, "/v1/completions", 405) - _count(before, "/v1/completions", 405) == 1
    assert _count(after, "/v1/completions", 200) - _count(before, "/v1/completions", 200) == 1
    assert _count(after, "/metrics", 200) - _count(before, "/metrics", 200) == 1  # the first read
    assert after["static_decode_queue_depth"][()] == 0

    def grew(name: str) -> float:
        return after[name][()] - before.get(name, {}).get((), 0.0)

    assert grew("static_decode_prefill_ms_count") == grew("static_decode_ms_per_token_count") == 4
    assert grew("static_decode_prefill_ms_sum") == pytest.approx(sum(u["prefill_ms"] for u in usages), abs=0.01)
    assert grew("static_decode_ms_per_token_sum") == pytest.approx(sum(u["ms_per_token"] for u in usages), abs=0.01)
    every = after["static_decode_ms_per_token_bucket"][(("le", "+Inf"),)]
    assert every == after["static_decode_ms_per_token_count"][()]
