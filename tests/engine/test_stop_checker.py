"""Stop strings found in streamed text, however the text is chunked."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.stop_checker import StopChecker


def _reference(text: str, stop: list[str]) -> tuple[str, bool]:
    """Cut at the occurrence that completes first (earliest start among those ending there)."""
    best: tuple[int, int] | None = None  # (end, start)
    for s in stop:
        start = text.find(s)
        if start >= 0 and (best is None or (start + len(s), start) < best):
            best = (start + len(s), start)
    return (text, False) if best is None else (text[: best[1]], True)


def _stream(checker: StopChecker, chunks: list[str]) -> tuple[str, bool, int]:
    """Feed chunks until a stop; return (emitted text, stopped, most characters held)."""
    emitted, most_held = [], 0
    for chunk in chunks:
        out, stopped = checker.feed(chunk)
        emitted.append(out)
        if stopped:
            return "".join(emitted), True, most_held
        most_held = max(most_held, len(checker.held))
    emitted.append(checker.flush())
    return "".join(emitted), False, most_held


def _chunk(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)] or [""]


ALPHABET = "abc xy\n"
stop_strings = st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=0, max_size=4)


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=40),
    stop=stop_strings,
    cuts=st.lists(st.integers(0, 200), max_size=12),
)
@example(text="xxabcd", stop=["abcd", "c"], cuts=[3, 4])
@example(text="aab", stop=["ab"], cuts=[1, 2])
def test_emitted_text_is_text_cut_at_first_stop_for_any_chunking(
    text: str, stop: list[str], cuts: list[int]
) -> None:
    expected, expect_stop = _reference(text, stop)
    emitted, stopped, most_held = _stream(StopChecker(stop), _chunk(text, cuts))
    assert stopped == expect_stop
    assert stopped == any(s in text for s in stop)
    assert emitted == expected
    assert most_held <= max((len(s) for s in stop), default=1) - 1


@settings(max_examples=200, deadline=None)
@given(text=st.text(ALPHABET, max_size=30), stop=stop_strings)
def test_character_by_character_matches_single_chunk(text: str, stop: list[str]) -> None:
    whole = _stream(StopChecker(stop), [text])[:2]
    by_char = _stream(StopChecker(stop), list(text) or [""])[:2]
    assert whole == by_char == _reference(text, stop)


def test_stop_string_spanning_deltas_is_held_then_cut() -> None:
    checker = StopChecker(["</s>", "STOP"])
    assert checker.feed("Hello <") == ("Hello ", False)
    assert checker.held == "<"
    assert checker.feed("/") == ("", False)
    assert checker.feed("s> tail") == ("", True)
    assert checker.stopped


def test_false_alarm_releases_held_text() -> None:
    checker = StopChecker(["STOP"])
    assert checker.feed("ST") == ("", False)
    assert checker.feed("AR") == ("STAR", False)
    assert checker.feed("S") == ("", False)
    assert checker.flush() == "S"


def test_text_before_stop_in_same_delta_is_returned() -> None:
    assert StopChecker(["\n\n"]).feed("one\ntwo\n\nthree") == ("one\ntwo", True)


def test_earliest_completed_occurrence_wins() -> None:
    # "c" completes before "abcd" can, so streaming cuts at "c" in every chunking.
    assert StopChecker(["abcd", "c"]).feed("xabcd") == ("xab", True)
    checker = StopChecker(["abcd", "c"])
    assert checker.feed("xab") == ("x", False)
    assert checker.feed("cd") == ("ab", True)
    # Two stops ending together: the longer one (earlier start) is cut.
    assert StopChecker(["b", "ab"]).feed("xaby") == ("x", True)


def test_no_stop_strings_passes_text_through() -> None:
    checker = StopChecker([])
    assert checker.feed("abc") == ("abc", False)
    assert checker.flush() == ""


def test_calls_after_stop_or_flush_are_invalid() -> None:
    checker = StopChecker(["x"])
    assert checker.feed("abx") == ("ab", True)
    with pytest.raises(RuntimeError):
        checker.feed("more")
    with pytest.raises(RuntimeError):
        checker.flush()
    flushed = StopChecker(["x"])
    assert flushed.flush() == ""
    with pytest.raises(RuntimeError):
        flushed.feed("a")


@pytest.mark.parametrize("stop", [[""], ["ok", 3], "abc"])
def test_bad_stop_lists_are_rejected(stop: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        StopChecker(stop)  # type: ignore[arg-type]
