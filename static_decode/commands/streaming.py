"""Streaming text out of a token stream: incremental detokenisation, constant work per token, stop strings."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from static_decode.text.stop_strings import StopStrings


@dataclass
class Streamed:
    """What `write_stream` consumed and wrote."""

    ids: list[int] = field(default_factory=list)  # the token ids read from the stream
    text: str = ""  # the text written
    stopped: bool = False  # a stop string ended the stream (the rest of the tokens were not produced)


def write_stream(
    tokenizer: Any,
    tokens: Iterable[int],
    out: TextIO,
    *,
    skip_special_tokens: bool = False,
    stops: Sequence[str] = (),
) -> Streamed:
    """Write the text of `tokens` to `out` as they arrive.

    `tokenizers.decoders.DecodeStream` turns each new id into the text it completes (None while a multi-byte
    character or a merge is still open), so each token costs O(1) instead of re-decoding the whole output. At
    the end, whatever the stream held back (an incomplete character) is written the way a full decode renders it,
    so the text equals `tokenizer.decode(ids)`.

    With `stops`, text that could be the start of a stop string is held back until it is settled
    (static_decode.text.stop_strings); at the first stop string the text before it is written, nothing from it on, and
    the token stream is closed (a generator stream stops decoding there)."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    cut = StopStrings(stops)
    done = Streamed()
    shown: list[str] = []  # what the decode stream produced (before the stop strings held anything back)

    def write(text: str) -> None:
        if text:
            out.write(text)
            out.flush()
            done.text += text

    for t in tokens:
        done.ids.append(t)
        piece = stream.step(tokenizer, t)
        if piece:
            shown.append(piece)
            text, done.stopped = cut.feed(piece)
            write(text)
            if done.stopped:
                close = getattr(tokens, "close", None)
                if close is not None:
                    close()
                out.flush()
                return done
    whole, so_far = tokenizer.decode(done.ids, skip_special_tokens=skip_special_tokens), "".join(shown)
    if whole.startswith(so_far) and len(whole) > len(so_far):
        text, done.stopped = cut.feed(whole[len(so_far) :])
        write(text)
    if not done.stopped:
        write(cut.flush())
    out.flush()
    return done
