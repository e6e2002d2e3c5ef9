"""Tool calls parsed out of replies (static_decode.text.tool_calls), on the templates' own renderings of calls.

For each family's real template (Qwen3's; Llama 3.2's, Mistral Nemo's and llama.cpp's Phi-4-mini one as llama.cpp
keeps them): the format is detected from the template's text; an assistant turn with calls, rendered by the template
(the text it adds after the generation prompt, less its end-of-turn marker), parses back to those calls (names,
arguments as the same JSON) and the text before them; any split of that text streamed through ToolCallSplit gives
the same; the rendering matches `call_regex` of the tools (what a forced call is held to), and a call of another
tool or with arguments outside the schema does not. A reply without calls, or with a broken calls part, is all
content; a template that writes no calls (SmolLM2's) has no format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from outlines_core.json_schema import build_regex_from_schema

from static_decode.text import tool_calls as tc
from static_decode.text.chat_template import ChatTemplate

SUPPORT = Path(__file__).resolve().parents[1] / "support"
TEMPLATES = {  # format -> (template file, end-of-turn text after a call, the template's eos token)
    "hermes": (SUPPORT / "qwen3_chat_template.jinja", "<|im_end|>\n", "<|im_end|>"),
    "llama3": (SUPPORT / "templates" / "meta-llama-Llama-3.2-3B-Instruct.jinja", "<|eot_id|>", "<|eot_id|>"),
    "mistral": (SUPPORT / "templates" / "mistralai-Mistral-Nemo-Instruct-2407.jinja", "</s>", "</s>"),
    "phi4": (SUPPORT / "templates" / "llama-cpp-microsoft-Phi-4-mini-instruct.jinja", "<|end|>", "<|endoftext|>"),
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"],
        "additionalProperties": False}}},
]
CALL = {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": {"city": "Paris", "days": 3}}}
USER = {"role": "user", "content": "Weather in Paris?"}
EMPTY_THINK = "<think>\n\n</think>"


def reply_text(fmt: str, calls: list[dict], content: str = "") -> str:
    """What the template writes for an assistant turn with `calls` after the generation prompt, less end of turn."""
    path, end, eos = TEMPLATES[fmt]
    t = ChatTemplate(path.read_text(), bos_token="<s>" if fmt == "mistral" else "", eos_token=eos)
    prompt = t.render([USER], tools=TOOLS)
    turn = {"role": "assistant", "content": content, "tool_calls": calls}
    whole = t.render([USER, turn], tools=TOOLS, add_generation_prompt=False)
    if fmt == "phi4":  # without a generation prompt the template ends with its eos token
        whole = whole.removesuffix(eos)
    assert whole.startswith(prompt) and whole.endswith(end), (prompt, whole)
    return whole[len(prompt):-len(end)]


def args_regex(schema: dict) -> str:
    return build_regex_from_schema(json.dumps(schema))


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_the_templates_rendering_of_a_call_parses_back(fmt):
    f = tc.detect(TEMPLATES[fmt][0].read_text())
    assert f is not None and f.name == fmt
    text = reply_text(fmt, [CALL])
    content, calls = tc.parse(f, text)
    assert content.strip() in ("", EMPTY_THINK)  # Qwen3 writes an empty reasoning block before the last turn
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in calls) == (fmt == "mistral")
    for cut in range(len(text) + 1):  # any split of the stream
        split = tc.ToolCallSplit(f)
        streamed = split.feed(text[:cut]) + split.feed(text[cut:])
        rest, got = split.flush()
        assert streamed + rest == content and [(c.name, c.arguments) for c in got] == [
            (c.name, c.arguments) for c in calls]
    assert re.fullmatch(tc.call_regex(f, TOOLS, args_regex), text[len(content):].strip() if fmt == "llama3"
                        else text[len(content):]), text


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "phi4"])
def test_text_before_and_several_calls(fmt):
    f = tc.detect(TEMPLATES[fmt][0].read_text())
    second = {"id": "zyx987WVU", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2.5}}}
    text = reply_text(fmt, [CALL, second], content="Let me check. " if fmt != "mistral" else "")
    content, calls = tc.parse(f, text)
    assert [c.name for c in calls] == ["get_weather", "add"] and json.loads(calls[1].arguments) == {"a": 1, "b": 2.5}
    assert content.replace(EMPTY_THINK, "").strip() == ("Let me check." if fmt != "mistral" else "")


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_what_is_not_a_call_stays_content(fmt):
    f = tc.detect(TEMPLATES[fmt][0].read_text())
    for text in ("The weather is fine.", '{"weather": "fine"}', f'Use {f.start or "{"} like "name": x', ""):
        content, calls = tc.parse(f, text)
        assert (content, calls) == (text, [])
        split = tc.ToolCallSplit(f)
        assert split.feed(text) + split.flush()[0] == text
    broken = reply_text(fmt, [CALL])[:-3]  # cut inside the call
    if fmt != "hermes" and fmt != "phi4":  # an unclosed last block whose JSON is whole still parses
        assert tc.parse(f, broken) == (broken, [])


def test_forced_regex_refuses_other_tools_and_bad_arguments():
    f = tc.HERMES
    regex = tc.call_regex(f, TOOLS[:1], args_regex)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    assert re.fullmatch(regex, good)
    assert not re.fullmatch(regex, good.replace("get_weather", "add"))
    assert not re.fullmatch(regex, good.replace('"days": 2', '"days": "two"'))
    assert re.fullmatch(tc.call_regex(None, TOOLS, args_regex), good)  # no format of its own: Hermes's


def test_templates_without_a_call_format():
    smollm2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
               "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% endif %}")
    assert tc.detect(smollm2) is None
    assert tc.parse(None, '<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>')[1] == []
