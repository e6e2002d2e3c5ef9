"""A reply's reasoning and content: exact values of `split_reasoning` on whole replies, and `ReasoningSplit` on the
same text streamed in every split into two and three pieces and one character at a time, which must join to the
same two strings (and never emit a piece the rest of the text would change)."""

from __future__ import annotations

import itertools

import pytest

from static_decode.text.reasoning import ReasoningSplit, split_reasoning

CASES = [  # (reply, prompt opened the reasoning, reasoning, content)
    ("<think>\nhmm, 2+2\n</think>\n\nIt is 4.", False, "hmm, 2+2", "It is 4."),
    ("  \n<think>a</think>b", False, "a", "b"),
    ("<think>\n\n</think>\n\nHello", False, "", "Hello"),
    ("Hello <think>not reasoning</think>", False, "", "Hello <think>not reasoning</think>"),
    ("\n\nplain text\n", False, "", "\n\nplain text\n"),
    ("<think>never closed  \n", False, "never closed", ""),
    ("<think>a </thin", False, "a </thin", ""),
    ("<thin", False, "", "<thin"),
    ("   ", False, "", "   "),
    ("", False, "", ""),
    ("opened by the prompt\n</think>\n\nanswer  </think> kept", True, "opened by the prompt",
     "answer  </think> kept"),
    ("\n  still thinking", True, "still thinking", ""),
    ("<think>é ü </ think></think>x\n", False, "é ü </ think>", "x\n"),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_whole_replies(text, opened, reasoning, content) -> None:
    assert split_reasoning(text, in_reasoning=opened) == (reasoning, content)


def _streamed(pieces: list[str], opened: bool) -> tuple[str, str]:
    s = ReasoningSplit(in_reasoning=opened)
    r, c = [], []
    for p in [*pieces, None]:
        got = s.flush() if p is None else s.feed(p)
        r.append(got[0])
        c.append(got[1])
    return "".join(r), "".join(c)


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_any_split_gives_the_same_two_strings(text, opened, reasoning, content) -> None:
    n = len(text)
    splits = [[text], list(text)]
    splits += [[text[:i], text[i:]] for i in range(n + 1)]
    splits += [[text[:i], text[i:j], text[j:]] for i, j in itertools.combinations(range(n + 1), 2)]
    for pieces in splits:
        assert _streamed(pieces, opened) == (reasoning, content), pieces


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_nothing_emitted_is_taken_back(text, opened, reasoning, content) -> None:
    """Streamed a character at a time, what has been emitted is always the start of the final strings."""
    s = ReasoningSplit(in_reasoning=opened)
    r = c = ""
    for ch in text:
        dr, dc = s.feed(ch)
        r, c = r + dr, c + dc
        assert reasoning.startswith(r) and content.startswith(c), (ch, r, c)
    fr, fc = s.flush()
    assert (r + fr, c + fc) == (reasoning, content)


def test_empty_tags_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        ReasoningSplit(end="")
