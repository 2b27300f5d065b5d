"""One token's log-probability and its top-n alternatives."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """The top-n alternatives as (token id, logprob), best first. The engine adds the token
    itself where it is not among them, in its place by logprob: ``top[:n]`` is the top-n."""
    rank: int | None = None
    """The token's rank in the whole vocabulary: 1 + the number of tokens with a greater
    logprob (vLLM's). Prompt tokens' only; None where not computed (generated tokens)."""
