"""A grammar check that blocks until the test releases it: where a compile runs, nothing else
may wait on it (the gateway's event loop, a node's engine thread)."""

from __future__ import annotations

import threading

import pytest

from services.guided_decoding import GuidedDecoding


class BlockingGrammarCheck:
    """Patches ``GuidedDecoding.to_grammar``, which the gateway's check and the node's compile
    both start with: each call sets ``entered``, then waits for ``released`` (up to ``wait_s``)
    and records whether it came, then goes on as before."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, wait_s: float) -> None:
        self.entered, self.released = threading.Event(), threading.Event()
        self.was_released: list[bool] = []
        to_grammar = GuidedDecoding.to_grammar

        def blocking_to_grammar(grammar: GuidedDecoding) -> str:
            self.entered.set()
            self.was_released.append(self.released.wait(wait_s))
            return to_grammar(grammar)

        monkeypatch.setattr(GuidedDecoding, "to_grammar", blocking_to_grammar)
