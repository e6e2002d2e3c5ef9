"""A chat request's template inputs, checked: messages, tools, tool_choice, chat_template_kwargs, reasoning_format.

The messages take OpenAI's shapes: content as a string or text parts; an assistant message may carry `tool_calls`
(its content then may be null) and `reasoning_content`; a `tool` message answers one call (`tool_call_id`). They
reach the template as transformers' `apply_chat_template(messages, tools=tools, add_generation_prompt=True,
**chat_template_kwargs)` gives them, so the prompt's ids are the ones it would tokenize. `tool_choice` "auto" leaves
the reply to the model and parses the calls it writes, "none" leaves the reply as text (both render the tools);
"required" or a named function forces one call (static_decode.commands.serve.api). A field set to what this server
cannot honour raises `FieldError`, which names the field.
"""

from __future__ import annotations

import json
from typing import Any

from static_decode.text.chat_template import ROLES, check_template_kwargs

REASONING_FORMATS = ("none", "deepseek")
# What a message may carry besides role and content (a key set to null is dropped, as transformers drops it).
MESSAGE_KEYS = ("name", "tool_calls", "tool_call_id", "reasoning_content")


class FieldError(ValueError):
    """A refused request field: `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _shown(v: Any) -> str:
    try:
        return json.dumps(v, ensure_ascii=False)[:80]
    except (TypeError, ValueError):
        return repr(v)[:80]


def _text(i: int, content: Any) -> str | None:
    """Content as the template takes it: a string, text parts joined, or None."""
    parts = isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)
    if parts and all(isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    if content is None or isinstance(content, str):
        return content
    raise FieldError(f"messages[{i}].content must be a string or a list of text parts, got {_shown(content)}",
                     "messages")


def _tool_calls(i: int, calls: Any) -> None:
    if not isinstance(calls, list) or not calls:
        raise FieldError(f"messages[{i}].tool_calls must be a non-empty list of calls, got {_shown(calls)}",
                         "messages")
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(c, dict) and c.get("type", "function") == "function" and isinstance(f, dict)
                and isinstance(f.get("name"), str) and f["name"]
                and isinstance(f.get("arguments"), str | dict) and isinstance(c.get("id", ""), str)):
            raise FieldError(f"messages[{i}].tool_calls[{j}] must be {{'id': str, 'type': 'function', 'function': "
                             f"{{'name': str, 'arguments': str}}}}, got {_shown(c)}", "messages")


def chat_message(i: int, m: Any) -> dict[str, Any]:
    """messages[i] checked, its null keys dropped and its text parts joined (the client's key order kept)."""
    if not isinstance(m, dict):
        raise FieldError(f"messages[{i}] must be an object with 'role' and 'content', got {_shown(m)}", "messages")
    role = m.get("role")
    if role not in ROLES:
        raise FieldError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
    for key, v in m.items():
        if key not in ("role", "content", *MESSAGE_KEYS) and v is not None:
            raise FieldError(f"messages[{i}].{key} is not supported by this server (got {_shown(v)}); "
                             f"a message carries role, content, {', '.join(MESSAGE_KEYS)}", "messages")
    content = _text(i, m.get("content"))
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise FieldError(f"messages[{i}].tool_calls: only an assistant message makes calls, got role {role!r}",
                             "messages")
        _tool_calls(i, calls)
    if content is None and calls is None:
        raise FieldError(f"messages[{i}].content must be a string or a list of text parts (null only in an "
                         f"assistant message with tool_calls), got null", "messages")
    call_id = m.get("tool_call_id")
    if role == "tool" and not isinstance(call_id, str):
        raise FieldError(f"messages[{i}].tool_call_id must be the string id of the call a tool message answers, "
                         f"got {_shown(call_id)}", "messages")
    for key, only in (("tool_call_id", "tool"), ("reasoning_content", "assistant")):
        v = m.get(key)
        if v is not None and (role != only or not isinstance(v, str)):
            raise FieldError(f"messages[{i}].{key} must be a string in a {only} message, got {_shown(v)} in a "
                             f"{role} message", "messages")
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise FieldError(f"messages[{i}].name must be a string, got {_shown(m['name'])}", "messages")
    out = {**m, "content": content}
    return {k: v for k, v in out.items() if v is not None}


def chat_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The request's tools as the template takes them (None: none given), after tool_choice's check."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise FieldError(f"tools must be a list of tool definitions, got {_shown(tools)}", "tools")
        for i, t in enumerate(tools):
            f = t.get("function") if isinstance(t, dict) else None
            if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(f, dict)
                    and isinstance(f.get("name"), str) and f["name"]
                    and isinstance(f.get("parameters", {}), dict)
                    and isinstance(f.get("description", ""), str)):
                raise FieldError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, "
                                 f"'description': str, 'parameters': object}}}}, got {_shown(t)}", "tools")
    return tools


def tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | None:
    """The request's tool_choice: None or "auto" (the model decides), "none" (no call is parsed), "required" (one
    call of any tool, forced), or the name of the function a call is forced to ({"type": "function", "function":
    {"name": ...}})."""
    choice = body.get("tool_choice")
    if choice in (None, "none", "auto"):
        return choice
    names = [t["function"]["name"] for t in tools or []]
    if choice == "required" or isinstance(choice, dict):
        if not names:
            raise FieldError(f"tool_choice {_shown(choice)} forces a call, and the request has no tools", "tool_choice")
        if choice == "required":
            return choice
        f = choice.get("function")
        if not (choice.get("type") == "function" and isinstance(f, dict) and isinstance(f.get("name"), str)):
            raise FieldError(f"tool_choice must name a function as {{'type': 'function', 'function': {{'name': "
                             f"str}}}}, got {_shown(choice)}", "tool_choice")
        if f["name"] not in names:
            raise FieldError(f"tool_choice names function {f['name']!r}, which is not among the tools "
                             f"({', '.join(names)})", "tool_choice")
        return f["name"]
    raise FieldError(f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, got "
                     f"{_shown(choice)}", "tool_choice")


def template_kwargs(body: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The server's --chat-template-kwargs with the request's chat_template_kwargs over them."""
    given = body.get("chat_template_kwargs")
    if given is None:
        return dict(defaults)
    try:
        return {**defaults, **check_template_kwargs(given)}
    except ValueError as e:
        raise FieldError(str(e), "chat_template_kwargs") from e


def reasoning_format(body: dict[str, Any], default: str) -> str:
    """The request's reasoning_format, or the server's --reasoning-format."""
    v = body.get("reasoning_format")
    if v is None:
        return default
    if v not in REASONING_FORMATS:
        raise FieldError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got {_shown(v)}",
                         "reasoning_format")
    return v


# The chat-only fields and their neutral values: /v1/completions, which renders no template, refuses the others.
CHAT_ONLY: dict[str, tuple[Any, ...]] = {"tools": (None, []), "tool_choice": (None, "none", "auto"),
                                         "chat_template_kwargs": (None, {}), "reasoning_format": (None, "none")}


def refuse_chat_only(body: dict[str, Any]) -> None:
    for name, neutral in CHAT_ONLY.items():
        if not any(type(body.get(name)) is type(n) and body.get(name) == n for n in neutral):
            raise FieldError(f"{name} applies to /v1/chat/completions (the chat template); /v1/completions takes "
                             f"a prompt as it is (got {_shown(body[name])})", name)
