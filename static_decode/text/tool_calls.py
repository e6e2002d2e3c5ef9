"""Tool calls in a reply, in the formats the supported families' chat templates write them.

A format is found from the template's own text (`detect`): Hermes / Qwen2.5 / Qwen3 `<tool_call>{json}</tool_call>`,
Llama 3.x's bare `{"name": ..., "parameters": ...}` reply, Mistral's `[TOOL_CALLS][{...}, ...]`, Phi-4-mini's
`<|tool_call|>{json}<|/tool_call|>`; a template that writes none of them (Gemma, SmolLM2) has no format, and its
replies stay text unless a call is forced, which then takes the Hermes form. `parse` takes a whole reply apart into
its content (the text before the calls) and its calls; `ToolCallSplit` does the same on streamed text, holding back
only what may open a call, so any split of the text gives what `parse` gives. A reply whose calls part is not valid
calls is all content, as written. `call_regex` is the regular expression of a reply that is one call of one of the
given tools, written as the template writes it, its arguments held to the tool's `parameters` schema: what
`tool_choice` "required" or a named function forces through structured output.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object), as the model wrote them."""

    name: str
    arguments: str
    id: str


@dataclass(frozen=True)
class ToolFormat:
    """How a family's template writes calls: `start` opens them ("" for a reply that is a call from its start),
    `end` closes each one ("" when a list holds them), `args` is the key of the arguments object."""

    name: str
    start: str
    end: str = ""
    args: str = "arguments"
    listed: bool = False  # the calls are one JSON list after `start` (else one object per start ... end)
    id_chars: int = 0  # ids of exactly this many letters and digits (Mistral's templates insist on 9)

    def new_id(self) -> str:
        if self.id_chars:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(self.id_chars))
        return f"call_{secrets.token_hex(12)}"


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3 = ToolFormat("llama3", "", args="parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", listed=True, id_chars=9)
PHI4 = ToolFormat("phi4", "<|tool_call|>", "<|/tool_call|>")
FORMATS = (HERMES, MISTRAL, PHI4, LLAMA3)
PYTHON_TAG = "<|python_tag|>"  # what Llama 3.1 may write before a call


def detect(template: str) -> ToolFormat | None:
    """The format a chat template's source writes calls in, or None (it writes none)."""
    for fmt in (HERMES, MISTRAL, PHI4):
        if fmt.start in template:
            return fmt
    if '"parameters": ' in template and "tool_calls" in template:
        return LLAMA3
    return None


def _call(obj: Any, block: str, fmt: ToolFormat) -> ToolCall | None:
    """A call from its parsed JSON object (None: not a call); `block` is its text, for the arguments as written."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    given = obj.get("id")  # kept where the format's ids are the model's own (Mistral's), when well formed
    ident = given if fmt.id_chars and isinstance(given, str) and re.fullmatch(
        rf"[A-Za-z0-9]{{{fmt.id_chars}}}", given) else None
    key = fmt.args if fmt.args in obj else "arguments"
    args = obj.get(key, {})
    if isinstance(args, str):  # arguments as JSON text
        try:
            if isinstance(json.loads(args), dict):
                return ToolCall(obj["name"], args, ident or fmt.new_id())
        except json.JSONDecodeError:
            return None
        return None
    if not isinstance(args, dict):
        return None
    written = json.dumps(args, ensure_ascii=False)
    m = re.search(rf'"{key}"\s*:\s*', block)
    if m:  # the model's own text of the object, when it is what was parsed
        try:
            value, end = json.JSONDecoder().raw_decode(block, m.end())
            if value == args:
                written = block[m.end():end]
        except json.JSONDecodeError:
            pass
    return ToolCall(obj["name"], written, ident or fmt.new_id())


def _objects(text: str) -> list[tuple[Any, str]] | None:
    """The JSON values of `text` one after another (whitespace between), each with its text; None if not that."""
    out, i, dec = [], 0, json.JSONDecoder()
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return out
        try:
            value, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append((value, text[i:end]))
        i = end


def _calls(fmt: ToolFormat, part: str) -> tuple[list[ToolCall], str] | None:
    """The calls of a reply's calls part (from its opening on) and the text after them, or None when it is not
    valid calls."""
    if fmt is LLAMA3:
        values = _objects(part.strip().removeprefix(PYTHON_TAG))
        calls = [_call(v, text, fmt) for v, text in values or []]
        after = ""
    elif fmt.listed:
        dec = json.JSONDecoder()
        body = part[len(fmt.start):]
        lead = len(body) - len(body.lstrip())
        try:
            items, end = dec.raw_decode(body, lead)
        except json.JSONDecodeError:
            return None
        if not isinstance(items, list):
            return None
        calls = [_call(v, json.dumps(v, ensure_ascii=False), fmt) for v in items]
        after = body[end:]
    else:
        calls, after = [], ""
        blocks = part.split(fmt.start)[1:]
        for n, block in enumerate(blocks):
            inner, closed, rest = block.partition(fmt.end)
            last = n == len(blocks) - 1
            if (not closed and not last) or (rest.strip() and not last):
                return None
            values = _objects(inner)
            if not values or len(values) != 1:
                return None
            calls.append(_call(values[0][0], values[0][1], fmt))
            after = rest if last else ""
    if not calls or any(c is None for c in calls):
        return None
    return calls, after.strip()  # type: ignore[return-value]


def _opening(fmt: ToolFormat, text: str) -> int:
    """Where the calls part of `text` starts (len(text): nowhere). Llama 3's: a reply that opens with an object."""
    if fmt is LLAMA3:
        lead = text.lstrip()
        return len(text) - len(lead) if lead.startswith(("{", PYTHON_TAG)) else len(text)
    i = text.find(fmt.start)
    return len(text) if i < 0 else i


