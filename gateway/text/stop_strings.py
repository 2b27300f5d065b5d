"""Stop strings found in streamed text, across token and chunk boundaries.

Text arrives in pieces that may split a stop string anywhere ("<|e" then "nd|>"). The matcher
keeps back only the longest tail of the text that could still begin a stop string, and lets
the rest out at once. A match ends the stream: the text before it (and the stop string itself
with ``include_stop_str_in_output``) comes out, nothing after it ever does.

The match is the one that *ends* first in the text (``services.stop_strings``, shared with the
offline ``LLM``), so the result does not depend on how the text was cut into pieces.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gateway.errors import invalid
from services.stop_strings import first_stop_match

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopMatch:
    text: str
    """Text safe to send now."""
    stopped: bool = False
    matched: str | None = None
    """The stop string that matched, when ``stopped``."""


class StopStringMatcher:
    """Feed it a stream's text piece by piece; it says what to send and when to stop."""

    def __init__(self, stops: tuple[str, ...], include_stop_str_in_output: bool = False) -> None:
        if any(not stop for stop in stops):
            raise invalid("stop strings must not be empty", param="stop")
        self._stops = tuple(dict.fromkeys(stops))  # duplicates only cost time
        self._include_stop_str_in_output = include_stop_str_in_output
        self._max_held_chars = max((len(stop) for stop in self._stops), default=1) - 1
        self._held = ""
        self._is_stopped = False

    @property
    def is_stopped(self) -> bool:
        return self._is_stopped

    def feed(self, text: str, may_stop: bool = True) -> StopMatch:
        """``may_stop=False``: ``text`` cannot stop the stream (vLLM checks stop strings only
        past ``min_tokens``), but a stop string it begins can still end in later text."""
        assert not self._is_stopped, "feed() after a stop: the stream has ended"
        if not self._stops:
            return StopMatch(text)
        buffer = self._held + text
        match = self._first_match(buffer, len(self._held)) if may_stop else None
        if match is not None:
            start, stop = match
            self._is_stopped = True
            self._held = ""
            end = start + len(stop) if self._include_stop_str_in_output else start
            return StopMatch(buffer[:end], stopped=True, matched=stop)
        num_held = self._num_chars_to_hold(buffer)
        self._held = buffer[len(buffer) - num_held :]
        return StopMatch(buffer[: len(buffer) - num_held])

    def flush(self) -> str:
        """The held text, when the stream ended without a stop."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str, num_held: int) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first; the longest on a tie. Only a
        match that ends past the held text counts: one within it was fed with may_stop=False."""
        return first_stop_match(buffer, self._stops, num_held)

    def _num_chars_to_hold(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of a stop string."""
        for num_chars in range(min(self._max_held_chars, len(buffer)), 0, -1):
            tail = buffer[len(buffer) - num_chars :]
            if any(stop.startswith(tail) for stop in self._stops):
                return num_chars
        return 0
