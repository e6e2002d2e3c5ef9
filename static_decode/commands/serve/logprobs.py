"""The server's logprobs: the request fields that ask for them and the two response formats OpenAI defines.

/v1/completions takes `logprobs: k` (0..20 alternatives per token; null: off) and `echo` (the prompt's text, and
with logprobs its tokens' logprobs given their prefix, before the completion's); the answer's `logprobs` is the
legacy object {tokens, token_logprobs, top_logprobs (a list of token -> logprob objects), text_offset}, the
prompt's first token having null for both. /v1/chat/completions takes `logprobs: true` and `top_logprobs: k`;
the answer's is {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal}. Streamed,
each chunk carries the records of the tokens whose text it carries. The logprobs are the model's own distribution
(static_decode.steps.logprobs): log_softmax of its logits before the logit bias, penalties, temperature and filters.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from static_decode.commands.serve.messages import FieldError
from static_decode.generation.scoring import MAX_LOGPROBS
from static_decode.steps.logprobs import TokenLogprob

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a sentencepiece byte-fallback token
METASPACE = "\u2581"  # sentencepiece's word boundary, a space in the text


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable stand-in character of each byte -> the byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


BYTE_OF = _byte_level_chars()


@dataclass(frozen=True)
class TokenScore:
    """One token of a response with its logprob record and where its text starts in the response's text."""

    record: TokenLogprob
    offset: int  # characters of the response text before this token's


def requested(body: dict[str, Any], chat: bool) -> tuple[int | None, bool]:
    """(the alternatives asked per token, None: no logprobs; echo) of a request body, or a FieldError naming the
    field."""
    if chat:
        on, top = body.get("logprobs"), body.get("top_logprobs")
        if on is not None and not isinstance(on, bool):
            raise FieldError(f"logprobs must be a boolean on /v1/chat/completions (top_logprobs: k for "
                             f"alternatives), got {on!r}", "logprobs")
        k = _count(top, "top_logprobs")
        if k and not on:
            raise FieldError(f"top_logprobs={k} needs logprobs: true", "top_logprobs")
        echo = body.get("echo")
        if echo not in (None, False):
            raise FieldError(f"echo is not supported by this server on /v1/chat/completions (got {echo!r}); it "
                             "takes echo on /v1/completions", "echo")
        return ((k or 0) if on else None), False
    top = body.get("top_logprobs")
    if top is not None and not (type(top) is int and top == 0):
        raise FieldError(f"top_logprobs applies to /v1/chat/completions; /v1/completions takes logprobs: k "
                         f"(got top_logprobs={top!r})", "top_logprobs")
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise FieldError(f"echo must be a boolean, got {echo!r}", "echo")
    return _count(body.get("logprobs"), "logprobs"), echo


def _count(v: Any, name: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS:
        raise FieldError(f"{name} must be an integer in 0..{MAX_LOGPROBS}, got {v!r}", name)
    return v


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """The bytes token `token` stands for in the text (a byte-level piece mapped back to its bytes, a
    sentencepiece byte token as its byte, a word boundary as a space); else its own decoded text."""
    piece = tokenizer.id_to_token(token)
    if piece is None:
        return tokenizer.decode([token], skip_special_tokens=False).encode()
    m = BYTE_TOKEN.fullmatch(piece)
    if m:
        return bytes([int(m[1], 16)])
    if type(tokenizer.decoder).__name__ == "ByteLevel" and all(c in BYTE_OF for c in piece):
        return bytes(BYTE_OF[c] for c in piece)
    if METASPACE in piece:
        return piece.replace(METASPACE, " ").encode()
    return tokenizer.decode([token], skip_special_tokens=False).encode()


def token_text(tokenizer: Any, token: int) -> str:
    """The token as text: its bytes as UTF-8 (a piece of a character shown as U+FFFD)."""
    return token_bytes(tokenizer, token).decode("utf-8", errors="replace")


def _value(v: float | None) -> float | None:
    """A logprob for JSON: -inf (a token the model rules out) as the most negative float, JSON having no -inf."""
    if v is None:
        return None
    return v if math.isfinite(v) else -3.4028234663852886e38


def completion_logprobs(tokenizer: Any, scores: list[TokenScore], k: int) -> dict[str, list[Any]]:
    """OpenAI's legacy completion logprobs of `scores` (k alternatives each)."""
    tokens, values, tops, offsets = [], [], [], []
    for s in scores:
        r = s.record
        tokens.append(token_text(tokenizer, r.token))
        values.append(_value(r.logprob))
        top: dict[str, float | None] | None = None
        if r.logprob is not None:
            top = {}
            for t, v in r.top[:k]:  # best first; two ids of one text keep the better
                top.setdefault(token_text(tokenizer, t), _value(v))
        tops.append(top)
        offsets.append(s.offset)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, scores: list[TokenScore], k: int) -> dict[str, Any]:
    """OpenAI's chat logprobs of `scores` (k alternatives each)."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        b = token_bytes(tokenizer, token)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": _value(logprob), "bytes": list(b)}

    content = [{**entry(s.record.token, s.record.logprob), "top_logprobs": [entry(t, v) for t, v in s.record.top[:k]]}
               for s in scores]
    return {"content": content, "refusal": None}
