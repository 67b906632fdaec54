"""Stop strings match across token boundaries and never leak into the output."""
from __future__ import annotations

from hypothesis import given, strategies as st

from gateway.stops import StopMatcher


def feed(stops, pieces):
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(p) for p in pieces)
    return out + matcher.flush(), matcher.stopped


def test_stop_split_over_tokens():
    assert feed(["END"], ["hello E", "N", "D and more"]) == ("hello ", True)


def test_partial_match_that_fails_is_released():
    assert feed(["END"], ["a E", "N", "x"]) == ("a ENx", False)


def test_held_prefix_released_at_flush():
    assert feed(["END"], ["abc E", "N"]) == ("abc EN", False)


def test_earliest_of_several_stops_wins():
    assert feed(["world", "lo w"], ["hel", "lo wor", "ld"]) == ("hel", True)


def test_stop_inside_one_token():
    assert feed(["\n\n"], ["one\n\ntwo"]) == ("one", True)


def test_nothing_after_a_stop():
    matcher = StopMatcher(["x"])
    assert matcher.push("ax") == "a"
    assert matcher.push("more") == ""
    assert matcher.flush() == ""


def test_text_is_released_as_soon_as_it_cannot_match():
    matcher = StopMatcher(["STOP"])
    assert matcher.push("abc") == "abc"
    assert matcher.push("xS") == "x"  # "S" may start STOP
    assert matcher.push("T") == ""
    assert matcher.push("x") == "STx"


def test_no_stops_passes_through():
    assert feed([], ["a", "b"]) == ("ab", False)


@given(text=st.text(alphabet="abS\n", max_size=40), stop=st.text(alphabet="abS\n", min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_same_as_whole_text_search(text, stop, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    at = text.find(stop)
    expected = (text, False) if at < 0 else (text[:at], True)
    assert feed([stop], pieces) == expected
