"""A checkpoint's chat template, rendered with jinja2 the way transformers renders it.

The template comes from `chat_template.jinja` (transformers 4.43+ writes it beside the tokenizer) or from
`tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: "default" is used). It is
rendered in a sandbox with `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, the
`raise_exception` function and the `tojson` filter, with trim_blocks and lstrip_blocks, as transformers does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
ROLES = ("system", "user", "assistant", "tool")


def _token_text(value: Any) -> str:
    """bos/eos in tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja2 chat template and the special-token strings it may refer to."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    origin: str = ""  # the file it came from (for messages)

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model's prompt text; each message {"role": ..., "content": ...}."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}")

        def raise_exception(message: str) -> None:
            raise ValueError(f"the chat template of {self.origin or 'this model'} refused: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        try:
            template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template of {self.origin or 'this model'} does not parse: {e}") from e
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


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
    file = root / TEMPLATE_FILE
    if file.is_file():
        return ChatTemplate(file.read_text(), origin=str(file), **tokens)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, origin=str(config_file), **tokens)
