"""Bounds on what one request may ask for, enforced by both front ends before any node is asked.

Each bound is refused with a message naming the parameter (HTTP 400/413, gRPC INVALID_ARGUMENT).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    """Prompt tokens + max_tokens must fit (the nodes' context length)."""
    max_tokens: int
    """The largest max_tokens a request may ask for (≤ max_model_len)."""
    max_body_bytes: int = 4 * 2**20
    """HTTP request bodies larger than this are refused with 413."""
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_logprobs: int = 20
    max_prompts: int = 64
    """Prompts in one batched /v1/completions request."""

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 1 <= self.max_tokens <= self.max_model_len:
            raise ValueError(
                f"max_tokens must be in [1, max_model_len={self.max_model_len}], "
                f"got {self.max_tokens}"
            )
        for name in ("max_body_bytes", "max_n", "max_stop_strings", "max_stop_string_chars",
                     "max_prompts"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be in [0, 20], got {self.max_logprobs}")
