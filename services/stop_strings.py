"""Where a text first holds one of a request's stop strings: the rule the gateway's streaming
``StopStringMatcher`` and the offline ``LLM``'s ``TextStops`` share. Pure Python (the gateway is
torch-free).

The match is the one that *ends* first in the text, which is where generation would have stopped
had the text come one character at a time; so the result does not depend on how the text was cut
into pieces. Of matches ending at the same place the longest wins.
"""

from __future__ import annotations

from collections.abc import Iterable


def first_stop_match(text: str, stops: Iterable[str], ends_after: int) -> tuple[int, str] | None:
    """(where it begins, which) of the stop string whose occurrence in ``text`` ends first, of
    those that end past ``ends_after`` characters (the text a caller searched before); None
    where none does."""
    best: tuple[int, int, str] | None = None  # (end, -length, stop): the least wins
    for stop in stops:
        begin = text.find(stop, max(0, ends_after + 1 - len(stop)))
        if begin == -1:
            continue
        candidate = (begin + len(stop), -len(stop), stop)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None
    end, _, stop = best
    return end - len(stop), stop