def parse(fmt: ToolFormat | None, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply: the text around the calls and the calls, or (text, []) when it has none
    (or what follows the opening is not valid calls)."""
    if fmt is None:
        return text, []
    i = _opening(fmt, text)
    found = None if i == len(text) else _calls(fmt, text[i:])
    if found is None:
        return text, []
    calls, after = found
    return text[:i] + after, calls  # text written after the calls is kept, after the text before them


def _held_start(fmt: ToolFormat, text: str) -> int:
    """Where held-back text starts in streamed `text`: the opening, or an end that may begin it."""
    i = _opening(fmt, text)
    if i < len(text):
        return i
    if fmt is LLAMA3:  # only the reply's start can open a call: hold back leading whitespace
        return 0 if not text.strip() else len(text)
    for n in range(min(len(text), len(fmt.start) - 1), 0, -1):
        if fmt.start.startswith(text[-n:]):
            return len(text) - n
    return len(text)


class ToolCallSplit:
    """Streamed text split into content and calls; see the module docstring. `feed` returns the content that is
    certain; `flush`, at the reply's end, the rest of the content and the calls."""

    def __init__(self, fmt: ToolFormat | None) -> None:
        self.fmt = fmt
        self._text = ""  # the whole reply so far
        self._sent = 0  # characters of it returned as content
        self._decided = fmt is None  # content for good (Llama 3: the reply did not open with a call)

    def feed(self, text: str) -> str:
        self._text += text
        if self._decided:
            out, self._sent = self._text[self._sent:], len(self._text)
            return out
        assert self.fmt is not None
        if self.fmt is LLAMA3 and self._text.strip() and _opening(self.fmt, self._text) == len(self._text):
            self._decided = True
            return self.feed("")
        upto = max(self._sent, _held_start(self.fmt, self._text))
        out, self._sent = self._text[self._sent:upto], upto
        return out

    def flush(self) -> tuple[str, list[ToolCall]]:
        content, calls = parse(self.fmt, self._text)
        if calls:
            return content[self._sent:], calls
        out, self._sent = self._text[self._sent:], len(self._text)
        return out, []


_META = set("\\.^$*+?()[]{}|")


def literal(text: str) -> str:
    """`text` as a regular expression matching it alone, in the syntax both outlines-core and xgrammar read
    (metacharacters escaped, a newline as \\n; nothing else escaped)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in _META else c for c in text)


def call_regex(fmt: ToolFormat | None, tools: list[dict[str, Any]], args_regex: Any) -> str:
    """The regular expression of a reply that is one call of one of `tools` (OpenAI's function definitions), as
    `fmt` writes it (None: the Hermes form); `args_regex(schema)` gives the arguments' expression for a tool's
    `parameters` schema (structured output's JSON-schema regex)."""
    fmt = fmt or HERMES
    # Mistral's template writes each call's id after its arguments (the model may write one too)
    tail = f'(, "id": "[A-Za-z0-9]{{{fmt.id_chars}}}")?' if fmt.id_chars else ""
    alternatives = []
    for tool in tools:
        f = tool["function"]
        params = f.get("parameters") or {"type": "object"}
        obj = (literal('{"name": ' + json.dumps(f["name"], ensure_ascii=False) + f', "{fmt.args}": ')
               + f"({args_regex(params)})" + tail + literal("}"))
        alternatives.append(obj)
    one = "(" + "|".join(alternatives) + ")"
    if fmt is HERMES:
        return literal(f"{fmt.start}\n") + one + literal(f"\n{fmt.end}")
    if fmt is MISTRAL:
        return literal(f"{fmt.start}[") + one + literal("]")
    if fmt is PHI4:
        return literal(fmt.start) + one + literal(fmt.end)
    return one
