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
3. RETRY: a refusal or failure before anything was sent to the client ends the attempt (both
   legs cancelled, so both nodes free their blocks); the next attempt uses a fresh leg id, so a
   fresh reservation and transfer id (peers.md #13), on nodes this request has not tried.
   WAIT: when every decode node tried refused for want of room (``decode_full``), one more
   attempt asks a decode node to hold the request in its bounded wait queue until room frees
   (``wait_for_room``; bounded by the request deadline): overload is a queue, not an error.
   Only a full wait queue is refused, with RESOURCE_EXHAUSTED (HTTP 429 + Retry-After), before
   any node did work for the request.
4. STREAMING: once a token was sent, a failure ends the stream with ``Finished(ERROR)`` — never
   a silent truncation — and a passed deadline with ``Finished(ABORT)``.
5. CLOSED: however the consumer leaves (aclose, cancellation), ``finally`` cancels both calls;
   a cancelled RPC aborts the request on its node (peers.md #4, #5).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

from gateway.config import KvFailurePolicy, RouterConfig
from gateway.errors import ErrorKind, GatewayError
from gateway.generation import Finished, GenerationEvent, GenerationRequest, TokenChunk
from gateway.metrics import GatewayMetrics
from gateway.node_pool import Node
from gateway.router import Route, Router
from pdserve.v1 import decode_pb2, prefill_pb2
from services.convert import (
    finish_reason_from_proto,
    sampling_params_to_proto,
    stage_timings_from_proto,
    token_logprob_from_proto,
    usage_from_proto,
)
from services.types import FinishReason, StageTimings, Usage

logger = logging.getLogger(__name__)

_KV_POLICY = {
    KvFailurePolicy.FAIL: decode_pb2.KV_FAILURE_POLICY_FAIL,
    KvFailurePolicy.RECOMPUTE: decode_pb2.KV_FAILURE_POLICY_RECOMPUTE,
}
# Node answers that say "this request is wrong", not "this node is unwell": never retried.
_CALLER_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


class _RetryableFailure(Exception):
    """An attempt failed before anything reached the client; another pair may serve it."""

    def __init__(self, cause: str, node: Node, message: str) -> None:
        super().__init__(message)
        self.cause = cause
        self.node = node
        self.message = message


class _StreamEnded(Exception):
    """An attempt failed after tokens were sent: the request ends with ``reason``."""

    def __init__(self, reason: FinishReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class _Recomputing:
    """The decode node runs the prefill itself: every token now comes from its stream."""


class _DecodeReader:
    """A decode ``Generate`` stream as gateway events. A failure is retryable until the caller
    sets ``streamed`` (a token reached the client), and ends the request after."""

    def __init__(self, stream: grpc.aio.UnaryStreamCall, node: Node, metrics: GatewayMetrics):
        self.stream = stream
        self.node = node
        self.metrics = metrics
        self.streamed = False

    async def read(self) -> decode_pb2.GenerateResponse | None:
        try:
            event = await self.stream.read()
        except grpc.aio.AioRpcError as exc:
            if not self.streamed:
                raise _failure(exc, self.node, "decode") from None
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise _StreamEnded(FinishReason.ABORT, "the request deadline passed") from None
            raise _StreamEnded(
                FinishReason.ERROR, f"decode node {self.node.address}: {exc.details()}"
            ) from None
        return None if event is grpc.aio.EOF else event

    async def next(self) -> TokenChunk | Finished | _Recomputing:
        """The next event; a stream that ends without ``Finished`` is a failure."""
        while True:
            event = await self.read()
            if event is None:
                if not self.streamed:
                    raise _RetryableFailure(
                        "decode_protocol", self.node, "the decode stream ended early"
                    )
                raise _StreamEnded(FinishReason.ERROR, "the decode stream ended without Finished")
            kind = event.WhichOneof("event")
            if kind == "tokens":
                logprobs = tuple(token_logprob_from_proto(lp) for lp in event.tokens.logprobs)
                return TokenChunk(tuple(event.tokens.token_ids), logprobs or None)
            if kind == "finished":
                return _finished_from_proto(event.finished)
            if kind == "recomputing":
                logger.warning("decode node %s recomputes the prompt itself", self.node.address)
                self.metrics.retries.labels(cause="kv_recompute").inc()
                return _Recomputing()
            # Anything else (a second reservation, a newer event kind): skip it.


class RoutedGenerator:
    def __init__(self, router: Router, config: RouterConfig, metrics: GatewayMetrics) -> None:
        self.router = router
        self.config = config
        self.metrics = metrics

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        started = time.monotonic()
        arrival = request.arrival or started
        gateway_queue_s = started - arrival
        tried: set[str] = set()
        failures: list[_RetryableFailure] = []
        wait_for_room = False
        attempt = 0
        while True:
            route = None
            if attempt <= self.config.max_retries:
                route = self.router.pick(request.prompt_token_ids, exclude=tried)
            if route is None and not wait_for_room and _all_full(failures):
                # Every decode node tried is full: wait for room on one (the router's pick).
                wait_for_room, tried = True, set()
                route = self.router.pick(request.prompt_token_ids, exclude=tried)
            if route is None:
                break
            # A retry never reuses an id: the prefill node keeps a held id reserved (peers #13).
            leg_id = request.request_id if attempt == 0 else f"{request.request_id}.r{attempt}"
            num_sent, last_sent = 0, 0.0
            try:
                async for event in self._attempt(route, leg_id, request, wait_for_room):
                    now = time.monotonic()
                    if isinstance(event, TokenChunk):
                        if num_sent == 0:
                            self.metrics.time_to_first_token.observe(now - arrival)
                        else:
                            self.metrics.inter_token_latency.observe(now - last_sent)
                        num_sent, last_sent = num_sent + len(event.token_ids), now
                    else:
                        event = replace(
                            event,
                            timings=replace(event.timings, gateway_queue_s=gateway_queue_s),
                            num_retries=attempt,
                        )
                        self.metrics.e2e_request_latency.observe(now - arrival)
                        self.metrics.observe_stages(event.timings)
                        self.metrics.requests_finished.labels(event.finish_reason.value).inc()
                    yield event
                return
            except _RetryableFailure as failure:
                # A full decode node is admission at work (the request waits next), not a fault.
                level = logging.INFO if failure.cause == "decode_full" else logging.WARNING
                logger.log(
                    level, "request %s: attempt %d on %s failed before any token (%s): %s",
                    request.request_id, attempt, failure.node.address, failure.cause,
                    failure.message,
                )  # fmt: skip
                self.metrics.retries.labels(cause=failure.cause).inc()
                failures.append(failure)
                tried.add(failure.node.address)
                attempt += 1
                if wait_for_room and failure.cause == "decode_full":
                    break  # even the wait queue is full: 429
        raise self._no_route(failures)

    def _no_route(self, failures: list[_RetryableFailure]) -> GatewayError:
        if _all_full(failures):
            self.metrics.request_errors.labels(reason="no_capacity").inc()
            return GatewayError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"no KV capacity: every decode node tried ({len(failures)}) is full; retry later",
            )
        self.metrics.request_errors.labels(reason="no_node").inc()
        detail = "; ".join(f"{f.node.address}: {f.message}" for f in failures)
        return GatewayError(
            ErrorKind.UNAVAILABLE,
            "no healthy prefill/decode pair or colocated node could serve the request"
            + (f" ({detail})" if detail else ""),
        )

    async def _attempt(
        self, route: Route, leg_id: str, request: GenerationRequest, wait_for_room: bool = False
    ) -> AsyncIterator[GenerationEvent]:
        """Yields the attempt's events; raises ``_RetryableFailure`` only before the first.

        Deadlines are the RPCs' own (``timeout=`` on each call), never an ``asyncio.timeout``
        around a ``yield``, which would cancel whatever the consumer awaits at that moment.
        """
        timeout = None if request.deadline is None else request.deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise _deadline_error(self.metrics)
        self.metrics.attempts.labels(route=route.kind).inc()
        if route.prefill is None:
            leg = self._colocated(route.decode, leg_id, request, timeout)
        else:
            leg = self._disaggregated(
                route.prefill, route.decode, leg_id, request, timeout, wait_for_room
            )
        num_sent = 0
        try:
            async for event in leg:
                if isinstance(event, TokenChunk):
                    num_sent += len(event.token_ids)
                yield event
        except _StreamEnded as ended:
            self.metrics.request_errors.labels(reason=f"stream_{ended.reason.value}").inc()
            prompt = len(request.prompt_token_ids)
            yield Finished(ended.reason, Usage(prompt, num_sent), error=ended.message)
        finally:
            await leg.aclose()

    def _generate_request(
        self,
        leg_id: str,
        request: GenerationRequest,
        kv_source: str,
        timeout: float | None,
        wait_for_room: bool = False,
    ) -> decode_pb2.GenerateRequest:
        message = decode_pb2.GenerateRequest(
            request_id=leg_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_params_to_proto(request.sampling),
            kv_source=kv_source,
        )
        if kv_source:
            lease_ms = self.config.lease_ms
            if timeout is not None:  # a reservation never outlives its request
                lease_ms = max(100, min(lease_ms, int(timeout * 1000)))
            message.lease_ms = lease_ms
            message.on_kv_failure = _KV_POLICY[self.config.on_kv_failure]
            message.wait_for_room = wait_for_room
        return message

    async def _colocated(
        self, node: Node, leg_id: str, request: GenerationRequest, timeout: float | None
    ) -> AsyncIterator[GenerationEvent]:
        node.num_in_flight += 1
        stream = node.decode.Generate(
            self._generate_request(leg_id, request, "", timeout), timeout=timeout
        )
        reader = _DecodeReader(stream, node, self.metrics)
        try:
            while True:
                event = await reader.next()
                if isinstance(event, TokenChunk):
                    reader.streamed = True
                if not isinstance(event, _Recomputing):
                    yield event
                if isinstance(event, Finished):
                    return
        finally:
            node.num_in_flight -= 1
            stream.cancel()

    async def _disaggregated(
        self,
        prefill: Node,
        decode: Node,
        leg_id: str,
        request: GenerationRequest,
        timeout: float | None,
        wait_for_room: bool = False,
    ) -> AsyncIterator[GenerationEvent]:
        decode.num_in_flight += 1
        prefill.num_in_flight += 1
        stream = decode.decode.Generate(
            self._generate_request(leg_id, request, prefill.address, timeout, wait_for_room),
            timeout=timeout,
        )
        reader = _DecodeReader(stream, decode, self.metrics)
        prefill_call: grpc.aio.UnaryUnaryCall | None = None
        prefill_task: asyncio.Future[prefill_pb2.PrefillResult] | None = None
        next_event: asyncio.Future | None = None
        try:
            first = await reader.read()
            if first is None or first.WhichOneof("event") != "reservation":
                raise _RetryableFailure(
                    "decode_protocol", decode, "the decode stream did not begin with a reservation"
                )
            prefill_call = prefill.prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=leg_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling=sampling_params_to_proto(request.sampling),
                    destination=first.reservation,
                    decode_target=decode.address,
                ),
                timeout=timeout,
            )
            prefill_task = asyncio.ensure_future(prefill_call)
            # Until the prefill answers, decode events are held: tokens 2..N may overtake the
            # prefill's reply, and the first token must go out first.
            held: list[TokenChunk | Finished] = []
            recomputing = False
            next_event = asyncio.ensure_future(reader.next())
            while not prefill_task.done():
                await asyncio.wait({prefill_task, next_event}, return_when=asyncio.FIRST_COMPLETED)
                if not next_event.done():
                    continue
                event = next_event.result()  # a decode failure here is retryable
                next_event = None
                if isinstance(event, _Recomputing):
                    recomputing = True
                    prefill_call.cancel()
                    break
                held.append(event)
                if isinstance(event, Finished):
                    await asyncio.wait({prefill_task})
                    break
                next_event = asyncio.ensure_future(reader.next())
            cached, prefill_timings = 0, StageTimings()
            if not recomputing:
                try:
                    result = prefill_task.result()
                except grpc.aio.AioRpcError as exc:
                    raise _failure(exc, prefill, "prefill") from None
                prefill.num_in_flight -= 1
                prefill = None
                cached = result.cached_prompt_tokens
                prefill_timings = stage_timings_from_proto(result.timings)
                reader.streamed = True
                yield TokenChunk(
                    (result.first_token_id,),
                    (token_logprob_from_proto(result.first_logprobs),)
                    if result.HasField("first_logprobs")
                    else None,
                )
            while True:
                if held:
                    event = held.pop(0)
                elif next_event is not None:
                    event, next_event = await next_event, None
                else:
                    event = await reader.next()
                if isinstance(event, _Recomputing):
                    continue
                if isinstance(event, TokenChunk):
                    reader.streamed = True
                    yield event
                    continue
                yield _merge(event, cached, prefill_timings)
                return
        finally:
            if next_event is not None:
                next_event.cancel()
            if next_event is not None and next_event.done() and not next_event.cancelled():
                next_event.exception()  # retrieved: a failure after the attempt ended is moot
            if prefill_call is not None and not prefill_call.done():
                prefill_call.cancel()  # the prefill node aborts and frees (peers.md #5)
            if prefill_task is not None and prefill_task.done() and not prefill_task.cancelled():
                prefill_task.exception()
            stream.cancel()
            decode.num_in_flight -= 1
            if prefill is not None:
                prefill.num_in_flight -= 1


