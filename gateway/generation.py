"""What flows between the API front ends (HTTP, public gRPC) and the routed node legs.

A front end turns its request into a ``GenerationRequest`` (token ids, sampling, deadline) and
iterates ``Generator.generate``: ``TokenChunk``s in order, then exactly one ``Finished``. Errors
before the first chunk are raised as ``GatewayError`` (no capacity → RESOURCE_EXHAUSTED, no
healthy node → UNAVAILABLE, a node's INVALID_ARGUMENT → INVALID_ARGUMENT); after the first chunk a
failure is a ``Finished`` with reason ``error``. Closing the iterator early (``aclose``, a
cancelled task) cancels both node legs at once and frees their blocks. A consumer that finds the
output complete first (a stop string) ends it with ``stop_early`` instead: the legs are cancelled
the same way, and the iterator's last event is a ``Finished(STOP)``, so the request counts as
finished, not as cancelled. Thrown at the ``Finished`` itself (text held back until the end
completed a stop string), ``stop_early`` gets that ``Finished`` as a ``STOP``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from services.types import FinishReason, SamplingParams, StageTimings, TokenLogprob, Usage

CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
"""What a client's own request id may be (``X-Request-Id``, the gRPC ``request_id``): it reaches
log lines and, with a suffix, the nodes' ids, so it is kept short and printable."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    """The client's id for this generation, in every response and gateway log line. Clients may
    reuse one, so the nodes are sent ids of their own, made from it (``routed_generator``)."""
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    deadline: float | None = None
    """``time.monotonic()`` by which the request must be finished; None: no deadline."""
    arrival: float = 0.0
    """``time.monotonic()`` when the gateway received it (queue time and TTFT start here)."""


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One per token when ``sampling.logprobs`` was set."""
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    """In the first chunk, with ``sampling.prompt_logprobs``: prompt tokens 1, 2, ... (the first
    has none), each with its alternatives."""


@dataclass(frozen=True)
class Finished:
    finish_reason: FinishReason
    usage: Usage
    timings: StageTimings = field(default_factory=StageTimings)
    error: str | None = None
    """Set with ``FinishReason.ERROR``."""
    invalid_request: bool = False
    """With ``FinishReason.ERROR``: the request itself failed (its grammar, while it ran), so a
    retry fails the same way: a client error, not the server's."""
    num_retries: int = 0
    """How many pairs were tried before the one that served the request."""


GenerationEvent = TokenChunk | Finished


class StopGeneration(Exception):
    """Thrown into a generation's events (``stop_early``) when the output is complete before the
    nodes finished it. The generator cancels its node legs as on ``aclose``, then yields one last
    ``Finished(STOP)`` with what it knows by then; one that wraps another passes it on. Thrown at
    the ``Finished``, it yields that one again as a ``STOP``."""


async def stop_early(events: AsyncIterator[GenerationEvent]) -> Finished | None:
    """Ends ``events`` with ``StopGeneration``: the ``Finished`` they end with, or None from
    events that cannot end so (not a generator, or one that knows no ``StopGeneration``)."""
    if not isinstance(events, AsyncGenerator):
        return None
    try:
        last = await events.athrow(StopGeneration())
    except (StopGeneration, StopAsyncIteration):
        return None
    finally:
        await events.aclose()
    return last if isinstance(last, Finished) else None


async def close_events(events: object) -> None:
    """Closes a generation's events (or an iterator wrapping them) early: ``Generator.generate``
    promises an ``AsyncIterator``, and the real ones are async generators, whose ``aclose``
    cancels both node legs. Closing twice, or an iterator without ``aclose``, does nothing."""
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


class Generator(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]: ...
