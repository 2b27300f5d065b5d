"""Sampling options as the gateway passes them to the nodes (mirrors ``pdserve.v1.SamplingParams``).

The gateway validates ranges up front so an HTTP client gets a 400 naming its own parameter;
the nodes validate again (they are reachable directly). ``None`` means the node's default.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import invalid
from services.guided_decoding import GuidedDecoding


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float | None = None  # node default 1.0; 0 = greedy
    top_k: int | None = None  # -1 or None: off
    top_p: float | None = None
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Top-n alternatives to return besides each sampled token; None: no logprobs."""
    priority: int = 0
    guided: GuidedDecoding | None = None
    """The grammar the output must follow; None: free text."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) pairs added to the logits."""

    def __post_init__(self) -> None:
        checks = (
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (self.temperature is None or self.temperature >= 0, "temperature", "must be >= 0"),
            (self.top_k is None or self.top_k == -1 or self.top_k >= 1, "top_k",
             "must be -1 (off) or >= 1"),
            (self.top_p is None or 0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty is None or self.repetition_penalty > 0,
             "repetition_penalty", "must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0"),
            (self.seed is None or -(2**63) <= self.seed < 2**63, "seed", "must fit in int64"),
        )  # fmt: skip
        for ok, name, rule in checks:
            if not ok:
                raise invalid(f"{name} {rule}, got {getattr(self, name)!r}", param=name)
