"""StopStrings: the streamed text equals the whole text cut at the first stop string, however it is split."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from static_decode.text.stop_strings import StopStrings


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the earliest stop string that completes first, read left to right."""
    for end in range(len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return text[: min(starts)], True
    return text, False


def run(pieces: list[str], stops: list[str]) -> tuple[str, bool, list[str]]:
    ss = StopStrings(stops)
    out, hit, emitted = [], False, []
    for p in pieces:
        text, hit = ss.feed(p)
        emitted.append(text)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(ss.flush())
    return "".join(out), hit, emitted


def test_stop_inside_one_piece() -> None:
    assert run(["Hello wor", "ld. User: hi"], ["User:"])[:2] == ("Hello world. ", True)


def test_stop_split_across_pieces_is_held_back() -> None:
    ss = StopStrings(["<end>"])
    assert ss.feed("abc<e") == ("abc", False)  # "<e" could start "<end>"
    assert ss.feed("n") == ("", False)
    assert ss.feed("d>tail") == ("", True)
    assert ss.feed("more") == ("", True)
    assert ss.flush() == ""


def test_false_start_is_released() -> None:
    ss = StopStrings(["<end>"])
    assert ss.feed("a<e") == ("a", False)
    assert ss.feed("x") == ("<ex", False)
    assert ss.feed("<") == ("", False)
    assert ss.flush() == "<"


def test_no_stops_passes_through() -> None:
    ss = StopStrings([])
    assert ss.feed("abc") == ("abc", False)
    assert ss.flush() == ""


def test_earliest_stop_wins() -> None:
    assert run(["xx BB yy AA"], ["AA", "BB"])[:2] == ("xx ", True)


def test_the_stop_completed_first_wins_however_split() -> None:
    # "c" completes before "abcd" could: the same answer whether "abcd" arrives whole or in pieces
    assert run(["abcd"], ["abcd", "c"])[:2] == ("ab", True)
    assert run(["ab", "cd"], ["abcd", "c"])[:2] == ("ab", True)


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [None]])
def test_bad_stop_refused(bad: list) -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        StopStrings(bad)


def test_a_plain_string_refused() -> None:
    with pytest.raises(TypeError, match="'stop'"):
        StopStrings("stop")


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab<>", max_size=24),
    stops=st.lists(st.text(alphabet="ab<>", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 24), max_size=8),
)
def test_any_split_equals_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    got, hit, _ = run(pieces, stops)
    want, want_hit = reference(text, stops)
    assert (got, hit) == (want, want_hit)
