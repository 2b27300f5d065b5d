"""StopStringMatcher: stops split anywhere, minimal hold-back, nothing after a stop."""

from __future__ import annotations

import random

import pytest

from gateway.errors import GatewayError
from gateway.text.stop_strings import StopMatch, StopStringMatcher


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[StopMatch], str]:
    """The match of every piece fed until a stop, and the flushed text if none came."""
    matches = []
    for piece in pieces:
        matches.append(matcher.feed(piece))
        if matches[-1].stopped:
            return matches, ""
    return matches, matcher.flush()


def streamed(
    text: str, stops: tuple[str, ...], cuts: list[int], include: bool = False
) -> tuple[str, str | None]:
    """(everything emitted, matched stop) for ``text`` cut at ``cuts``."""
    bounds = [0, *sorted(cuts), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matches, flushed = feed_all(StopStringMatcher(stops, include), pieces)
    return "".join(m.text for m in matches) + flushed, matches[-1].matched if matches else None


def reference(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, str | None]:
    """Character by character: stop as soon as any stop string ends; the longest on a tie."""
    for end in range(1, len(text) + 1):
        ended = [stop for stop in stops if text[:end].endswith(stop)]
        if ended:
            stop = max(ended, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


def test_stop_split_across_pieces() -> None:
    matcher = StopStringMatcher(("<|end|>",))
    assert matcher.feed("Hello <|") == StopMatch("Hello ")
    assert matcher.feed("en") == StopMatch("")
    assert matcher.feed("d|> and more") == StopMatch("", stopped=True, matched="<|end|>")
    assert matcher.is_stopped


def test_include_stop_str_in_output() -> None:
    matcher = StopStringMatcher(("<|end|>",), include_stop_str_in_output=True)
    assert matcher.feed("Hi <|e").text == "Hi "
    match = matcher.feed("nd|> tail")
    assert match == StopMatch("<|end|>", stopped=True, matched="<|end|>")


def test_text_after_the_stop_is_never_emitted() -> None:
    matcher = StopStringMatcher(("STOP",))
    match = matcher.feed("one STOP two STOP three")
    assert match == StopMatch("one ", stopped=True, matched="STOP")


def test_holds_only_a_tail_that_can_still_begin_a_stop() -> None:
    matcher = StopStringMatcher(("abcd",))
    assert matcher.feed("xxab").text == "xx"
    # "abx" can no longer begin "abcd", nor can any of its tails.
    assert matcher.feed("x").text == "abx"
    assert matcher.feed("a b").text == "a b"
    assert matcher.feed("ab").text == ""
    assert matcher.flush() == "ab"


def test_no_hold_when_nothing_can_match() -> None:
    matcher = StopStringMatcher(("</s>",))
    assert matcher.feed("plain text, no angle").text == "plain text, no angle"
    assert matcher.flush() == ""


def test_held_text_is_released_at_the_end() -> None:
    matcher = StopStringMatcher(("</s>",))
    assert matcher.feed("a </").text == "a "
    assert matcher.flush() == "</"


def test_several_stops_first_to_end_wins() -> None:
    # "bc" ends before "abcd" would: streamed one character at a time, "bc" stops first.
    matcher = StopStringMatcher(("abcd", "bc"))
    assert matcher.feed("xabcd") == StopMatch("xa", stopped=True, matched="bc")


def test_several_stops_same_end_longest_wins() -> None:
    matcher = StopStringMatcher(("end", "the end"))
    assert matcher.feed("that is the end.") == StopMatch(
        "that is ", stopped=True, matched="the end"
    )


def test_overlapping_prefixes_across_pieces() -> None:
    # "aab" has a tail "ab" that is itself a prefix: the hold must restart inside it.
    matcher = StopStringMatcher(("aab",))
    assert matcher.feed("aa").text == ""
    assert matcher.feed("a").text == "a"
    assert matcher.feed("b") == StopMatch("", stopped=True, matched="aab")


def test_no_stops_passes_text_through() -> None:
    matcher = StopStringMatcher(())
    assert matcher.feed("anything <|end|>") == StopMatch("anything <|end|>")
    assert matcher.flush() == ""


def test_empty_stop_string_is_invalid() -> None:
    with pytest.raises(GatewayError) as raised:
        StopStringMatcher(("ok", ""))
    assert raised.value.param == "stop"


@pytest.mark.parametrize("include", [False, True])
def test_any_cutting_matches_character_by_character(include: bool) -> None:
    rng = random.Random(7)
    alphabet = "ab<|>é😀 "
    for _ in range(2000):
        text = "".join(rng.choices(alphabet, k=rng.randrange(0, 24)))
        stops = tuple(
            "".join(rng.choices(alphabet, k=rng.randrange(1, 5)))
            for _ in range(rng.randrange(1, 4))
        )
        cuts = rng.sample(range(len(text) + 1), k=rng.randrange(0, len(text) + 1))
        assert streamed(text, stops, cuts, include) == reference(text, stops, include), (
            text,
            stops,
            cuts,
        )
