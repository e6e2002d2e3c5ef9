"""Stop strings over streamed text: emit what is certainly not part of a stop string, hold back the rest.

Text arrives in pieces (one per decoded token) and a stop string may straddle pieces, so the tail of the text
that could still become a stop string is held until the next piece settles it. Nothing from the start of a
matched stop string on is ever emitted."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Cut a stream of text at the first occurrence of any of `stops`."""

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TypeError(f"stops must be a sequence of strings, not the string {stops!r}")
        stops = list(stops)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"a stop string must be a non-empty string, got {s!r}")
        self.stops: list[str] = stops
        self._held = ""
        self.hit = False

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add `piece`; return (the text safe to emit now, whether a stop string has been hit).

        After a hit every later call returns ("", True)."""
        if self.hit:
            return "", True
        text = self._held + piece
        # (end, start) of each stop's first occurrence: the one that completes first is the one a reader of the
        # text meets first, however the text was split into pieces; at a tie the longer one, so none of it shows
        found = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            self.hit, self._held = True, ""
            return text[: min(found)[1]], True
        keep = self._holdback(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text at the end of the stream (it never became a stop string)."""
        held, self._held = self._held, ""
        return held
