"""Tool calls out of `serve`: parsed into `message.tool_calls`, streamed as `delta.tool_calls`, and forced by
`tool_choice` through structured output on the device.

A tiny random Qwen3 checkpoint with Qwen3's real chat template (tests/support/qwen3.py), served with --structured:
`tool_choice` naming a function, or "required" over two tools, gives finish_reason "tool_calls" and calls whose
arguments validate against the tool's schema (jsonschema), the same streamed and not; in process, the forced
reply's text is exactly what the template writes for the parsed call (so the call round-trips), and the next turn's
prompt (assistant tool_calls, a tool message) is transformers' apply_chat_template to the id; the embedded model
with a template that writes no calls is forced into the Hermes form; "auto" parses a call the model writes and
leaves text as content; a forced call without --structured, naming a missing function, or beside response_format
is a 400 naming the field.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
jsonschema = pytest.importorskip("jsonschema")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from static_decode import Generator, load_model  # noqa: E402
from static_decode.checkpoints.loading import load_tokenizer  # noqa: E402
from static_decode.commands.serve import api  # noqa: E402
from static_decode.commands.serve.structured import GrammarCache  # noqa: E402
from static_decode.generation.structured import DEFAULT_GRAMMAR_TABLES  # noqa: E402
from static_decode.text import tool_calls as tc  # noqa: E402
from static_decode.text.chat_template import load_chat_template  # noqa: E402
from tests.support.qwen3 import qwen3_tokenizer_dir  # noqa: E402
from tests.support.servers import Server, _post  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_LEN = 2048  # the byte-level tokenizer spells the tools out: ~900 prompt tokens


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A random Qwen3ForCausalLM over the Qwen3-shaped byte tokenizer (ids 0..264; EOS <|im_end|> = 258)."""
    d = qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3_tools"))
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=1024, eos_token_id=258, bos_token_id=None,
                                   pad_token_id=256, tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server(qwen3_dir):
    s = Server(qwen3_dir, "--structured", "--max-len", str(MAX_LEN))
    yield s
    s.stop()


def check_call(call: dict, names: list[str]) -> dict:
    """A response's call: OpenAI's shape, a listed name, arguments a JSON object valid under its tool's schema."""
    assert call["type"] == "function" and isinstance(call["id"], str) and call["id"]
    assert call["function"]["name"] in names
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, SCHEMAS[call["function"]["name"]])
    return args


def streamed_calls(server: Server, body: dict) -> tuple[list[dict], str | None, str]:
    """(the calls assembled from delta.tool_calls, the finish_reason, the content) of a streamed chat."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for e in events:
        for choice in e["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for c in delta.get("tool_calls") or []:
                got = calls.setdefault(c["index"], {"id": c.get("id"), "type": c.get("type"),
                                                    "function": {"name": "", "arguments": ""}})
                got["function"]["name"] += c["function"].get("name") or ""
                got["function"]["arguments"] += c["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_a_forced_call_is_valid_streamed_and_not(server, choice):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 120}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None, out
    names = ["get_weather"] if choice == NAMED else ["get_weather", "add"]
    (call,) = out["message"]["tool_calls"]
    args = check_call(call, names)
    calls, finish, content = streamed_calls(server, body)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert check_call(calls[0], names) == args and calls[0]["function"] == call["function"]
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    typed = c.chat.completions.create(model=c.models.list().data[0].id, messages=MESSAGES, tools=TOOLS,
                                      tool_choice=choice, max_tokens=120)
    assert typed.choices[0].message.tool_calls[0].function.name == call["function"]["name"]


def test_the_forced_reply_is_the_templates_call_and_the_history_is_transformers(qwen3_dir):
    """In process: the forced reply's text is what Qwen3's template writes for the call parsed out of it, and the
    next request's prompt (that call, a tool result) is transformers' rendering, id for id."""
    tok, template = load_tokenizer(qwen3_dir), load_chat_template(qwen3_dir)
    gen = Generator(load_model(qwen3_dir), max_len=MAX_LEN, grammar_tables=DEFAULT_GRAMMAR_TABLES)
    ctx = api.Context(model_name="m", tokenizer=tok, template=template, vocab_size=272, max_len=MAX_LEN,
                      grammars=GrammarCache(tok, 272, gen.eos_token_ids))
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 120}
    req = api.parse(json.dumps(body).encode(), ctx, chat=True)
    assert req.tool_format is tc.HERMES and req.grammar is not None
    out = gen.generate(req.prompt_ids, 120, grammar=req.grammar)
    assert out[-1] == 258  # EOS after the call
    text = tok.decode(out[:-1], skip_special_tokens=False)
    content, (call,) = tc.parse(tc.HERMES, text)
    assert content == ""
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
    prompt = template.render(MESSAGES, tools=TOOLS)
    rendered = template.render([*MESSAGES, turn], tools=TOOLS, add_generation_prompt=False)
    # the turn as the template writes it: its (empty) reasoning block, then the call exactly as the model wrote it
    assert rendered == prompt + "<think>\n\n</think>\n\n" + text + "<|im_end|>\n"
    history = [*MESSAGES, turn, {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'}]
    ids = api.parse(json.dumps({"messages": history, "tools": TOOLS, "max_tokens": 4}).encode(), ctx,
                    chat=True).prompt_ids
    hf = transformers.AutoTokenizer.from_pretrained(qwen3_dir)
    want = hf.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True)
    assert ids == list(want["input_ids"] if hasattr(want, "keys") else want)


def test_auto_parses_what_the_model_writes_and_keeps_text_as_content(server):
    """tool_choice "auto": a reply that is a call (pushed by logit bias through its first token) is parsed, one that
    is text stays content (finish_reason stop or length)."""
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 8, "logit_bias": {"259": 100}}  # <tool_call>
    out = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert out["finish_reason"] == "length" and "tool_calls" not in out["message"]  # an unfinished call is text
    assert out["message"]["content"].startswith("<tool_call>")
    plain = _post(server, "/v1/chat/completions", {**body, "logit_bias": {"259": -100}}).json()["choices"][0]
    assert "tool_calls" not in plain["message"] and plain["finish_reason"] in ("stop", "length")
    none = _post(server, "/v1/chat/completions", {**body, "tool_choice": "none"}).json()["choices"][0]
    assert "tool_calls" not in none["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", ["'nope'", "get_weather"]),
    ({"tool_choice": "required", "tools": []}, "tool_choice", ["no tools"]),
    ({"tool_choice": {"type": "function"}}, "tool_choice", ["name a function"]),
    ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice", ["response_format"]),
])
def test_bad_forcing_is_refused_by_name(server, body, param, words):
    r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert all(w in r.json()["error"]["message"] for w in words), r.text


def test_without_structured_a_forced_call_is_refused(qwen3_dir):
    s = Server(qwen3_dir, "--max-len", str(MAX_LEN))
    try:
        r = _post(s, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"})
        assert r.status_code == 400 and "--structured" in r.json()["error"]["message"]
    finally:
        s.stop()
