"""A grammar check that blocks until the test releases it: where a compile runs, nothing else
may wait on it (the gateway's event loop, a node's engine thread)."""

from __future__ import annotations

import threading

import pytest

from services.guided_decoding import GuidedDecoding


class BlockingGrammarCheck:
    """Patches ``GuidedDecoding.check``: each call sets ``entered``, then waits for ``released``
    (up to ``wait_s``) and records whether it came, then checks as before."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, wait_s: float) -> None:
        self.entered, self.released = threading.Event(), threading.Event()
        self.was_released: list[bool] = []
        check = GuidedDecoding.check

        def blocking_check(grammar: GuidedDecoding) -> None:
            self.entered.set()
            self.was_released.append(self.released.wait(wait_s))
            check(grammar)

        monkeypatch.setattr(GuidedDecoding, "check", blocking_check)
