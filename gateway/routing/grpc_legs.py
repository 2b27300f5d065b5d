"""The legs of one attempt over gRPC: a decode ``Generate`` stream and a ``Prefill`` call.

Deadlines are the RPCs' own (``timeout=`` on each call). A cancelled RPC aborts the request on
its node, which frees its blocks: exiting a leg cancels whatever is still running.

A leg whose node turns unresponsive (``Node.is_unresponsive``: its health polls went unanswered)
is ended by the node's poll: its RPC is cancelled, and the call waiting on it fails as a killed
node's does, retryable before the first token (``{leg}_unresponsive``), the stream's error after
(a prefill leg only under ``on_kv_failure=fail``: under recompute, the reservation's lease
catches the hung prefill node and the decode node computes the prompt itself).
grpc.aio reports a call cancelled locally as ``CancelledError``; it is told from the task's own
cancellation by ``Task.cancelling()``, which only the latter raises.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import cast

import grpc

from gateway.config import KvFailurePolicy, RouterConfig
from gateway.errors import ErrorKind, GatewayError
from gateway.generation import Finished, GenerationRequest, TokenChunk
from gateway.metrics import GatewayMetrics
from gateway.routing.legs import (
    DecodeEvent,
    DecodeLeg,
    PrefillLeg,
    PrefillReply,
    Recomputing,
    RetryableFailure,
    StreamEnded,
)
from gateway.routing.node import Node
from gateway.routing.node_pool import NodePool
from pdserve.v1 import common_pb2, decode_pb2, kv_pb2, prefill_pb2
from services.convert import (
    finish_reason_from_proto,
    refused_param,
    sampling_params_to_proto,
    stage_timings_from_proto,
    token_logprob_from_proto,
    usage_from_proto,
)
from services.types import FinishReason, StageTimings

logger = logging.getLogger(__name__)

_KV_POLICY = {
    KvFailurePolicy.FAIL: decode_pb2.KV_FAILURE_POLICY_FAIL,
    KvFailurePolicy.RECOMPUTE: decode_pb2.KV_FAILURE_POLICY_RECOMPUTE,
}
# Node answers that say "this request is wrong", not "this node is unwell": never retried.
_CALLER_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


class GrpcLegs:
    def __init__(self, pool: NodePool, config: RouterConfig, metrics: GatewayMetrics) -> None:
        self.pool = pool
        self.config = config
        self.metrics = metrics

    def decode(
        self,
        node: Node,
        leg_id: str,
        request: GenerationRequest,
        prefill: Node | None,
        timeout: float | None,
        wait_for_room: bool,
    ) -> GrpcDecodeLeg:
        message = decode_pb2.GenerateRequest(
            request_id=leg_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_params_to_proto(request.sampling),
            kv_source=prefill.address if prefill is not None else "",
        )
        if prefill is not None:
            lease_ms = self.config.lease_ms
            if timeout is not None:  # a reservation never outlives its request
                lease_ms = max(100, min(lease_ms, int(timeout * 1000)))
            message.lease_ms = lease_ms
            message.on_kv_failure = _KV_POLICY[self.config.on_kv_failure]
            message.wait_for_room = wait_for_room
        return GrpcDecodeLeg(self.pool, node, message, timeout, self.metrics)

    def prefill(
        self,
        node: Node,
        leg_id: str,
        request: GenerationRequest,
        decode: Node | None,
        timeout: float | None,
    ) -> GrpcPrefillLeg:
        message = prefill_pb2.PrefillRequest(
            request_id=leg_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_params_to_proto(request.sampling),
            decode_target=decode.address if decode is not None else "",
        )
        # Under recompute a hung prefill node is left to the reservation's lease: the decode node
        # then computes the prompt itself, where a retry might find no other prefill node. A
        # prefill node serving alone has no lease and no decode node to take over.
        ends = decode is None or self.config.on_kv_failure == KvFailurePolicy.FAIL
        return GrpcPrefillLeg(self.pool, node, message, timeout, ends_when_unresponsive=ends)


class GrpcDecodeLeg(DecodeLeg):
    """A decode ``Generate`` stream as gateway events. A failure is retryable until the caller
    sets ``streamed`` (a token reached the client), and ends the request after."""

    def __init__(
        self,
        pool: NodePool,
        node: Node,
        message: decode_pb2.GenerateRequest,
        timeout: float | None,
        metrics: GatewayMetrics,
    ) -> None:
        self.pool = pool
        self.node = node
        self.message = message
        self.timeout = timeout
        self.metrics = metrics
        self.streamed = False
        self._stream: (
            grpc.aio.UnaryStreamCall[decode_pb2.GenerateRequest, decode_pb2.GenerateResponse] | None
        ) = None
        self._counted = False
        self._ended: str | None = None
        """Why the node's poll ended this leg (it stopped answering), else None."""

    async def __aenter__(self) -> GrpcDecodeLeg:
        self.node.add_leg(self._end)
        self._counted = True
        client = self.pool.client(self.node)
        self._stream = client.decode.Generate(self.message, timeout=self.timeout)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._stream is not None:
            self._stream.cancel()
        if self._counted:
            self._counted = False
            self.node.remove_leg(self._end)

    def _end(self, reason: str) -> None:
        """The node stopped answering: cancels the stream; its reader fails with ``reason``."""
        self._ended = reason
        if self._stream is not None:
            self._stream.cancel()

    def _unresponsive(self) -> Exception:
        assert self._ended is not None
        if not self.streamed:
            return RetryableFailure("decode_unresponsive", self.node, self._ended)
        return StreamEnded(FinishReason.ERROR, f"decode node {self.node.address}: {self._ended}")

    async def _read(self) -> decode_pb2.GenerateResponse | None:
        assert self._stream is not None, "read before the leg was entered"
        if self._ended is not None:
            raise self._unresponsive()
        try:
            event = await self._stream.read()
        except asyncio.CancelledError:
            if self._ended is None or _is_cancelling():
                raise
            raise self._unresponsive() from None
        except grpc.aio.AioRpcError as exc:
            if not self.streamed:
                raise rpc_failure(exc, self.node, "decode") from None
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise StreamEnded(FinishReason.ABORT, "the request deadline passed") from None
            raise StreamEnded(
                FinishReason.ERROR, f"decode node {self.node.address}: {exc.details()}"
            ) from None
        if event is grpc.aio.EOF:
            if self._ended is not None:
                raise self._unresponsive()
            return None
        # The stubs type read() as `object | response` (EOF has no type of its own there).
        return cast(decode_pb2.GenerateResponse, event)

    async def reservation(self) -> object:
        first = await self._read()
        if first is None or first.WhichOneof("event") != "reservation":
            raise RetryableFailure(
                "decode_protocol", self.node, "the decode stream did not begin with a reservation"
            )
        return first.reservation

    async def next(self) -> DecodeEvent:
        while True:
            event = await self._read()
            if event is None:
                if not self.streamed:
                    raise RetryableFailure(
                        "decode_protocol", self.node, "the decode stream ended early"
                    )
                raise StreamEnded(FinishReason.ERROR, "the decode stream ended without Finished")
            kind = event.WhichOneof("event")
            if kind == "tokens":
                logprobs = tuple(token_logprob_from_proto(lp) for lp in event.tokens.logprobs)
                # Present when this node computed the prompt (colocated, local prefill).
                prompt = tuple(token_logprob_from_proto(lp) for lp in event.tokens.prompt_logprobs)
                return TokenChunk(tuple(event.tokens.token_ids), logprobs or None, prompt or None)
            if kind == "finished":
                return _finished_from_proto(event.finished, self.node)
            if kind == "recomputing":
                logger.warning("decode node %s recomputes the prompt itself", self.node.address)
                self.metrics.retries.labels(cause="kv_recompute").inc()
                return Recomputing()
            # Anything else (a second reservation, a newer event kind): skip it.


