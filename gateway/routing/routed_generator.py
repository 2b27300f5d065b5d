"""Runs one request across the nodes (design §2): the gateway's two legs, retries and deadlines.

Life cycle of one request here:

1. ATTEMPT: the router picks a pair (or a colocated node) not yet tried by this request.
2. Disaggregated: ``Decode.Generate(kv_source=P)`` is opened; its first event is the KV
   reservation (or RESOURCE_EXHAUSTED: next attempt). ``Prefill.Prefill(destination=...)``
   pushes the pages, commits, and returns the first token, which is sent on at once (TTFT);
   tokens 2..N come from the decode stream (buffered if they overtake the prefill's reply).
   If the decode node announces ``recomputing`` (``on_kv_failure=recompute`` after a failed
   push), the prefill leg is dropped and every token comes from the decode stream.
   Colocated, or a short prompt prefilled on its decode node (``local_prefill_max_tokens``):
   one ``Generate`` stream without ``kv_source`` carries every token.
   Prefill only (``max_tokens=1``: the first token is the last): one ``Prefill`` call without a
   destination; its reply is the token and says how the request finished.
3. RETRY: a refusal or failure before anything was sent to the client ends the attempt (both
   legs cancelled, so both nodes free their blocks); the next attempt uses a fresh leg id, so a
   fresh reservation and transfer id (peers.md #13), on nodes this request has not tried. A
   node that stopped answering its health polls fails its legs too (``Node.is_unresponsive``:
   ``{leg}_unresponsive``), as a killed node's fail at once.
   WAIT: when every decode node tried refused for want of room (``decode_full``), one more
   attempt asks a decode node to hold the request in its bounded wait queue until room frees
   (``wait_for_room``; bounded by the request deadline): overload is a queue, not an error.
   Only a full wait queue is refused, with RESOURCE_EXHAUSTED (HTTP 429 + Retry-After), before
   any node did work for the request. When nothing could serve, the 503 (UNAVAILABLE) says why
   (``Router.why_none``: no healthy prefill node, say), then each attempt's failure, latest first.
4. STREAMING: once a token was sent, a failure (a hung decode node's included) ends the stream
   with ``Finished(ERROR)`` — never a silent truncation — and a passed deadline with
   ``Finished(ABORT)``.
5. CLOSED: however the consumer leaves (aclose, cancellation), each leg's context exit cancels
   its call, and a cancelled RPC aborts the request on its node (peers.md #4, #5).
   STOPPED: a consumer that found the output complete (a stop string) throws ``StopGeneration``
   instead: the legs are cancelled the same way, then a ``Finished(STOP)`` goes out with what
   the attempt knew (``_Progress``), and the request is counted finished like any other. Thrown
   at the ``Finished`` itself (held-back text completed a stop string at the last token, say at
   ``max_tokens``), it makes that ``Finished`` a ``STOP``, as the client is told.

Metrics: every ``Finished`` that goes out is counted here (``request_success``, e2e latency, stage
timings), as are TTFT and ITL: this is where every front end's tokens pass. Its finish reason is
counted once the consumer has settled it (read past it, closed the events, or stopped them at
it). Failed requests are not: the front end that answers one counts it once
(``GatewayError.reason``, ``stream_failure`` in ``gateway/metrics.py``), since only it knows the
request (its ``n`` generations, a client gone).

Request ids: the nodes key everything by the id they are sent (the engine's request, the decode
node's reservation and transfer, the prefill node's held KV and push) and refuse one in use, so
that id is made here, unique per generation and attempt: ``{request_id}.{12 hex}``, then
``{request_id}.{12 hex}.r{attempt}`` for each retry. ``request_id`` is the client's
(``X-Request-Id`` or the gRPC ``request_id``, ``-{index}`` per choice when there are several),
which clients may reuse: two requests that send the same one at once, one retried after the first
finished, or one sent while the first's KV is still in flight each get nodes' ids of their own
(as vLLM makes its internal ids unique). Responses, headers, logs and metrics show the client's
id; the one log line per failed attempt names the nodes' id too, to find it in the nodes' logs.

The legs themselves (``legs``; over gRPC in ``grpc_legs``) count their own work in flight on
their node; this module decides which legs to open and in what order events go out.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.config import RouterConfig
from gateway.errors import ErrorKind, GatewayError
from gateway.generation import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    StopGeneration,
    TokenChunk,
)
from gateway.metrics import GatewayMetrics
from gateway.routing.grpc_legs import GrpcLegs
from gateway.routing.legs import (
    DecodeEvent,
    DecodeLeg,
    Legs,
    PrefillReply,
    Recomputing,
    RetryableFailure,
    StreamEnded,
)
from gateway.routing.node import Node
from gateway.routing.router import Route, Router
from services.types import FinishReason, StageTimings, Usage

logger = logging.getLogger(__name__)


@dataclass
class _Progress:
    """What an attempt has learned before its ``Finished``: all a request stopped early can be
    told, since legs cancelled before their ``Finished`` never send it."""

    cached_prompt_tokens: int = 0
    prefill_timings: StageTimings = field(default_factory=StageTimings)
    """The prefill node's queue, compute and KV push, from its reply (disaggregated only). The
    decode node's stages, and a colocated node's prefill, come only with its ``Finished``."""

    def stopped(self, num_prompt_tokens: int, num_sent: int) -> Finished:
        """The ``Finished`` of an attempt stopped after ``num_sent`` tokens; the stages it never
        heard of stay 0 (not observed), no number is made up for them."""
        usage = Usage(num_prompt_tokens, num_sent, self.cached_prompt_tokens)
        return Finished(FinishReason.STOP, usage, self.prefill_timings)


class RoutedGenerator:
    def __init__(
        self,
        router: Router,
        config: RouterConfig,
        metrics: GatewayMetrics,
        legs: Legs | None = None,
    ) -> None:
        """``legs``: opens the legs of an attempt; gRPC to the router's nodes by default."""
        self.router = router
        self.config = config
        self.metrics = metrics
        self.legs: Legs = legs or GrpcLegs(router.pool, config, metrics)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        started = time.monotonic()
        arrival = request.arrival or started
        gateway_queue_s = started - arrival
        tried: set[str] = set()
        failures: list[RetryableFailure] = []
        wait_for_room = False
        attempt = 0
        node_id = f"{request.request_id}.{uuid.uuid4().hex[:12]}"  # see "Request ids" above
        namespace = (request.sampling.cache_salt, request.sampling.lora_name)
        ends = _first_token_ends(request)
        while True:
            route = None
            if attempt <= self.config.max_retries:
                route = self.router.pick(
                    request.prompt_token_ids, tried, namespace, first_token_ends=ends
                )
            if route is None and not wait_for_room and _all_full(failures):
                # Every decode node tried is full: wait for room on one (the router's pick).
                wait_for_room, tried = True, set()
                route = self.router.pick(
                    request.prompt_token_ids, tried, namespace, first_token_ends=ends
                )
            if route is None:
                break
            # A retry never reuses an id: the prefill node keeps a held id reserved (peers #13).
            leg_id = node_id if attempt == 0 else f"{node_id}.r{attempt}"
            num_sent, last_sent = 0, 0.0
            progress = _Progress()
            try:
                async with aclosing(
                    self._attempt(route, leg_id, request, progress, wait_for_room)
                ) as events:
                    async for event in events:
                        now = time.monotonic()
                        if isinstance(event, Finished):
                            finished = self._finish(event, now - arrival, gateway_queue_s, attempt)
                            try:
                                yield finished
                            except StopGeneration:
                                # Text held back until the end completed a stop string: the
                                # client is told "stop", whatever ended the nodes' generation.
                                finished = replace(
                                    finished, finish_reason=FinishReason.STOP, error=None
                                )
                                yield finished
                            finally:
                                # Counted once the consumer has settled it (read on, closed, or
                                # stopped), so the metric says what the client was told.
                                self._count(finished)
                            continue
                        if num_sent == 0:
                            self.metrics.time_to_first_token.observe(now - arrival)
                        else:
                            self.metrics.inter_token_latency.observe(now - last_sent)
                        num_sent, last_sent = num_sent + len(event.token_ids), now
                        try:
                            yield event
                        except StopGeneration:
                            e2e_s = time.monotonic() - arrival
                            await events.aclose()  # the nodes stop decoding before it goes out
                            stopped = progress.stopped(len(request.prompt_token_ids), num_sent)
                            stopped = self._finish(stopped, e2e_s, gateway_queue_s, attempt)
                            self._count(stopped)
                            yield stopped
                            return
                return
            except RetryableFailure as failure:
                # A full decode node is admission at work (the request waits next), not a fault.
                level = logging.INFO if failure.cause == "decode_full" else logging.WARNING
                logger.log(
                    level, "request %s: attempt %d (%s) on %s failed before any token (%s): %s",
                    request.request_id, attempt, leg_id, failure.node.address, failure.cause,
                    failure.message,
                )  # fmt: skip
                self.metrics.retries.labels(cause=failure.cause).inc()
                failures.append(failure)
                tried.add(failure.node.address)
                attempt += 1
                if wait_for_room and failure.cause == "decode_full":
                    break  # even the wait queue is full: 429
        raise self._no_route(request, failures, attempt)

    def _no_route(
        self, request: GenerationRequest, failures: list[RetryableFailure], num_attempts: int
    ) -> GatewayError:
        if _all_full(failures):
            return GatewayError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"no KV capacity: every decode node tried ({len(failures)}) is full; retry later",
                reason="no_capacity",
            )
        if num_attempts > self.config.max_retries:
            why = f"{num_attempts} attempts failed (--max-retries {self.config.max_retries})"
        else:
            why = self.router.why_none(
                request.prompt_token_ids, request.sampling.lora_name, _first_token_ends(request)
            )
        # The latest failure first: it is what ended the request (an earlier one may be a decode
        # node's refusal that the wait for room has since answered).
        detail = "; ".join(f"{f.node.address}: {f.message}" for f in reversed(failures))
        return GatewayError(
            ErrorKind.UNAVAILABLE,
            f"no node could serve the request: {why}"
            + (f" (failed attempts, latest first: {detail})" if detail else ""),
            reason="no_node",
        )

    def _finish(
        self, finished: Finished, e2e_s: float, gateway_queue_s: float, num_retries: int
    ) -> Finished:
        """The request's ``Finished`` with what only the gateway knows; its latency and stages
        observed (its finish reason is counted by ``_count``, once the consumer settled it)."""
        timings = replace(finished.timings, gateway_queue_s=gateway_queue_s)
        finished = replace(finished, timings=timings, num_retries=num_retries)
        self.metrics.e2e_request_latency.observe(e2e_s)
        self.metrics.observe_stages(finished.timings)
        # Per generation, as vLLM counts: each of a request's n choices is an engine request of
        # its own, whose prompt counts once its prefill is done (vllm/v1/metrics/stats.py,
        # IterationStats.update_from_output); OpenAI's usage counts it once per request.
        self.metrics.prompt_tokens.inc(finished.usage.prompt_tokens)
        self.metrics.generation_tokens.inc(finished.usage.completion_tokens)
        return finished

    def _count(self, finished: Finished) -> None:
        self.metrics.requests_finished.labels(finished.finish_reason.value).inc()

    async def _attempt(
        self,
        route: Route,
        leg_id: str,
        request: GenerationRequest,
        progress: _Progress,
        wait_for_room: bool = False,
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Yields the attempt's events; raises ``RetryableFailure`` only before the first.

        Deadlines are the RPCs' own (``timeout=`` on each call), never an ``asyncio.timeout``
        around a ``yield``, which would cancel whatever the consumer awaits at that moment.
        """
        timeout = None if request.deadline is None else request.deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise _deadline_error()
        self.metrics.attempts.labels(route=route.kind).inc()
        if route.decode is None:
            assert route.prefill is not None
            leg = self._prefill_only(route.prefill, leg_id, request, timeout, progress)
        elif route.prefill is None:
            leg = self._colocated(route.decode, leg_id, request, timeout)
        else:
            leg = self._disaggregated(
                route.prefill, route.decode, leg_id, request, timeout, progress, wait_for_room
            )
        num_sent = 0
        try:
            async for event in leg:
                if isinstance(event, TokenChunk):
                    num_sent += len(event.token_ids)
                yield event
        except StreamEnded as ended:
            prompt = len(request.prompt_token_ids)
            yield Finished(ended.reason, Usage(prompt, num_sent), error=ended.message)
        finally:
            await leg.aclose()

    async def _colocated(
        self, node: Node, leg_id: str, request: GenerationRequest, timeout: float | None
    ) -> AsyncGenerator[GenerationEvent, None]:
        async with self.legs.decode(node, leg_id, request, None, timeout, False) as decode:
            while True:
                event = await decode.next()
                if isinstance(event, TokenChunk):
                    decode.streamed = True
                if not isinstance(event, Recomputing):
                    yield event
                if isinstance(event, Finished):
                    return

    async def _prefill_only(
        self,
        node: Node,
        leg_id: str,
        request: GenerationRequest,
        timeout: float | None,
        progress: _Progress,
    ) -> AsyncGenerator[GenerationEvent, None]:
        async with self.legs.prefill(node, leg_id, request, None, timeout) as prefill:
            answer = await prefill.reply(None)  # a failure here is retryable
        progress.cached_prompt_tokens = answer.cached_prompt_tokens
        progress.prefill_timings = answer.timings
        yield answer.first
        usage = Usage(
            len(request.prompt_token_ids), len(answer.first.token_ids), answer.cached_prompt_tokens
        )
        if answer.finish_reason is None:  # a node's bug: never a silent end
            yield Finished(
                FinishReason.ERROR,
                usage,
                answer.timings,
                error=f"prefill node {node.address} did not end a max_tokens=1 request",
            )
            return
        yield Finished(answer.finish_reason, usage, answer.timings)

    async def _disaggregated(
        self,
        prefill_node: Node,
        decode_node: Node,
        leg_id: str,
        request: GenerationRequest,
        timeout: float | None,
        progress: _Progress,
        wait_for_room: bool = False,
    ) -> AsyncGenerator[GenerationEvent, None]:
        legs = self.legs
        async with (
            legs.decode(
                decode_node, leg_id, request, prefill_node, timeout, wait_for_room
            ) as decode,
            legs.prefill(prefill_node, leg_id, request, decode_node, timeout) as prefill,
        ):
            reservation = await decode.reservation()
            reply = asyncio.ensure_future(prefill.reply(reservation))
            pending: asyncio.Future[DecodeEvent] | None = None
            try:
                held, recomputing, pending = await _hold_until_prefill(decode, reply)
                if not recomputing:
                    answer = reply.result()  # a failed prefill raises here: retryable
                    progress.cached_prompt_tokens = answer.cached_prompt_tokens
                    progress.prefill_timings = answer.timings
                    decode.streamed = True
                    yield answer.first
                while True:
                    event: DecodeEvent
                    if held:
                        event = held.pop(0)
                    elif pending is not None:
                        event, pending = await pending, None
                    else:
                        event = await decode.next()
                    if isinstance(event, Recomputing):
                        continue
                    if isinstance(event, TokenChunk):
                        decode.streamed = True
                        yield event
                        continue
                    yield _merge(event, progress)
                    return
            finally:
                for future in (pending, reply):
                    if future is None:
                        continue
                    future.cancel()
                    if future.done() and not future.cancelled():
                        future.exception()  # retrieved: a failure after the attempt ended is moot


async def _hold_until_prefill(
    decode: DecodeLeg, reply: asyncio.Future[PrefillReply]
) -> tuple[list[TokenChunk | Finished], bool, asyncio.Future[DecodeEvent] | None]:
    """Reads the decode stream until the prefill answers: tokens 2..N may overtake the
    prefill's reply, and the first token must go out first, so they are held. Returns the held
    events, whether the decode node took the prompt over (``Recomputing``: the prefill is
    cancelled), and a read still under way."""
    held: list[TokenChunk | Finished] = []
    pending: asyncio.Future[DecodeEvent] | None = asyncio.ensure_future(decode.next())
    try:
        while not reply.done():
            assert pending is not None
            racing: set[asyncio.Future[Any]] = {reply, pending}
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                continue
            event = pending.result()  # a decode failure here is retryable
            pending = None
            if isinstance(event, Recomputing):
                reply.cancel()
                return held, True, None
            held.append(event)
            if isinstance(event, Finished):
                await asyncio.wait({reply})
                break
            pending = asyncio.ensure_future(decode.next())
    except BaseException:
        if pending is not None:
            pending.cancel()
        raise
    return held, False, pending


def _first_token_ends(request: GenerationRequest) -> bool:
    return request.sampling.max_tokens == 1


def _all_full(failures: list[RetryableFailure]) -> bool:
    return bool(failures) and all(f.cause == "decode_full" for f in failures)


def _deadline_error() -> GatewayError:
    return GatewayError(
        ErrorKind.DEADLINE_EXCEEDED, "the request deadline passed before the first token"
    )


def _merge(finished: Finished, progress: _Progress) -> Finished:
    """The decode's Finished, completed with what only the prefill leg reported."""
    usage = finished.usage
    cached, prefill_timings = progress.cached_prompt_tokens, progress.prefill_timings
    if usage.cached_prompt_tokens == 0 and cached:
        usage = replace(usage, cached_prompt_tokens=cached)
    timings = finished.timings
    timings = replace(
        timings,
        prefill_queue_s=timings.prefill_queue_s or prefill_timings.prefill_queue_s,
        prefill_compute_s=timings.prefill_compute_s or prefill_timings.prefill_compute_s,
        kv_transfer_s=timings.kv_transfer_s or prefill_timings.kv_transfer_s,
    )
    return replace(finished, usage=usage, timings=timings)