def _all_full(failures: list[_RetryableFailure]) -> bool:
    return bool(failures) and all(f.cause == "decode_full" for f in failures)


def _deadline_error(metrics: GatewayMetrics) -> GatewayError:
    metrics.request_errors.labels(reason="deadline").inc()
    return GatewayError(
        ErrorKind.DEADLINE_EXCEEDED, "the request deadline passed before the first token"
    )


def _failure(exc: grpc.aio.AioRpcError, node: Node, leg: str) -> Exception:
    """Maps a node's refusal before any token to a retry or to the client's error."""
    code = exc.code()
    details = exc.details() or code.name
    if code in _CALLER_ERRORS:
        return GatewayError(ErrorKind.INVALID_ARGUMENT, details)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(ErrorKind.DEADLINE_EXCEEDED, f"{leg} node {node.address}: {details}")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _RetryableFailure(f"{leg}_full", node, details)
    if code is grpc.StatusCode.UNAVAILABLE:
        node.mark_failed(details)
        return _RetryableFailure(f"{leg}_unavailable", node, details)
    return _RetryableFailure(f"{leg}_{code.name.lower()}", node, details)


def _finished_from_proto(message: decode_pb2.Finished) -> Finished:
    return Finished(
        # A reason this gateway does not know (a newer node) reads as an error, never a success.
        finish_reason=finish_reason_from_proto(message.finish_reason) or FinishReason.ERROR,
        usage=usage_from_proto(message.usage),
        timings=stage_timings_from_proto(message.timings),
        error=message.error or None,
    )


def _merge(finished: Finished, cached: int, prefill_timings: StageTimings) -> Finished:
    """The decode's Finished, completed with what only the prefill leg reported."""
    usage = finished.usage
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
