"""`static-decode serve` with a real chat template's arguments: tools, tool calls and results in the history,
tool_choice, chat_template_kwargs (and --chat-template-kwargs), against a live server on 127.0.0.1.

The checkpoint is a tiny random Qwen3-shaped model: the byte tokenizer with Qwen3's added tokens and Qwen3's real
chat template (tests/support/qwen3.py). The reference for the prompt is transformers'
`AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tools=..., add_generation_prompt=True, **kwargs)`:
the server's prompt has its length (usage.prompt_tokens) and its greedy reply is the in-process generator's reply
to exactly those ids. Refusals name their field and change nothing.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("starlette")
transformers = pytest.importorskip("transformers")

from static_decode import Generator, load_model  # noqa: E402
from static_decode.checkpoints.loading import load_tokenizer  # noqa: E402
from tests.support.checkpoints import hf_llama, rewrite_config, save  # noqa: E402
from tests.support.qwen3 import qwen3_tokenizer_dir  # noqa: E402
from tests.support.servers import Server, _post, client  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
AGENT = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": "", "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "grey"}'}]
DEFAULTS = {"enable_thinking": False}  # the server's --chat-template-kwargs
NEW = 12
MAX_LEN = 2048  # the byte tokenizer's prompts are long: Qwen3's tool preamble alone is ~600 tokens


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    d = save(hf_llama(seed=3, vocab=272, eos=None), tmp_path_factory.mktemp("qwen3_served"))
    rewrite_config(d, lambda c: c.update(max_position_embeddings=MAX_LEN))
    return qwen3_tokenizer_dir(d)


@pytest.fixture(scope="module")
def server(qwen3_model):
    s = Server(qwen3_model, "--chat-template-kwargs", json.dumps(DEFAULTS), "--max-len", str(MAX_LEN))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref(qwen3_model):
    """transformers' prompt ids, and the greedy reply to them on the same checkpoint, in process."""
    hf = transformers.AutoTokenizer.from_pretrained(qwen3_model)
    gen = Generator(load_model(qwen3_model), max_len=MAX_LEN, eos_token_ids=[])
    tok = load_tokenizer(qwen3_model)

    class Ref:
        def ids(self, messages, tools=None, **kwargs) -> list[int]:
            out = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kwargs)
            return list(out["input_ids"]) if hasattr(out, "keys") else list(out)

        def reply(self, ids: list[int]) -> str:
            return tok.decode(gen.generate(ids, NEW), skip_special_tokens=True)

    return Ref()


def _chat(server, **body) -> dict:
    r = _post(server, "/v1/chat/completions", {"max_tokens": NEW, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(("messages", "tools"), [(AGENT, TOOLS), (AGENT[1:2], TOOLS), (AGENT[:2], None)],
                         ids=["a tool call and its result", "tools, one user turn", "no tools"])
@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": True}, {"enable_thinking": False}],
                         ids=["server default", "thinking on", "thinking off"])
def test_prompt_ids_equal_transformers(server, ref, messages, tools, kwargs) -> None:
    body = {"messages": messages, **({} if tools is None else {"tools": tools, "tool_choice": "auto"}),
            **({} if kwargs is None else {"chat_template_kwargs": kwargs})}
    want = ref.ids(messages, tools, **{**DEFAULTS, **(kwargs or {})})
    got = _chat(server, **body)
    assert got["usage"]["prompt_tokens"] == len(want)
    assert got["choices"][0]["message"]["content"] == ref.reply(want)


def test_the_openai_client_with_tools_streamed_and_not(server, ref) -> None:
    c = client(server)
    model = c.models.list().data[0].id
    want = ref.reply(ref.ids(AGENT, TOOLS, enable_thinking=True))
    kw = {"model": model, "messages": AGENT, "tools": TOOLS, "tool_choice": "none", "max_tokens": NEW,
          "extra_body": {"chat_template_kwargs": {"enable_thinking": True}, "ignore_eos": True}}
    got = c.chat.completions.create(**kw)
    assert got.choices[0].message.content == want and got.choices[0].message.tool_calls is None
    chunks = list(c.chat.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want


def test_assistant_content_null_is_given_to_the_template_as_transformers_gives_it(server, ref) -> None:
    """Qwen3's template adds message.content: a null one fails there as in transformers (a 400 naming messages);
    the same turn with content "" renders."""
    null = [*AGENT[:2], {**AGENT[2], "content": None}, AGENT[3]]
    with pytest.raises(Exception, match="content"):
        ref.ids(null, TOOLS)
    r = _post(server, "/v1/chat/completions", {"messages": null, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "chat template failed" in r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tool_choice": "required", "tools": TOOLS}, "tool_choice",
     ['"required"', "is not supported by this server", "--structured"]),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "tools": TOOLS}, "tool_choice",
     ["is not supported by this server", "get_weather", "--structured"]),
    ({"tool_choice": "sometimes"}, "tool_choice", ['"sometimes"']),
    ({"tools": {"name": "f"}}, "tools", ["tools must be a list"]),
    ({"tools": [{"type": "retrieval"}]}, "tools", ["tools[0]", "retrieval"]),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", ["tools[0]"]),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", ["must be a JSON object"]),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", ["may not set 'messages'"]),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     ["'add_generation_prompt'"]),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", ["parallel_tool_calls is not supported"]),
    ({"documents": [{"title": "a", "text": "b"}]}, "documents", ["documents is not supported"]),
    ({"chat_template": "{{ messages }}"}, "chat_template", ["chat_template is not supported"]),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages", ["messages[0].tool_call_id"]),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages",
     ["messages[0].tool_calls", "only an assistant"]),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages", ["messages[0].content", "null"]),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": "f"}]}]},
     "messages", ["messages[0].tool_calls[0]"]),
    ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages",
     ["messages[0].audio is not supported"]),
    ({"messages": [{"role": "user", "content": "x", "reasoning_content": "r"}]}, "messages",
     ["messages[0].reasoning_content", "assistant"]),
])
def test_refusals_name_their_field_and_change_nothing(server, body, param, words) -> None:
    ok = {"messages": AGENT[1:2], "max_tokens": 3}
    first = _post(server, "/v1/chat/completions", ok).json()
    r = _post(server, "/v1/chat/completions", {**ok, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err
    again = _post(server, "/v1/chat/completions", ok).json()
    assert again["choices"] == first["choices"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1


@pytest.mark.parametrize(("field", "value"), [("tools", TOOLS), ("tool_choice", "required"),
                                              ("chat_template_kwargs", {"enable_thinking": True}),
                                              ("reasoning_format", "deepseek")])
def test_completions_refuse_the_chat_only_fields(server, field, value) -> None:
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "/v1/chat/completions" in r.json()["error"]["message"]
    neutral = {"tools": [], "tool_choice": "auto", "chat_template_kwargs": {}, "reasoning_format": "none"}
    assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **neutral}).status_code == 200


def test_metrics_are_off_by_default(server) -> None:
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
