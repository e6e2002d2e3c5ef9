"""A reply's reasoning apart from its content, as llama-server's `--reasoning-format deepseek` gives them.

A reply that opens with `<think>` (after any whitespace), or whose prompt ended with one (a template that opens
the reasoning itself), reasons up to `</think>`: that span, stripped of surrounding whitespace, is the reasoning,
and what follows, its leading whitespace dropped, the content. A reply without the opening tag is all content; one
whose reasoning never closes is all reasoning. `ReasoningSplit` does this on streamed text: `feed` returns what is
certain so far and holds back only what the next piece may change (the start of a tag, trailing whitespace), so
any split of the text gives the same two strings as `split_reasoning` on the whole of it.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
_LEAD, _REASONING_LEAD, _REASONING, _CONTENT_LEAD, _CONTENT = range(5)


def split_reasoning(text: str, *, in_reasoning: bool = False, start: str = START, end: str = END) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    if not in_reasoning:
        opened = text.lstrip()
        if not opened.startswith(start):
            return "", text
        text = opened[len(start) :]
    i = text.find(end)
    if i < 0:
        return text.strip(), ""
    return text[:i].strip(), text[i + len(end) :].lstrip()


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may be the tag's start)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplit:
    """Streamed text split into (reasoning, content) pieces; see the module docstring."""

    def __init__(self, *, in_reasoning: bool = False, start: str = START, end: str = END) -> None:
        if not start or not end:
            raise ValueError(f"the reasoning tags must be non-empty, got {start!r} and {end!r}")
        self.start, self.end = start, end
        self._state = _REASONING_LEAD if in_reasoning else _LEAD
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that `text` (the next piece of the reply) makes certain."""
        buf, reasoning, content = self._held + text, [], []
        while buf:
            if self._state == _LEAD:
                opened = buf.lstrip()
                if opened.startswith(self.start):
                    buf, self._state = opened[len(self.start) :], _REASONING_LEAD
                elif self.start.startswith(opened):  # whitespace, or the tag begun: not known yet
                    break
                else:
                    self._state = _CONTENT
            elif self._state in (_REASONING_LEAD, _CONTENT_LEAD):
                rest = buf.lstrip()
                if not rest:
                    buf = ""
                    break
                buf, self._state = rest, _REASONING if self._state == _REASONING_LEAD else _CONTENT
            elif self._state == _REASONING:
                i = buf.find(self.end)
                if i >= 0:
                    reasoning.append(buf[:i].rstrip())
                    buf, self._state = buf[i + len(self.end) :], _CONTENT_LEAD
                    continue
                sure = buf[: len(buf) - _partial(buf, self.end)].rstrip()  # trailing space may end the reasoning
                reasoning.append(sure)
                buf = buf[len(sure) :]
                break
            else:
                content.append(buf)
                buf = ""
        self._held = buf
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """What is held back, at the reply's end."""
        held, self._held = self._held, ""
        if self._state == _LEAD:
            return "", held
        if self._state == _REASONING:
            return held.rstrip(), ""
        return "", ""
