"""Limits of the public APIs that more than one module checks (one definition, one value)."""

from __future__ import annotations

MAX_LOGPROBS = 20
"""Most alternatives per token a client may ask the gateway for (OpenAI's ``top_logprobs``
limit); the engine itself allows up to the vocabulary size (the offline API)."""
