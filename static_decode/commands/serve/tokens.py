"""The bodies of `/tokenize` and `/detokenize`, as llama-server has them, checked and answered with the served
tokenizer.

POST /tokenize {"content": str, "add_special": bool (default false)} -> {"tokens": [int, ...]}: the ids of the
text, with the tokenizer's BOS/EOS template when add_special is true (added tokens in the text are always parsed).
POST /detokenize {"tokens": [int, ...]} -> {"content": str}: the text of the ids, special tokens shown. A bad body,
a field set to what is not honoured (`with_pieces` true, `parse_special` false) and an id the tokenizer does not
have are refused with a 400 naming them.
"""

from __future__ import annotations

import json
from typing import Any

from static_decode.commands.serve.api import APIError

TOKENIZE_FIELDS = {"content": None, "add_special": False, "with_pieces": False, "parse_special": True}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _body(raw: bytes, fields: tuple[str, ...]) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    for name in body:
        if name not in fields:
            raise _bad(f"{name} is not a field of this endpoint (it takes {', '.join(fields)})", name)
    return body


def tokenize(raw: bytes, tokenizer: Any) -> dict[str, list[int]]:
    """The answer of POST /tokenize."""
    body = _body(raw, tuple(TOKENIZE_FIELDS))
    content = body.get("content")
    if not isinstance(content, str):
        raise _bad(f"content must be a string, got {json.dumps(content)[:80]}", "content")
    for name in ("add_special", "with_pieces", "parse_special"):
        v = body.get(name, TOKENIZE_FIELDS[name])
        if not isinstance(v, bool):
            raise _bad(f"{name} must be a boolean, got {json.dumps(v)[:80]}", name)
        if name != "add_special" and v != TOKENIZE_FIELDS[name]:
            raise _bad(f"{name} {json.dumps(v)} is not supported by this server; leave it out or set it to "
                       f"{json.dumps(TOKENIZE_FIELDS[name])}", name)
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(f"content is not valid Unicode text: a lone surrogate {ord(content[e.start]):#06x} at character "
                   f"{e.start}", "content") from e
    return {"tokens": tokenizer.encode(content, add_special_tokens=body.get("add_special", False)).ids}


def detokenize(raw: bytes, tokenizer: Any) -> dict[str, str]:
    """The answer of POST /detokenize."""
    body = _body(raw, ("tokens",))
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise _bad(f"tokens must be a list of token ids, got {json.dumps(ids)[:80]}", "tokens")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < size or tokenizer.id_to_token(t) is None:
            raise _bad(f"tokens[{i}] = {json.dumps(t)[:40]} is not a token id of this tokenizer (0..{size - 1})",
                       "tokens")
    return {"content": tokenizer.decode(ids, skip_special_tokens=False)}
