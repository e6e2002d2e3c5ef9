"""Streaming text out of a token stream: incremental detokenisation, constant work per token."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TextIO


def write_stream(tokenizer: Any, tokens: Iterable[int], out: TextIO, *, skip_special_tokens: bool = False) -> list[int]:
    """Write the text of `tokens` to `out` as they arrive; return the ids.

    `tokenizers.decoders.DecodeStream` turns each new id into the text it completes (None while a multi-byte
    character or a merge is still open), so each token costs O(1) instead of re-decoding the whole output. At
    the end, whatever the stream held back (an incomplete character) is written the way a full decode renders it,
    so the text equals `tokenizer.decode(ids)`."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    ids: list[int] = []
    shown: list[str] = []
    for t in tokens:
        ids.append(t)
        piece = stream.step(tokenizer, t)
        if piece:
            out.write(piece)
            out.flush()
            shown.append(piece)
    text, done = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), "".join(shown)
    if text.startswith(done):
        out.write(text[len(done) :])
    out.flush()
    return ids
