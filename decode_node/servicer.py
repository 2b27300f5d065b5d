"""DecodeService over an ``AsyncEngine``: protobuf in, engine dataclasses inside, protobuf out.

Two kinds of Generate:

- ``kv_source`` empty (the colocated role): the node computes the prompt itself and streams
  every token.
- ``kv_source`` set (the decode role): reserve blocks through the ``TransferManager`` (or refuse
  with RESOURCE_EXHAUSTED, or wait for room when asked to), send the ``KvReservation`` first,
  stream tokens 2..N once the prefill node's ``CommitKv`` arrived; its ``RenewKv`` keeps the
  reservation's liveness lease alive meanwhile (design §3a). If the transfer fails before the
  commit (lease expired, push failed, bad commit), the blocks are fenced and freed, then: under
  the FAIL policy the stream ends with ABORTED, so the gateway can retry elsewhere; under
  RECOMPUTE the node sends ``Recomputing`` and computes the prompt itself as a normal request,
  streaming tokens 1..N (counted in ``pdserve:kv_recomputes_total``: a fall-back is never
  silent). The caller's own abort (stream closed, Abort) is never recomputed. Closing the
  stream aborts the transfer, which frees the blocks once the transport is fenced.

``Finished`` carries usage (the prefill node's prefix-cache hits when it computed the prompt)
and per-stage timings (``services.decode_clock``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TypeAlias

import grpc
from google.protobuf import timestamp_pb2

from decode_node.transfers import (
    AbortCause,
    CommitRefused,
    RenewRefused,
    Transfer,
    TransferManager,
    TransferState,
)
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_pb2
from services.async_engine import AsyncEngine, EngineDeadError
from services.convert import (
    finish_reason_to_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    prompt_from_proto,
    prompt_logprobs_to_proto,
    refusal_metadata,
    sampling_params_from_proto,
    stage_timings_from_proto,
    stage_timings_to_proto,
)
from services.decode_clock import DecodeClock
from services.engine import EngineCoreOutput, FinishReason, SamplingParams
from services.node.config import NodeConfig
from services.node.metrics import NodeMetrics
from services.node.runtime import NodeServerRef
from services.node.shared_rpcs import SharedNodeRpcs
from services.types import StageTimings

logger = logging.getLogger(__name__)

# The stream ending in these states aborts the transfer (COMMITTING: once the engine has it).
_UNCOMMITTED = (TransferState.RESERVED, TransferState.RECEIVING, TransferState.COMMITTING)

DEFAULT_LEASE_MS = 10_000
MAX_LEASE_MS = 600_000

# A string: grpc.aio.ServicerContext is generic in its stubs only, not at run time.
_GenerateContext: TypeAlias = (
    "grpc.aio.ServicerContext[decode_pb2.GenerateRequest, decode_pb2.GenerateResponse]"
)


class DecodeServicer(SharedNodeRpcs, decode_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self,
        config: NodeConfig,
        engine: AsyncEngine,
        server: NodeServerRef,
        transfers: TransferManager | None,
        metrics: NodeMetrics,
    ) -> None:
        """``transfers`` is None on a colocated node, which computes every prompt itself."""
        self.metrics = metrics
        self.config = config
        self.engine = engine
        self.server = server
        self.transfers = transfers

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: _GenerateContext
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        async with self.server.get().admit(context):
            if request.kv_source and self.transfers is None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "kv_source: a colocated node computes prompts itself; send no kv_source",
                )
            try:
                params = sampling_params_from_proto(request.sampling)
            except ValueError as exc:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, str(exc), refusal_metadata(exc)
                )
            request_id = request.request_id or f"dec-{uuid.uuid4().hex}"
            prompt = prompt_from_proto(request.prompt_token_ids)
            if request.kv_source:
                events = self._generate_from_peer(request, request_id, prompt, params, context)
            else:
                events = self._generate_here(request_id, prompt, params, context)
            # aclosing: the inner generator's clean-up (abort, fence) runs as this one closes.
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event

    async def _generate_here(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        context: _GenerateContext,
    ) -> AsyncGenerator[decode_pb2.GenerateResponse, None]:
        """Compute the prompt on this node and stream every token (the colocated role, or a
        decode node recomputing after a failed handoff)."""
        clock = DecodeClock(started=time.monotonic(), from_peer=False)
        num_generated = 0
        last: EngineCoreOutput | None = None
        # aclosing: a stream closed at a yield aborts the request now, not when the suspended
        # engine stream is garbage-collected.
        outputs = self.engine.generate(request_id, prompt, params)
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    now = time.monotonic()
                    clock.observe(out, now)
                    if num_generated == 0 and out.new_token_ids:
                        self.metrics.time_to_first_token.observe(now - clock.started)
                    last = out
                    num_generated += len(out.new_token_ids)
                    if out.new_token_ids:
                        yield decode_pb2.GenerateResponse(tokens=_delta(out, prompt))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), refusal_metadata(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self.metrics.e2e_request_latency.observe(time.monotonic() - clock.started)
        assert last is not None
        if last.finish_reason is FinishReason.ERROR and num_generated == 0:
            # Its grammar failed on the first token, as on a prefill node: the request is at
            # fault and nothing went out, so it is refused as a whole.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, last.error or "request failed")
        yield self._finished(
            last, len(prompt), num_generated, last.num_cached_tokens, clock.timings()
        )

    async def _generate_from_peer(
        self,
        request: decode_pb2.GenerateRequest,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        context: _GenerateContext,
    ) -> AsyncGenerator[decode_pb2.GenerateResponse, None]:
        assert self.transfers is not None
        if request.lease_ms > MAX_LEASE_MS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_ms must be <= {MAX_LEASE_MS}, got {request.lease_ms}",
            )
        lease_s = (request.lease_ms or DEFAULT_LEASE_MS) / 1000
        try:
            transfer = await self.transfers.reserve(
                request_id, prompt, params, lease_s=lease_s, wait=request.wait_for_room
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), refusal_metadata(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if transfer is None:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no room for {len(prompt)} prompt tokens (KV blocks, max_num_seqs, or "
                f"{self.transfers.max_unstarted} reservations waiting for their prefill; "
                f"{self.transfers.num_waiting} waiting for room)",
            )
        try:
            try:
                stream = await self.engine.attach(request_id)
            except KeyError:
                # The lease ran out (or an Abort came) between the reservation and here.
                await context.abort(
                    grpc.StatusCode.ABORTED,
                    f"KV transfer {transfer.transfer_id} ended before it was announced: "
                    f"{transfer.abort_reason or 'aborted'}",
                )
            reservation = self._reservation(transfer, lease_s, params.lora_name)
            yield decode_pb2.GenerateResponse(reservation=reservation)
            num_generated = 1  # the first token came from the prefill node
            last: EngineCoreOutput | None = None
            clock = DecodeClock(started=0.0, from_peer=True)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    clock.observe(out, time.monotonic())
                    last = out
                    num_generated += len(out.new_token_ids)
                    if out.new_token_ids:
                        yield decode_pb2.GenerateResponse(tokens=_delta(out, prompt))
            if transfer.state is TransferState.FREED or transfer.state is TransferState.ABORTED:
                # Fenced and freed before its commit (the stream ends only after the fence).
                cause = transfer.abort_cause
                if (
                    request.on_kv_failure == decode_pb2.KV_FAILURE_POLICY_RECOMPUTE
                    and cause is not None
                    and cause.is_failure
                ):
                    logger.warning(
                        "request %s: KV transfer %s from %s failed before its commit (%s: %s); "
                        "recomputing the prompt on this node",
                        request_id,
                        transfer.transfer_id,
                        request.kv_source,
                        cause.value,
                        transfer.abort_reason,
                    )
                    self.metrics.kv_recomputed(cause.value)
                    yield decode_pb2.GenerateResponse(
                        recomputing=decode_pb2.Recomputing(reason=transfer.abort_reason)
                    )
                    events = self._generate_here(request_id, prompt, params, context)
                    async with contextlib.aclosing(events):
                        async for event in events:
                            yield event
                    return
                await context.abort(
                    grpc.StatusCode.ABORTED,
                    f"KV transfer {transfer.transfer_id} aborted before its commit: "
                    f"{transfer.abort_reason}",
                )
            assert last is not None
            # Never committed (the engine shut down first): no decode step ran to time.
            clock.started = transfer.committed_at or 0.0
            yield self._finished(
                last,
                len(prompt),
                num_generated,
                transfer.cached_prompt_tokens,
                clock.timings(transfer.prefill_timings),
            )
        finally:
            if transfer.state in _UNCOMMITTED:
                await self.transfers.abort(
                    transfer.transfer_id, "the Generate stream ended", AbortCause.CALLER
                )

    def _finished(
        self,
        last: EngineCoreOutput,
        num_prompt_tokens: int,
        num_generated: int,
        cached_prompt_tokens: int,
        timings: StageTimings,
    ) -> decode_pb2.GenerateResponse:
        assert last.finish_reason is not None
        self.metrics.request_finished(last.finish_reason.value)
        return decode_pb2.GenerateResponse(
            finished=decode_pb2.Finished(
                finish_reason=finish_reason_to_proto(last.finish_reason),
                usage=common_pb2.Usage(
                    prompt_tokens=num_prompt_tokens,
                    completion_tokens=num_generated,
                    cached_prompt_tokens=cached_prompt_tokens,
                ),
                timings=stage_timings_to_proto(timings),
                error=last.error or "",
                # The engine ends a request with an error only when its grammar failed.
                invalid_request=last.finish_reason is FinishReason.ERROR,
            )
        )

    def _reservation(
        self, transfer: Transfer, lease_s: float, lora_name: str | None
    ) -> kv_pb2.KvReservation:
        assert self.transfers is not None
        layout = self.engine.engine.kv_layout
        deadline = timestamp_pb2.Timestamp()
        deadline.FromNanoseconds(int((time.time() + lease_s) * 1e9))
        return kv_pb2.KvReservation(
            transfer_id=transfer.transfer_id,
            address=kv_pb2.KvAddress(
                transport=self.transfers.transport.name,
                worker_address=self.transfers.transport.address().to_bytes(),
            ),
            block_ids=transfer.block_ids,
            cached_blocks=transfer.num_cached_blocks,
            layout_fingerprint=layout.fingerprint,
            block_size=layout.block_size,
            num_blocks_total=layout.num_blocks,
            lease_deadline=deadline,
            # The snapshot the reserve call refreshed: it holds the adapter the request names.
            lora_fingerprint=self.engine.stats.lora_fingerprint(lora_name),
        )

    async def CommitKv(
        self,
        request: kv_pb2.KvCommit,
        context: grpc.aio.ServicerContext[kv_pb2.KvCommit, kv_pb2.KvCommitAck],
    ) -> kv_pb2.KvCommitAck:
        if self.transfers is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "a colocated node holds no KV reservations"
            )
        try:
            logprobs = (
                logprobs_from_proto(request.first_logprobs)
                if request.HasField("first_logprobs")
                else None
            )
        except ValueError:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "first_logprobs: top_token_ids and top_logprobs differ in length",
            )
        try:
            prefill_timings = (
                stage_timings_from_proto(request.timings) if request.HasField("timings") else None
            )
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), refusal_metadata(exc))
        try:
            await self.transfers.commit(
                request.transfer_id,
                request.first_token_id,
                logprobs,
                cached_prompt_tokens=request.cached_prompt_tokens,
                prefill_timings=prefill_timings,
            )
        except CommitRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return kv_pb2.KvCommitAck()

    async def RenewKv(
        self,
        request: kv_pb2.KvRenew,
        context: grpc.aio.ServicerContext[kv_pb2.KvRenew, kv_pb2.KvRenewAck],
    ) -> kv_pb2.KvRenewAck:
        if self.transfers is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "a colocated node holds no KV reservations"
            )
        try:
            transfer = self.transfers.renew(request.transfer_id, started=request.started)
        except RenewRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return kv_pb2.KvRenewAck(lease_ms=max(1, round(transfer.lease_s * 1000)))

    async def Abort(
        self,
        request: decode_pb2.AbortRequest,
        context: grpc.aio.ServicerContext[decode_pb2.AbortRequest, decode_pb2.AbortResponse],
    ) -> decode_pb2.AbortResponse:
        # A reserved request is aborted through its transfer, which fences before freeing;
        # anything else through AsyncEngine.abort, which also ends the request's open stream.
        try:
            if self.transfers is not None and await self.transfers.abort_request(
                request.request_id, "aborted by the caller", AbortCause.CALLER
            ):
                return decode_pb2.AbortResponse(found=True)
            found = await self.engine.abort(request.request_id)
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return decode_pb2.AbortResponse(found=found)


def _delta(out: EngineCoreOutput, prompt: Sequence[int]) -> decode_pb2.TokenDelta:
    delta = decode_pb2.TokenDelta(token_ids=out.new_token_ids)
    if out.prompt_logprobs is not None:  # the first token's, when this node computed the prompt
        assert out.prompt_logprob_ranks is not None
        delta.prompt_logprobs.extend(
            prompt_logprobs_to_proto(prompt, out.prompt_logprobs, out.prompt_logprob_ranks)
        )
    if out.new_logprobs is not None:
        for token_id, logprobs in zip(out.new_token_ids, out.new_logprobs, strict=True):
            delta.logprobs.append(logprobs_to_proto(token_id, logprobs))
    return delta
