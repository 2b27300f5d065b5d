"""What flows between the embeddings front end (``/v1/embeddings``) and the nodes: one prompt's
``EmbeddingRequest`` in, its vector out (``Embedder.embed``), or a ``GatewayError`` (a node's
INVALID_ARGUMENT → INVALID_ARGUMENT naming the field; no node → UNAVAILABLE; the deadline →
DEADLINE_EXCEEDED). Cancelling the call cancels the node's request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from services.types import PoolingParams


@dataclass(frozen=True)
class EmbeddingRequest:
    request_id: str
    """The client's id (and ``-{index}`` per input); the node gets one made from it."""
    prompt_token_ids: tuple[int, ...]
    pooling: PoolingParams
    priority: int = 0
    lora_name: str | None = None
    deadline: float | None = None
    """``time.monotonic()`` by which it must be answered; None: no deadline."""


@dataclass(frozen=True)
class Embedding:
    vector: list[float]


class Embedder(Protocol):
    async def embed(self, request: EmbeddingRequest) -> Embedding: ...
