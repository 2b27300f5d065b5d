"""Per-key limits (requests per minute, tokens per minute, requests in flight), checked when a
generation request arrives, before the gateway's global admission.

Life cycle of one request of a key here:

1. ``KeyLimiter.acquire(key)`` (or ``hold``, its context manager) refuses at once with
   RESOURCE_EXHAUSTED (HTTP 429 with ``Retry-After``) when the key already has
   ``max_concurrent`` requests in flight, started ``requests_per_minute`` requests in the last
   60 s, or used ``tokens_per_minute`` tokens in the last 60 s. Otherwise the request is counted
   (started now, in flight).
2. While the block runs, ``KeyMeteredGenerator`` adds the request's tokens to its key as they
   happen: the prompt's when the first event arrives, each generated chunk's as it streams. So a
   client that hangs up early is charged for what it used, and the next request sees the total.
3. ``KeyLease.release()`` when the response has been sent, however it ended, takes the request
   out of flight.

The windows are sliding: each request and each token count expires 60 s after it was recorded,
so ``Retry-After`` is the time until enough of them expire. The clock is injected (tests drive
it; no test sleeps). Metrics are labelled by the key's name; the key itself never leaves
``auth.py``. The lease of the request in progress travels in a ``ContextVar`` so that the front
ends and the generator need no new parameters: both HTTP and gRPC run a request's generation in
the task that acquired the lease, or in tasks it starts, which inherit it. Not thread-safe,
and needs none: the gateway serves HTTP and gRPC on one asyncio loop.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.auth import ApiKey
from gateway.errors import ErrorKind, GatewayError
from gateway.generation import (
    GenerationEvent,
    GenerationRequest,
    Generator,
    StopGeneration,
    TokenChunk,
    close_events,
    stop_early,
)

logger = logging.getLogger(__name__)

WINDOW_S = 60.0


@dataclass
class _KeyState:
    """One key's sliding minute: start times of its requests, and (time, tokens) records."""

    num_in_flight: int = 0
    request_times: deque[float] = field(default_factory=deque)
    token_records: deque[tuple[float, int]] = field(default_factory=deque)
    num_tokens_in_window: int = 0

    def expire(self, now: float) -> None:
        while self.request_times and self.request_times[0] <= now - WINDOW_S:
            self.request_times.popleft()
        while self.token_records and self.token_records[0][0] <= now - WINDOW_S:
            self.num_tokens_in_window -= self.token_records.popleft()[1]


