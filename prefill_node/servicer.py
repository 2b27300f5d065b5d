"""PrefillService over an ``AsyncEngine`` and a KV transport.

One Prefill call (design §2): validate → check the destination's layout fingerprint (refused
with FAILED_PRECONDITION before any byte moves) → compute the prompt with ``hold_kv`` (chunked,
prefix-cached) → push its pages into the decode node's reserved blocks → commit to the decode
node → release the blocks → return the first token and timings.

Cancellation at any point cancels the push; the blocks are released only once the writer's
handle is terminal (nothing of ours still reads them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

import grpc

from kv_transfer import KvTransport, PeerAddress, TransferHandle
from pdserve.v1 import common_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2, prefill_pb2_grpc
from services.async_engine import AsyncEngine, EngineDeadError
from services.convert import (
    finish_reason_to_proto,
    logprobs_to_proto,
    prompt_from_proto,
    sampling_params_from_proto,
    stage_timings_to_proto,
)
from services.engine import EngineCoreOutput, SamplingParams
from services.engine.kv_layout import KvLayout, layer_copies
from services.kv_regions import to_page_copies
from services.metrics import NodeMetrics
from services.node_config import NodeConfig
from services.node_runtime import NodeServerRef, load_report
from services.stage_timings import StageTimings
from services.tls import aio_channel

logger = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 30.0


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(
        self,
        config: NodeConfig,
        engine: AsyncEngine,
        server: NodeServerRef,
        transport: KvTransport,
        metrics: NodeMetrics,
    ) -> None:
        self.metrics = metrics
        self.config = config
        self.engine = engine
        self.server = server
        self.transport = transport
        self.layout: KvLayout = engine.engine.kv_layout
        self._decode_channels: dict[str, grpc.aio.Channel] = {}

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        async with self.server.get().admit(context):
            try:
                params = sampling_params_from_proto(request.sampling)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            prompt = prompt_from_proto(request.prompt_token_ids)
            destination = request.destination if request.HasField("destination") else None
            peer = None
            if destination is not None:
                peer = await self._check_destination(request, prompt, context)
            request_id = request.request_id or f"pre-{uuid.uuid4().hex}"
            started = time.monotonic()
            # Only the first token is sampled here; the decode node samples the rest. min_tokens
            # stays at most 1, so EOS is still suppressed for a request that asked for it.
            first_params = dataclasses.replace(
                params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
            )
            first = await self._first_token(
                request_id, prompt, first_params, hold_kv=destination is not None, context=context
            )
            first_token_at = time.monotonic()
            self.metrics.time_to_first_token.observe(first_token_at - started)
            scheduled_at = first.first_scheduled_time or started
            timings = StageTimings(
                prefill_queue_s=max(scheduled_at - started, 0.0),
                prefill_compute_s=first_token_at - scheduled_at,
            )
            try:
                pushed = 0
                if destination is not None:
                    pushed, push_s = await self._push(request_id, destination, peer, context)
                    timings = dataclasses.replace(timings, kv_transfer_s=push_s)
                    await self._commit(request, destination, first, timings, context)
            finally:
                await self._release(request_id)
            result = prefill_pb2.PrefillResult(
                first_token_id=first.new_token_ids[0],
                cached_prompt_tokens=first.num_cached_tokens,
                kv_bytes_pushed=pushed,
                timings=stage_timings_to_proto(timings),
            )
            if first.new_logprobs:
                result.first_logprobs.CopyFrom(
                    logprobs_to_proto(first.new_token_ids[0], first.new_logprobs[0])
                )
            # The first token may already end the request (EOS, max_tokens=1).
            if first.finish_reason is not None and _stops_for_good(first, params.max_tokens):
                result.finish_reason = finish_reason_to_proto(first.finish_reason)
            return result

    async def GetLoad(self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        return await load_report(self.config, self.engine, self.server, context)

    async def _check_destination(
        self,
        request: prefill_pb2.PrefillRequest,
        prompt: list[int],
        context: grpc.aio.ServicerContext,
    ) -> PeerAddress:
        """Everything about the destination is checked before any compute or byte moves."""
        destination = request.destination

        async def invalid(message: str) -> None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

        if not destination.transfer_id:
            await invalid("destination.transfer_id is empty")
        if not request.decode_target:
            await invalid("decode_target is empty: the commit needs the decode node's address")
        try:
            peer = PeerAddress.from_bytes(destination.address.worker_address)
        except (ValueError, KeyError, TypeError) as exc:
            await invalid(f"destination.address.worker_address is not a KV address: {exc}")
        if prompt:
            num_blocks = -(-len(prompt) // self.layout.block_size)
            if len(destination.block_ids) != num_blocks:
                await invalid(
                    f"destination.block_ids has {len(destination.block_ids)} blocks for a prompt "
                    f"of {len(prompt)} tokens (block size {self.layout.block_size})"
                )
            if max(destination.block_ids) >= destination.num_blocks_total:
                await invalid(
                    f"destination.block_ids reach {max(destination.block_ids)}, outside "
                    f"num_blocks_total={destination.num_blocks_total}"
                )
        if destination.layout_fingerprint != self.layout.fingerprint:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"destination.layout_fingerprint {destination.layout_fingerprint!r} does not "
                f"match this node's {self.layout.fingerprint!r} (model, dtype, block size or "
                "KV shape differ)",
            )
        if destination.address.transport != self.transport.name:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"destination.address.transport is {destination.address.transport!r}, this "
                f"node pushes with {self.transport.name!r}",
            )
        return peer

    async def _first_token(
        self,
        request_id: str,
        prompt: list[int],
        first_params: SamplingParams,
        *,
        hold_kv: bool,
        context: grpc.aio.ServicerContext,
    ) -> EngineCoreOutput:
        try:
            outputs = [
                out
                async for out in self.engine.generate(
                    request_id, prompt, first_params, hold_kv=hold_kv
                )
            ]
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return outputs[-1]

    async def _push(
        self,
        request_id: str,
        destination: kv_pb2.KvReservation,
        peer: PeerAddress,
        context: grpc.aio.ServicerContext,
    ) -> tuple[int, float]:
        dst_layout = dataclasses.replace(self.layout, num_blocks=destination.num_blocks_total)
        src_blocks = await self.engine.call(lambda engine: engine.kv_block_ids(request_id))
        copies = layer_copies(self.layout, src_blocks, dst_layout, list(destination.block_ids))
        pages = to_page_copies(copies)
        started = time.monotonic()
        try:
            await asyncio.to_thread(self.transport.connect, peer)
            handle: TransferHandle = self.transport.write(
                peer,
                pages,
                transfer_id=destination.transfer_id,
                deadline=time.monotonic() + PUSH_TIMEOUT_S,
            )
        except (ConnectionError, ValueError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push failed to start: {exc}")
        try:
            status = await handle.wait_async(PUSH_TIMEOUT_S)
        except asyncio.CancelledError:
            handle.cancel()
            await asyncio.shield(handle.wait_async(PUSH_TIMEOUT_S))
            raise
        if not status.is_terminal:
            # Past our own wait: stop the writer and let it finish before the blocks it reads
            # are released.
            handle.cancel()
            status = await handle.wait_async(PUSH_TIMEOUT_S)
        if status.value != "done":
            self.metrics.transfer_failed(status.value)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"KV push of transfer {destination.transfer_id} ended {status.value}: "
                f"{handle.error}",
            )
        seconds = time.monotonic() - started
        self.metrics.kv_transfer_seconds.observe(seconds)
        self.metrics.kv_transfer_bytes.observe(handle.bytes_moved)
        return handle.bytes_moved, seconds

    async def _commit(
        self,
        request: prefill_pb2.PrefillRequest,
        destination: kv_pb2.KvReservation,
        first: EngineCoreOutput,
        timings: StageTimings,
        context: grpc.aio.ServicerContext,
    ) -> None:
        channel = self._decode_channels.get(request.decode_target)
        if channel is None:
            channel = aio_channel(request.decode_target, self.config.tls)
            self._decode_channels[request.decode_target] = channel
        commit = kv_pb2.KvCommit(
            transfer_id=destination.transfer_id,
            first_token_id=first.new_token_ids[0],
            cached_prompt_tokens=first.num_cached_tokens,
            timings=stage_timings_to_proto(timings),
        )
        if first.new_logprobs:
            commit.first_logprobs.CopyFrom(
                logprobs_to_proto(first.new_token_ids[0], first.new_logprobs[0])
            )
        try:
            await decode_pb2_grpc.DecodeServiceStub(channel).CommitKv(commit, timeout=10)
        except grpc.aio.AioRpcError as exc:
            await context.abort(
                exc.code() if exc.code() != grpc.StatusCode.OK else grpc.StatusCode.UNKNOWN,
                f"commit to {request.decode_target} failed: {exc.details()}",
            )

    async def _release(self, request_id: str) -> None:
        with contextlib.suppress(EngineDeadError):
            await self.engine.call(lambda engine: engine.release_kv(request_id))


def _stops_for_good(first: EngineCoreOutput, max_tokens: int) -> bool:
    """The prefill ran with max_tokens=1, so 'length' only ends the request if it asked for 1."""
    return first.finish_reason.value != "length" or max_tokens == 1
