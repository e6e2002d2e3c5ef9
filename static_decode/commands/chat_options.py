"""`--chat-template-kwargs JSON`: extra variables for the chat template (generate --chat, chat, serve).

The value is a JSON object, e.g. '{"enable_thinking": false}', passed to the template as transformers'
`apply_chat_template(..., **kwargs)` passes its keyword arguments. Anything else (not JSON, not an object, a key
that is the template's own variable such as `messages`) stops the command before it loads anything, with one line
naming the value.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from static_decode.text.chat_template import check_template_kwargs

FLAG = "--chat-template-kwargs"


def template_kwargs(text: str) -> dict[str, Any]:
    """The argparse type of --chat-template-kwargs: the JSON object `text` as template variables."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {e}") from None
    try:
        return check_template_kwargs(value, FLAG)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_chat_template_arguments(p: argparse.ArgumentParser, *, what: str = "the chat") -> None:
    """--chat-template-kwargs on a command that renders a chat template."""
    p.add_argument(FLAG, type=template_kwargs, default=None, metavar="JSON",
                   help=f"extra chat-template variables for {what} as a JSON object, e.g. "
                   "'{\"enable_thinking\": false}'")