class KeyLease:
    """One admitted request of a key: ``add_tokens`` charges the key, ``release`` (idempotent)
    takes the request out of flight."""

    def __init__(self, limiter: KeyLimiter, key: ApiKey) -> None:
        self._limiter = limiter
        self.key = key
        self.num_tokens = 0
        self._context_token: contextvars.Token[KeyLease | None] | None = None
        self._is_released = False

    def add_tokens(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.num_tokens += num_tokens
            self._limiter._charge(self.key, num_tokens)

    def release(self) -> None:
        if self._is_released:
            return
        self._is_released = True
        if self._context_token is not None:
            # A servicer's async generator may be finalized outside the context it ran in;
            # that context ends with the request anyway.
            with contextlib.suppress(ValueError):
                _current_lease.reset(self._context_token)
        self._limiter._release(self.key)


_current_lease: contextvars.ContextVar[KeyLease | None] = contextvars.ContextVar(
    "pdserve_key_lease", default=None
)


def current_lease() -> KeyLease | None:
    """The lease of the request this task serves, when its key has one."""
    return _current_lease.get()


class KeyLimiter:
    def __init__(
        self, registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._states: dict[str, _KeyState] = {}
        self.requests = Counter(
            "pdserve:api_key_requests", "Requests admitted, by API key name", ("key_name",),
            registry=registry,
        )  # fmt: skip
        self.limited = Counter(
            "pdserve:api_key_rate_limited",
            "Requests refused with 429 by a per-key limit: requests_per_minute, "
            "tokens_per_minute or max_concurrent",
            ("key_name", "limit"), registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "pdserve:api_key_tokens", "Prompt and generated tokens, by API key name",
            ("key_name",), registry=registry,
        )  # fmt: skip
        self.running = Gauge(
            "pdserve:api_key_requests_running", "Requests in flight, by API key name",
            ("key_name",), registry=registry,
        )  # fmt: skip

    def _state(self, key: ApiKey) -> _KeyState:
        state = self._states.get(key.name)
        if state is None:
            state = self._states[key.name] = _KeyState()
        return state

    def check(self, key: ApiKey) -> None:
        """Raises RESOURCE_EXHAUSTED (with ``retry_after_s``) when ``key`` is over a limit."""
        limits = key.limits
        now = self._clock()
        state = self._state(key)
        state.expire(now)
        refusal: tuple[str, str, float] | None = None
        if limits.max_concurrent is not None and state.num_in_flight >= limits.max_concurrent:
            # Nothing says when one finishes; 1 s is a polite retry.
            refusal = ("max_concurrent", f"{state.num_in_flight} requests in flight", 1.0)
        elif (
            limits.requests_per_minute is not None
            and len(state.request_times) >= limits.requests_per_minute
        ):
            # The oldest of the window's requests must expire before another fits.
            wait = state.request_times[0] + WINDOW_S - now
            refusal = ("requests_per_minute", f"{len(state.request_times)} requests", wait)
        elif (
            limits.tokens_per_minute is not None
            and state.num_tokens_in_window >= limits.tokens_per_minute
        ):
            # Wait until the records expiring first bring the total under the limit.
            excess = state.num_tokens_in_window - limits.tokens_per_minute + 1
            wait = 0.0
            for recorded, num_tokens in state.token_records:
                excess -= num_tokens
                wait = recorded + WINDOW_S - now
                if excess <= 0:
                    break
            refusal = ("tokens_per_minute", f"{state.num_tokens_in_window} tokens", wait)
        if refusal is None:
            return
        limit, usage, wait_s = refusal
        self.limited.labels(key_name=key.name, limit=limit).inc()
        retry_after_s = max(1, math.ceil(wait_s))
        # debug, not info: a client hammering past its limit must not flood the log; the
        # pdserve:api_key_rate_limited counter says how often it happens.
        logger.debug("API key %s over its %s (%s)", key.name, limit, usage)
        raise GatewayError(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"API key {key.name!r} is over its {limit} limit "
            f"({getattr(limits, limit)}; {usage} now); retry in {retry_after_s} s",
            retry_after_s=retry_after_s,
        )

    def acquire(self, key: ApiKey | None) -> KeyLease | None:
        """Admit one request of ``key`` (step 1) and make it the current task's lease; None
        (nothing counted) when no key is configured. Raises RESOURCE_EXHAUSTED over a limit."""
        if key is None:
            return None
        self.check(key)
        state = self._state(key)
        state.request_times.append(self._clock())
        state.num_in_flight += 1
        self.requests.labels(key_name=key.name).inc()
        self.running.labels(key_name=key.name).set(state.num_in_flight)
        lease = KeyLease(self, key)
        lease._context_token = _current_lease.set(lease)
        return lease

    @contextlib.contextmanager
    def hold(self, key: ApiKey | None) -> Iterator[KeyLease | None]:
        """``acquire`` for the block, released when it ends."""
        lease = self.acquire(key)
        try:
            yield lease
        finally:
            if lease is not None:
                lease.release()

    def _release(self, key: ApiKey) -> None:
        state = self._state(key)
        state.num_in_flight -= 1
        assert state.num_in_flight >= 0, f"key {key.name}: more releases than requests"
        self.running.labels(key_name=key.name).set(state.num_in_flight)

    def _charge(self, key: ApiKey, num_tokens: int) -> None:
        state = self._state(key)
        now = self._clock()
        state.expire(now)
        state.token_records.append((now, num_tokens))
        state.num_tokens_in_window += num_tokens
        self.tokens.labels(key_name=key.name).inc(num_tokens)


class KeyMeteredGenerator:
    """A ``Generator`` that charges the current request's key for its tokens (step 2)."""

    def __init__(self, inner: Generator) -> None:
        self.inner = inner

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        lease = current_lease()
        events = self.inner.generate(request)
        try:
            is_first = True
            async for event in events:
                if lease is not None:
                    if is_first:
                        lease.add_tokens(len(request.prompt_token_ids))
                    if isinstance(event, TokenChunk):
                        lease.add_tokens(len(event.token_ids))
                is_first = False
                try:
                    yield event
                except StopGeneration:  # the output is complete: the inner generation ends it
                    finished = await stop_early(events)
                    if finished is not None:
                        yield finished
                    return
        finally:
            # Closing this iterator early must close the inner one: that cancels the node legs.
            await close_events(events)
