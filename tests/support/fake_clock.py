"""A clock a test moves by hand, for code that takes a ``clock`` callable."""

from __future__ import annotations


class FakeClock:
    """``clock()`` is ``clock.now`` (seconds); the test advances it with ``clock.now += s``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