class GrpcPrefillLeg(PrefillLeg):
    def __init__(
        self,
        pool: NodePool,
        node: Node,
        message: prefill_pb2.PrefillRequest,
        timeout: float | None,
        ends_when_unresponsive: bool = True,
    ) -> None:
        """``ends_when_unresponsive``: the call fails (retryable) once the node stops answering
        its health polls; else it waits for its deadline or the decode node's lease."""
        self.pool = pool
        self.node = node
        self.message = message
        self.timeout = timeout
        self.ends_when_unresponsive = ends_when_unresponsive
        self._call: (
            grpc.aio.UnaryUnaryCall[prefill_pb2.PrefillRequest, prefill_pb2.PrefillResult] | None
        ) = None
        self._counted = False
        self._ended: str | None = None
        """Why the node's poll ended this leg (it stopped answering), else None."""

    async def __aenter__(self) -> GrpcPrefillLeg:
        self.node.add_leg(self._end)
        self._counted = True
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._call is not None and not self._call.done():
            self._call.cancel()  # the prefill node aborts the request and frees its blocks
        self._release()

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self.node.remove_leg(self._end)

    def _end(self, reason: str) -> None:
        """The node stopped answering: cancels the call; ``reply`` fails with ``reason``."""
        if not self.ends_when_unresponsive:
            return
        self._ended = reason
        if self._call is not None:
            self._call.cancel()

    async def reply(self, reservation: object | None) -> PrefillReply:
        assert reservation is None or isinstance(reservation, kv_pb2.KvReservation)
        if self._ended is not None:  # while the decode node was reserving
            raise RetryableFailure("prefill_unresponsive", self.node, self._ended)
        message = prefill_pb2.PrefillRequest()
        message.CopyFrom(self.message)
        if reservation is not None:
            message.destination.CopyFrom(reservation)
        client = self.pool.client(self.node)
        self._call = client.prefill.Prefill(message, timeout=self.timeout)
        try:
            result = await self._call
        except grpc.aio.AioRpcError as exc:
            raise rpc_failure(exc, self.node, "prefill") from None
        except asyncio.CancelledError:
            self._call.cancel()
            if self._ended is None or _is_cancelling():
                raise
            raise RetryableFailure("prefill_unresponsive", self.node, self._ended) from None
        self._release()
        return PrefillReply(
            first=TokenChunk(
                (result.first_token_id,),
                (token_logprob_from_proto(result.first_logprobs),)
                if result.HasField("first_logprobs")
                else None,
                tuple(token_logprob_from_proto(lp) for lp in result.prompt_logprobs) or None,
            ),
            cached_prompt_tokens=result.cached_prompt_tokens,
            timings=_timings(result.timings, self.node),
            # Unset (0) unless the first token ends the request.
            finish_reason=finish_reason_from_proto(result.finish_reason),
        )


