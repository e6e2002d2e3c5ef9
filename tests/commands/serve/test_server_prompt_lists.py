"""/v1/completions with `prompt` as a list of prompts (what lm-evaluation-harness sends with batch_size > 1, and other
batch clients), against a live server.

Pins: a list of strings or of token-id lists answers one choice per prompt, `index` in order, each equal to that
prompt alone (the library's greedy tokens in this process); usage is the sum; prompts sharing a prefix reuse it
(cached tokens counted); streamed, every chunk names its choice's index, each choice's text adds up to the same
answer and ends with its finish_reason, and the usage chunk comes once, at the end; echo and logprobs hold per
prompt; a bad prompt anywhere in the list refuses the whole request, naming its index, before anything runs.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from static_decode import Generator, load_model  # noqa: E402
from static_decode.checkpoints.loading import load_tokenizer  # noqa: E402
from tests.support.servers import MAX_LEN, _post, client  # noqa: E402

PROMPTS = ["def fib(n):", "import os\n\nclass ", "def fib(n):\n    if n"]


@pytest.fixture(scope="module")
def ref(chat_model):
    """(generator, tokenizer) on the same checkpoint, in process."""
    return Generator(load_model(chat_model), max_len=MAX_LEN), load_tokenizer(chat_model)


def answer(ref, ids: list[int], n: int) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of a greedy request for `ids` alone."""
    gen, tok = ref
    out = gen.generate(ids, n)
    eos = bool(out) and out[-1] in gen.eos_token_ids
    return tok.decode(out[:-1] if eos else out, skip_special_tokens=True), "stop" if eos else "length", len(out)


def test_a_prompt_list_answers_each_prompt_as_alone(server, ref):
    _, tok = ref
    ids = [tok.encode(p).ids for p in PROMPTS]
    want = [answer(ref, i, 12) for i in ids]
    c = client(server)
    model = c.models.list().data[0].id
    for prompt in (PROMPTS, ids):  # strings, then token-id lists
        r = c.completions.create(model=model, prompt=prompt, max_tokens=12)
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        assert [(ch.text, ch.finish_reason) for ch in r.choices] == [w[:2] for w in want]
        assert r.usage.prompt_tokens == sum(map(len, ids))
        assert r.usage.completion_tokens == sum(w[2] for w in want)
    # the third prompt extends the first: its prefix is reused from the cache (the second ran in between, so at
    # least what the first and third share, less the token a request must prefill)
    body = {"prompt": [PROMPTS[0], PROMPTS[2]], "max_tokens": 12}
    r = _post(server, "/v1/completions", body).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids[0]) - 1

    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPTS, "max_tokens": 12, "stream": True,
                            "stream_options": {"include_usage": True}}) as s:
        lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    texts, finishes = ["", "", ""], [None, None, None]
    for e in events[:-1]:
        (choice,) = e["choices"]
        assert finishes[choice["index"]] is None and all(f is not None for f in finishes[: choice["index"]])
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]] = choice["finish_reason"]
    assert list(zip(texts, finishes, strict=True)) == [w[:2] for w in want]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == sum(w[2] for w in want)


def test_echo_and_logprobs_hold_per_prompt(server, ref):
    gen, tok = ref
    body = {"prompt": PROMPTS[:2], "max_tokens": 3, "logprobs": 1, "echo": True, "ignore_eos": True}
    r = _post(server, "/v1/completions", body).json()
    for prompt, choice in zip(PROMPTS[:2], r["choices"], strict=True):
        alone = _post(server, "/v1/completions", {**body, "prompt": prompt}).json()["choices"][0]
        assert choice["text"] == alone["text"] and choice["text"].startswith(prompt)
        assert len(choice["logprobs"]["tokens"]) == len(tok.encode(prompt).ids) + 3
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-5)


def test_a_bad_prompt_anywhere_refuses_the_whole_list(server):
    before = httpx.get(server.url + "/health").json()
    for prompt, words in ((["fine", ""], ["prompt[1]"]), (["fine", [1, 2, 10**6]], ["prompt[1]", "255"]),
                          ([[1, 2], "x", 3.5], ["prompt[2]"])):
        r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and all(w in r.json()["error"]["message"] for w in words), r.text
        assert r.json()["error"]["param"] == "prompt"
    r = _post(server, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": MAX_LEN})
    assert r.status_code == 400 and "prompt[0]" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json()["completed"] == before["completed"]  # nothing ran
