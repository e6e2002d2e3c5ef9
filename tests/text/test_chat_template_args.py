"""The chat template's own arguments: extra variables (enable_thinking), tools, tool calls and tool results in the
history, reasoning in earlier turns, the tokenizer's special tokens and a "tool_use" named template.

The reference is transformers' `AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, tools=...,
add_generation_prompt=True, **kwargs)` on the same directory: the ids of our rendering, tokenized as the server
tokenizes it, must equal its ids exactly. The template is Qwen3's real one (tests/support/qwen3_chat_template.jinja).
"""

from __future__ import annotations

import json

import pytest

from static_decode.text.chat_template import check_template_kwargs, load_chat_template
from tests.support.qwen3 import TEMPLATE, qwen3_tokenizer_dir

transformers = pytest.importorskip("transformers")

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "Städte too: é"}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "number"}}}}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORIES = {
    "one user turn": [{"role": "user", "content": "hi"}],
    "system and an earlier reply with its reasoning inline": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello"}, {"role": "user", "content": "again"}],
    "a tool call and its result": [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'}],
    "two calls, two results, reasoning_content given apart": [
        {"role": "user", "content": "Paris and 2+3?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "two tools",
         "tool_calls": [CALL, {"id": "call_2", "type": "function",
                               "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"}],
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(our template, our tokenizer, transformers' tokenizer) of one Qwen3-shaped directory."""
    from tokenizers import Tokenizer

    d = qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3"))
    return load_chat_template(d), Tokenizer.from_file(str(d / "tokenizer.json")), \
        transformers.AutoTokenizer.from_pretrained(d)


def _hf_ids(hf, messages, tools, kwargs) -> list[int]:
    out = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


@pytest.mark.parametrize("history", list(HISTORIES))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no tools", "tools"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}],
                         ids=["default", "thinking off", "thinking on"])
def test_qwen3_ids_equal_transformers(qwen3, history, tools, kwargs) -> None:
    template, tok, hf = qwen3
    messages = HISTORIES[history]
    text = template.render(messages, tools=tools, kwargs=kwargs)
    assert tok.encode(text, add_special_tokens=False).ids == _hf_ids(hf, messages, tools, kwargs)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False
                         else "<|im_start|>assistant\n")
    assert ("<tools>" in text) == (tools is not None)
    if tools is not None:  # each tool as one JSON line, as the template writes it
        assert all(json.dumps(t, ensure_ascii=False) in text for t in tools)


def test_qwen3_renders_the_call_and_result_turns(qwen3) -> None:
    template, _, _ = qwen3
    text = template.render(HISTORIES["a tool call and its result"], tools=TOOLS)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in text


# A template that reads a missing content, as Llama-3.1-style templates do (Qwen3's own fails on content: null,
# in transformers as here, since transformers drops None values and Qwen3's template adds message.content).
TOLERANT = (
    "{% for m in messages %}<{{ m.role }}>{% if m.content is defined %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }}({{ c.function.arguments }})]{% endfor %}"
    "{% if m.tool_call_id is defined %}(for {{ m.tool_call_id }}){% endif %}"
    "{% if m.thinking is defined %}{think {{ m.thinking }}}{% endif %}</{{ m.role }}>\n{% endfor %}"
    "{% if tools is not none %}{{ tools | tojson(indent=2, sort_keys=True) }}{% endif %}"
    "{% if documents is defined and documents is none %}|no documents|{% endif %}"
    "{{ pad_token }}{% if bos_token is defined %}BOS{% endif %}{{ greeting | default('') }}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_content_null_with_tool_calls_and_the_special_tokens(tmp_path) -> None:
    from tokenizers import Tokenizer

    d = qwen3_tokenizer_dir(tmp_path, chat_template=TOLERANT)
    template, tok = load_chat_template(d), Tokenizer.from_file(str(d / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(d)
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning": "check"},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"}]
    for tools, kwargs in [(None, {}), (TOOLS, {"greeting": "héllo"}), ([], {"pad_token": "PAD"})]:
        text = template.render(messages, tools=tools, kwargs=kwargs)
        assert tok.encode(text, add_special_tokens=False).ids == _hf_ids(hf, messages, tools, kwargs), text
    text = template.render(messages)
    assert "<assistant>[call call_1 get_weather" in text and "{think check}" in text and "(for call_1)" in text
    assert "<|endoftext|>" in text and "BOS" not in text  # pad is set, bos is not (so it is not defined)


def test_a_tool_use_named_template_is_used_with_tools(tmp_path) -> None:
    from tokenizers import Tokenizer

    d = qwen3_tokenizer_dir(tmp_path, chat_template="unused")
    (d / "chat_template.jinja").unlink()
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "plain:{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "tools:{{ tools | length }}:{{ messages[0].content }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    template, tok = load_chat_template(d), Tokenizer.from_file(str(d / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(d)
    messages = [{"role": "user", "content": "x"}]
    assert template.render(messages) == "plain:x"
    assert template.render(messages, tools=TOOLS) == "tools:2:x"
    for tools in (None, TOOLS):
        assert tok.encode(template.render(messages, tools=tools), add_special_tokens=False).ids == \
            _hf_ids(hf, messages, tools, {})


@pytest.mark.parametrize(("kwargs", "words"), [
    ([1], "must be a JSON object"),
    ("enable_thinking", "must be a JSON object"),
    ({"messages": []}, "may not set 'messages'"),
    ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
    ({"tools": []}, "may not set 'tools'"),
    ({"raise_exception": 1}, "may not set 'raise_exception'"),
    ({"not a name": 1}, "'not a name'"),
    ({"x": float("nan")}, "chat_template_kwargs['x'] must be a JSON value"),
    ({"x": {1, 2}}, "must be a JSON value"),
])
def test_bad_template_kwargs_are_refused_naming_them(qwen3, kwargs, words) -> None:
    with pytest.raises(ValueError) as e:
        check_template_kwargs(kwargs)
    assert words in str(e.value)
    with pytest.raises(ValueError):
        qwen3[0].render([{"role": "user", "content": "hi"}], kwargs=kwargs)


@pytest.mark.parametrize(("messages", "words"), [
    ([{"role": "user"}], "messages[0] has no content"),
    ([{"role": "user", "content": None}], "messages[0] has no content"),
    ([{"role": "assistant", "content": None}], "only an assistant message with tool_calls"),
    ([{"role": "user", "content": 3}], "messages[0].content must be a string"),
    ([{"role": "robot", "content": "x"}], "messages[0] must be"),
])
def test_bad_messages_are_refused_naming_them(qwen3, messages, words) -> None:
    with pytest.raises(ValueError) as e:
        qwen3[0].render(messages)
    assert words in str(e.value)


def test_the_fixture_is_qwen3s_template() -> None:
    """The committed text is the whole template, byte for byte (its length and the pieces that make it Qwen3's)."""
    text = TEMPLATE.read_text()
    assert len(text) == 4116 and text.count("\n") == 84 and not text.endswith("\n")
    assert "{%- if enable_thinking is defined and enable_thinking is false %}" in text
    assert text.startswith("{%- if tools %}\n    {{- '<|im_start|>system\\n' }}")