def _is_cancelling() -> bool:
    """Whether the running task itself is being cancelled (not merely a call it awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def rpc_failure(exc: grpc.aio.AioRpcError, node: Node, leg: str) -> Exception:
    """Maps a node's refusal before any token to a retry or to the client's error."""
    code = exc.code()
    details = exc.details() or code.name
    if code in _CALLER_ERRORS:
        return GatewayError(
            ErrorKind.INVALID_ARGUMENT, details, refused_param(exc.trailing_metadata())
        )
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(ErrorKind.DEADLINE_EXCEEDED, f"{leg} node {node.address}: {details}")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RetryableFailure(f"{leg}_full", node, details)
    if code is grpc.StatusCode.UNAVAILABLE:
        node.mark_failed(details)
        return RetryableFailure(f"{leg}_unavailable", node, details)
    return RetryableFailure(f"{leg}_{code.name.lower()}", node, details)


def _timings(message: common_pb2.StageTimings, node: Node) -> StageTimings:
    """A node's stage durations; ones that are negative or not finite (a node's bug) are
    logged and dropped: they are observability, and the request's tokens stand."""
    try:
        return stage_timings_from_proto(message)
    except ValueError as exc:
        logger.warning("node %s sent bad stage timings, dropped: %s", node.address, exc)
        return StageTimings()


def _finished_from_proto(message: decode_pb2.Finished, node: Node) -> Finished:
    return Finished(
        # A reason this gateway does not know (a newer node) reads as an error, never a success.
        finish_reason=finish_reason_from_proto(message.finish_reason) or FinishReason.ERROR,
        usage=usage_from_proto(message.usage),
        timings=_timings(message.timings, node),
        error=message.error or None,
        invalid_request=message.invalid_request,
    )
