"""The two legs of one attempt, as the routed generator drives them (gRPC in ``grpc_legs``).

A ``DecodeLeg`` is one decode ``Generate`` stream; a ``PrefillLeg`` one ``Prefill`` call. Each
is an async context manager that counts itself in flight on its node from entry until it is
done (the prefill leg: until its reply, or until it is cancelled) and, on exit, cancels what is
still running, so the node aborts the request and frees its blocks. A failure before anything
reached the client raises ``RetryableFailure`` (another pair may serve); after, ``StreamEnded``.
A leg counts itself with ``Node.add_leg``, which also lets the node's health poll end it: a node
that stopped answering (``Node.is_unresponsive``, hung) fails its legs as a killed one's fail.
Tests drive the generator with fake legs (``tests/gateway/test_routed_generator.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from gateway.generation import Finished, GenerationRequest, TokenChunk
from gateway.routing.node import Node
from services.types import FinishReason, StageTimings


class RetryableFailure(Exception):
    """An attempt failed before anything reached the client; another pair may serve it."""

    def __init__(self, cause: str, node: Node, message: str) -> None:
        super().__init__(message)
        self.cause = cause
        """``{leg}_{reason}``: ``decode_full``, ``prefill_unavailable``, ... (a metric label)."""
        self.node = node
        self.message = message


class StreamEnded(Exception):
    """An attempt failed after tokens were sent: the request ends with ``reason``."""

    def __init__(self, reason: FinishReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class Recomputing:
    """The decode node runs the prefill itself: every token now comes from its stream."""


DecodeEvent = TokenChunk | Finished | Recomputing


@dataclass(frozen=True)
class PrefillReply:
    first: TokenChunk
    """The first token (with its logprobs when asked for)."""
    cached_prompt_tokens: int
    timings: StageTimings
    finish_reason: FinishReason | None = None
    """Set when the first token ends the request (EOS, ``max_tokens=1``)."""


class DecodeLeg(ABC):
    node: Node
    streamed: bool = False
    """Set once a token reached the client: a failure then ends the stream, not the attempt."""

    @abstractmethod
    async def __aenter__(self) -> DecodeLeg: ...

    @abstractmethod
    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    @abstractmethod
    async def reservation(self) -> object:
        """The KV reservation the stream opens with (disaggregated only), for the prefill."""

    @abstractmethod
    async def next(self) -> DecodeEvent:
        """The next event; a stream that ends without ``Finished`` is a failure."""


class PrefillLeg(ABC):
    node: Node

    @abstractmethod
    async def __aenter__(self) -> PrefillLeg: ...

    @abstractmethod
    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    @abstractmethod
    async def reply(self, reservation: object | None) -> PrefillReply:
        """Pushes the prompt's pages to ``reservation`` and returns the first token; the leg
        stops counting itself in flight once this returns. Without a reservation (a request
        ending at its first token), nothing is pushed and the node frees the pages at once."""


class Legs(Protocol):
    """Opens the legs of one attempt on the nodes the router picked."""

    def decode(
        self,
        node: Node,
        leg_id: str,
        request: GenerationRequest,
        prefill: Node | None,
        timeout: float | None,
        wait_for_room: bool,
    ) -> DecodeLeg: ...

    def prefill(
        self,
        node: Node,
        leg_id: str,
        request: GenerationRequest,
        decode: Node | None,
        timeout: float | None,
    ) -> PrefillLeg:
        """``decode``: the node the pages go to; None when the first token ends the request."""
        ...
