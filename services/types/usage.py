"""Token counts of one finished request (OpenAI's ``usage``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache instead of computed."""
