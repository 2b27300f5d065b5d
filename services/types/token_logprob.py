"""One generated token's log-probability and its top-n alternatives."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """The top-n alternatives as (token id, logprob), best first."""
