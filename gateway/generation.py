"""What flows between the API front ends (HTTP, public gRPC) and the routed node legs.

A front end turns its request into a ``GenerationRequest`` (token ids, sampling, deadline) and
iterates ``Generator.generate``: ``TokenChunk``s in order, then exactly one ``Finished``. Errors
before the first chunk are raised as ``GatewayError`` (no capacity → RESOURCE_EXHAUSTED, no
healthy node → UNAVAILABLE, a node's INVALID_ARGUMENT → INVALID_ARGUMENT); after the first chunk a
failure is a ``Finished`` with reason ``error``. Closing the iterator early (``aclose``, a
cancelled task) cancels both node legs at once and frees their blocks.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from gateway.sampling import SamplingOptions


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled (client gone, deadline, shutdown)
    ERROR = "error"  # a failure after tokens were streamed


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """The top-n alternatives as (token id, logprob), best first."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    """One id through every log line, node and stage timing."""
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    deadline: float | None = None
    """``time.monotonic()`` by which the request must be finished; None: no deadline."""
    arrival: float = 0.0
    """``time.monotonic()`` when the gateway received it (queue time and TTFT start here)."""


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One per token when ``sampling.logprobs`` was set."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class StageTimings:
    """Seconds spent in each stage of one request (design §7); 0 where a stage did not run."""

    gateway_queue_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    kv_transfer_s: float = 0.0
    decode_queue_s: float = 0.0
    first_decode_step_s: float = 0.0
    decode_s: float = 0.0


@dataclass(frozen=True)
class Finished:
    finish_reason: FinishReason
    usage: Usage
    timings: StageTimings = field(default_factory=StageTimings)
    error: str | None = None
    """Set with ``FinishReason.ERROR``."""
    num_retries: int = 0
    """How many pairs were tried before the one that served the request."""


GenerationEvent = TokenChunk | Finished


class Generator(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]: ...
