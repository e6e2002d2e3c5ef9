"""`serve --reasoning-format deepseek` against a live server whose model's reply is known in advance.

The checkpoint is scripted (tests/support/scripted.py): after the chat template's generation prompt it emits
"<think>", "\\n", "H", "m", "</think>", " ", "O", "K" and EOS, one token each, so the reply's text is exactly
"<think>\\nHm</think> OK". The reference values are the split of that text: reasoning "Hm", content "OK". With
the template variable `open_thinking` the prompt itself ends with "<think>" and the model continues inside its
reasoning. Streamed, the deltas join to the same strings; reasoning_format "none" (the request's) leaves the text in
content as it is.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("starlette")

from tests.support.scripted import scripted_checkpoint  # noqa: E402
from tests.support.servers import Server, _post, client  # noqa: E402

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if open_thinking %}<think>{% endif %}{% endif %}")
THINK, END_THINK = 256, 257
SCRIPT = [ord(">"), THINK, *b"\nHm", END_THINK, *b" OK"]  # '>' ends the generation prompt
REPLY = "<think>\nHm</think> OK"
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = scripted_checkpoint(tmp_path_factory.mktemp("scripted"), SCRIPT, added=["<think>", "</think>"],
                            template=TEMPLATE)
    s = Server(d, "--reasoning-format", "deepseek")
    yield s
    s.stop()


def _streamed(server, **body) -> tuple[str, str, list[dict]]:
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={"messages": ASK, "stream": True, **body},
                      timeout=30) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    return ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas),
            chunks)


def test_the_reply_is_the_script(server) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": ASK, "reasoning_format": "none"}).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    assert r["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("opened", [False, True], ids=["the reply opens <think>", "the prompt opens it"])
def test_reasoning_content_apart_from_content(server, opened) -> None:
    body = {"messages": ASK, "chat_template_kwargs": {"open_thinking": opened}}
    whole = _post(server, "/v1/chat/completions", body).json()
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "OK", "reasoning_content": "Hm"}
    reasoning, content, chunks = _streamed(server, **body)
    assert (reasoning, content) == ("Hm", "OK")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(set(c["choices"][0]["delta"]) <= {"role", "content", "reasoning_content"} for c in chunks)


def test_the_openai_client_reads_both(server) -> None:
    c = client(server)
    got = c.chat.completions.create(model=c.models.list().data[0].id, messages=ASK)
    assert got.choices[0].message.content == "OK"
    assert got.choices[0].message.model_extra["reasoning_content"] == "Hm"
    stream = list(c.chat.completions.create(model=got.model, messages=ASK, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == "OK"
    assert "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for ch in stream) == "Hm"


def test_a_request_may_turn_it_off_and_a_cut_reply_is_all_reasoning(server) -> None:
    reasoning, content, _ = _streamed(server, reasoning_format="none")
    assert (reasoning, content) == ("", REPLY)
    cut = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 3}).json()["choices"][0]
    assert cut["message"] == {"role": "assistant", "content": "", "reasoning_content": "H"}
    assert cut["finish_reason"] == "length"
    r = _post(server, "/v1/chat/completions", {"messages": ASK, "reasoning_format": "qwen"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format"
    assert "none, deepseek" in r.json()["error"]["message"]
