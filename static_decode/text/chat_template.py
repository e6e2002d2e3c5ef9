"""A checkpoint's chat template, rendered with jinja2 the way transformers' `apply_chat_template` renders it.

The template comes from `chat_template.jinja` (transformers 4.43+ writes it beside the tokenizer) or from
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: "default" is used, and
"tool_use" when tools are given). It is rendered in a sandbox with `messages`, `tools`, `documents`,
`add_generation_prompt`, the tokenizer's special tokens (bos_token, eos_token, pad_token, ...), the caller's extra
variables (`kwargs`, e.g. {"enable_thinking": False}), the `raise_exception` and `strftime_now` functions, `dict`,
`namespace` and the `tojson` filter, with trim_blocks and lstrip_blocks, as transformers does. Messages are
normalised as transformers normalises them first: keys whose value is None are dropped (an assistant message
with `tool_calls` and `content: null` has no content) and a message's reasoning is given under both
`reasoning_content` and `thinking`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
ROLES = ("system", "user", "assistant", "tool")
# The special-token names transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES), those that are set.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a caller's extra variables may not take: the render's own arguments and the template's functions.
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                      "raise_exception", "strftime_now", "dict", "namespace")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


def _token_text(value: Any) -> str:
    """bos/eos in tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def check_template_kwargs(kwargs: Any, name: str = "chat_template_kwargs") -> dict[str, Any]:
    """`kwargs` as the template's extra variables: a JSON object whose keys are not the render's own names
    (ValueError naming `name` and the bad key or value otherwise)."""
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"{name} must be a JSON object of template variables, got {kwargs!r}")
    for key, value in kwargs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"{name} keys must be template variable names, got {key!r}")
        if key in RESERVED_VARIABLES:
            raise ValueError(f"{name} may not set {key!r}: it is the chat template's own variable "
                             f"({', '.join(RESERVED_VARIABLES)} are)")
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}[{key!r}] must be a JSON value, got {value!r}") from e
    return dict(kwargs)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as transformers hands them to the template: keys with None values dropped, reasoning aliased."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of messages, got {messages!r}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be {{'role': one of {ROLES}, 'content': str, ...}}, got {m!r}")
        m = {k: v for k, v in m.items() if v is not None}
        content = m.get("content")
        if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ValueError(f"messages[{i}] has no content (only an assistant message with tool_calls may "
                             f"leave it out or null), got {messages[i]!r}")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {content!r}")
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"tools must be a list of tool definitions (JSON objects), got {tools!r}")
    return tools


@lru_cache(maxsize=16)
def _compile(source: str, origin: str):  # -> jinja2.Template
    """The template compiled in transformers' sandbox (the same globals and filters)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template of {origin or 'this model'} refused: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # not jinja2's: that one escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:  # `dict(...)` without attribute access to the type
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore attributes (no way to CPython's internals)
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template of {origin or 'this model'} does not parse: {e}") from e


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja2 chat template and the special-token strings it may refer to."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    origin: str = ""  # the file it came from (for messages)
    tool_source: str | None = None  # a "tool_use" named template, used when tools are given
    special_tokens: Mapping[str, str] = field(default_factory=dict)  # the other set special tokens (pad_token...)

    def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None, kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as the model's prompt text, as transformers' `apply_chat_template(messages, tools=tools,
        add_generation_prompt=..., tokenize=False, **kwargs)` renders it. Each message is {"role", "content"} and,
        as the template reads them, "tool_calls", "tool_call_id", "name", "reasoning_content"."""
        checked = _check_messages(messages)
        tools = _check_tools(tools)
        extra = {} if kwargs is None else check_template_kwargs(kwargs, "kwargs")
        source = self.tool_source if tools is not None and self.tool_source is not None else self.source
        template = _compile(source, self.origin)
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token, **self.special_tokens}
        variables = {**{k: v for k, v in named.items() if v}, **extra}  # kwargs override the special tokens
        return template.render(messages=checked, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **variables)


def load_chat_template(path: str | Path) -> ChatTemplate | None:
    """The chat template of the checkpoint at `path`, or None when it has none."""
    root = Path(path)
    config: dict[str, Any] = {}
    config_file = root / TOKENIZER_CONFIG
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from e
    tokens = {"bos_token": _token_text(config.get("bos_token")), "eos_token": _token_text(config.get("eos_token"))}
    others = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS if k not in tokens and config.get(k) is not None}
    file = root / TEMPLATE_FILE
    source, tool_source, origin = config.get("chat_template"), None, str(config_file)
    if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source, tool_source = named.get("default"), named.get("tool_use")
    if file.is_file():
        source, origin = file.read_text(), str(file)
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, origin=origin, tool_source=tool_source if isinstance(tool_source, str) else None,
                        special_tokens=others, **tokens)
