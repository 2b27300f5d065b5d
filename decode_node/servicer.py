"""DecodeService over an ``AsyncEngine``: protobuf in, engine dataclasses inside, protobuf out.

Two kinds of Generate:

- ``kv_source`` empty (the colocated role): the node computes the prompt itself and streams
  every token.
- ``kv_source`` set (the decode role): reserve blocks through the ``TransferManager`` (or refuse
  with RESOURCE_EXHAUSTED), send the ``KvReservation`` first, stream tokens 2..N once the prefill
  node's ``CommitKv`` arrived. If the transfer is aborted before the commit (lease expired, bad
  commit) the stream ends with ABORTED, so the gateway can retry elsewhere; closing the stream
  aborts the transfer, which frees the blocks once the transport is fenced.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc
from google.protobuf import timestamp_pb2

from decode_node.transfers import CommitRefused, Transfer, TransferManager, TransferState
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_pb2
from services.async_engine import AsyncEngine, EngineDeadError
from services.convert import (
    finish_reason_to_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    prompt_from_proto,
    sampling_params_from_proto,
)
from services.engine import EngineCoreOutput, SamplingParams
from services.metrics import NodeMetrics
from services.node_config import NodeConfig
from services.node_runtime import NodeServerRef, load_report

logger = logging.getLogger(__name__)

DEFAULT_LEASE_MS = 10_000
MAX_LEASE_MS = 600_000


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
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
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        async with self.server.get().admit(context):
            if request.kv_source and self.transfers is None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "kv_source: a colocated node computes prompts itself; send no kv_source",
                )
            try:
                params = sampling_params_from_proto(request.sampling)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            request_id = request.request_id or f"dec-{uuid.uuid4().hex}"
            prompt = prompt_from_proto(request.prompt_token_ids)
            if request.kv_source:
                async for event in self._generate_from_peer(
                    request, request_id, prompt, params, context
                ):
                    yield event
                return
            num_generated = 0
            last: EngineCoreOutput | None = None
            arrival = time.monotonic()
            try:
                async for out in self.engine.generate(request_id, prompt, params):
                    if num_generated == 0 and out.new_token_ids:
                        self.metrics.time_to_first_token.observe(time.monotonic() - arrival)
                    last = out
                    num_generated += len(out.new_token_ids)
                    if out.new_token_ids:
                        yield decode_pb2.GenerateResponse(tokens=_delta(out))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except EngineDeadError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            self.metrics.e2e_request_latency.observe(time.monotonic() - arrival)
            yield self._finished(last, len(prompt), num_generated, last.num_cached_tokens)

    async def _generate_from_peer(
        self,
        request: decode_pb2.GenerateRequest,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        context: grpc.aio.ServicerContext,
    ):
        assert self.transfers is not None
        if request.lease_ms > MAX_LEASE_MS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_ms must be <= {MAX_LEASE_MS}, got {request.lease_ms}",
            )
        lease_s = (request.lease_ms or DEFAULT_LEASE_MS) / 1000
        try:
            transfer = await self.transfers.reserve(request_id, prompt, params, lease_s=lease_s)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if transfer is None:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no room for {len(prompt)} prompt tokens (KV blocks or max_num_seqs)",
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
            yield decode_pb2.GenerateResponse(reservation=self._reservation(transfer, lease_s))
            num_generated = 1  # the first token came from the prefill node
            last: EngineCoreOutput | None = None
            async for out in stream:
                last = out
                num_generated += len(out.new_token_ids)
                if out.new_token_ids:
                    yield decode_pb2.GenerateResponse(tokens=_delta(out))
            if transfer.state is TransferState.FREED or transfer.state is TransferState.ABORTED:
                await context.abort(
                    grpc.StatusCode.ABORTED,
                    f"KV transfer {transfer.transfer_id} aborted before its commit: "
                    f"{transfer.abort_reason}",
                )
            yield self._finished(last, len(prompt), num_generated, cached_prompt_tokens=0)
        finally:
            if transfer.state in (TransferState.RESERVED, TransferState.RECEIVING):
                await self.transfers.abort(transfer.transfer_id, "the Generate stream ended")

    def _finished(
        self,
        last: EngineCoreOutput | None,
        num_prompt_tokens: int,
        num_generated: int,
        cached_prompt_tokens: int,
    ) -> decode_pb2.GenerateResponse:
        assert last is not None and last.finish_reason is not None
        self.metrics.request_finished(last.finish_reason.value)
        return decode_pb2.GenerateResponse(
            finished=decode_pb2.Finished(
                finish_reason=finish_reason_to_proto(last.finish_reason),
                usage=common_pb2.Usage(
                    prompt_tokens=num_prompt_tokens,
                    completion_tokens=num_generated,
                    cached_prompt_tokens=cached_prompt_tokens,
                ),
            )
        )

    def _reservation(self, transfer: Transfer, lease_s: float) -> kv_pb2.KvReservation:
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
            layout_fingerprint=layout.fingerprint,
            block_size=layout.block_size,
            num_blocks_total=layout.num_blocks,
            lease_deadline=deadline,
        )

    async def CommitKv(self, request: kv_pb2.KvCommit, context: grpc.aio.ServicerContext):
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
            await self.transfers.commit(request.transfer_id, request.first_token_id, logprobs)
        except CommitRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return kv_pb2.KvCommitAck()

    async def Abort(self, request: decode_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        # A reserved request is aborted through its transfer, which fences before freeing;
        # anything else through AsyncEngine.abort, which also ends the request's open stream.
        try:
            if self.transfers is not None and await self.transfers.abort_request(
                request.request_id, "aborted by the caller"
            ):
                return decode_pb2.AbortResponse(found=True)
            found = await self.engine.abort(request.request_id)
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return decode_pb2.AbortResponse(found=found)

    async def GetLoad(self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        return await load_report(self.config, self.engine, self.server, context)


def _delta(out: EngineCoreOutput) -> decode_pb2.TokenDelta:
    delta = decode_pb2.TokenDelta(token_ids=out.new_token_ids)
    if out.new_logprobs is not None:
        for token_id, logprobs in zip(out.new_token_ids, out.new_logprobs, strict=True):
            delta.logprobs.append(logprobs_to_proto(token_id, logprobs))
    return delta
