"""PrefillService over an ``AsyncEngine`` and a KV transport.

One Prefill call (design §2): validate → check the destination's layout fingerprint and its
LoRA adapter's (refused with FAILED_PRECONDITION before any byte moves) → compute the prompt
with ``hold_kv`` (chunked, prefix-cached) → push its pages into the decode node's reserved
blocks → commit to the decode node → release the blocks → return the first token and timings.

From the check until the push begins a keep-alive task renews the decode reservation's liveness
lease (``RenewKv``, every third of the lease), saying ``started`` once the engine began the
prompt, and once more as the push begins: a request queued here behind others keeps its
reservation; a node that dies or stops, or a push that stalls, lets it expire (design §3a). A
renew the decode node refuses before the push (the transfer ended there) stops the work.

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
from collections.abc import Callable
from typing import TypeAlias

import grpc

from kv_transfer import KvTransport, PeerAddress, TransferHandle, TransferStatus
from pdserve.v1 import decode_pb2_grpc, kv_pb2, prefill_pb2, prefill_pb2_grpc
from services.async_engine import AsyncEngine, EngineDeadError
from services.convert import (
    finish_reason_to_proto,
    logprobs_to_proto,
    prompt_from_proto,
    prompt_logprobs_to_proto,
    refusal_metadata,
    sampling_params_from_proto,
    stage_timings_to_proto,
)
from services.engine import EngineCoreOutput, FinishReason, SamplingParams
from services.engine.kv_layout import KvLayout
from services.node.config import NodeConfig
from services.node.kv_regions import kv_page_table
from services.node.metrics import NodeMetrics
from services.node.runtime import NodeServerRef
from services.node.shared_rpcs import SharedNodeRpcs
from services.tls import aio_channel
from services.types import StageTimings

logger = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 30.0
"""The push's wait, plus one second per ``PUSH_MIN_BYTES_PER_S`` it moves: a longer prompt
gets a longer wait, never a fixed one it can outgrow."""
PUSH_MIN_BYTES_PER_S = 16 * 2**20
FIRST_RENEW_INTERVAL_S = 1.0
"""Until the decode node's first ack says how long its lease is."""

# A string: grpc.aio.ServicerContext is generic in its stubs only, not at run time.
_PrefillContext: TypeAlias = (
    "grpc.aio.ServicerContext[prefill_pb2.PrefillRequest, prefill_pb2.PrefillResult]"
)


class PrefillServicer(SharedNodeRpcs, prefill_pb2_grpc.PrefillServiceServicer):
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
        self._releases: set[asyncio.Future[None]] = set()  # held until done (no GC mid-way)

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: _PrefillContext
    ) -> prefill_pb2.PrefillResult:
        async with self.server.get().admit(context):
            try:
                params = sampling_params_from_proto(request.sampling)
            except ValueError as exc:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, str(exc), refusal_metadata(exc)
                )
            prompt = prompt_from_proto(request.prompt_token_ids)
            destination = request.destination if request.HasField("destination") else None
            peer = None
            if destination is not None:
                peer = await self._check_destination(request, prompt, params.lora_name, context)
            request_id = request.request_id or f"pre-{uuid.uuid4().hex}"
            started = time.monotonic()
            # Only the first token is sampled here; the decode node samples the rest. min_tokens
            # stays at most 1, so EOS is still suppressed for a request that asked for it.
            first_params = dataclasses.replace(
                params, max_tokens=1, min_tokens=min(params.min_tokens, 1)
            )
            started_computing, pushing = asyncio.Event(), asyncio.Event()
            keep_alive: asyncio.Task[None] | None = None
            ended_on_decode: list[str] = []  # why the decode node ended the transfer, if it did
            owner = asyncio.current_task()
            assert owner is not None

            def stop(reason: str) -> None:
                ended_on_decode.append(reason)
                owner.cancel()

            if destination is not None:
                keep_alive = asyncio.ensure_future(
                    self._keep_alive(request, started_computing, pushing, stop)
                )
            try:
                first = await self._first_token(
                    request_id,
                    prompt,
                    first_params,
                    hold_kv=destination is not None,
                    context=context,
                    on_started=started_computing.set,
                )
                result = await self._hand_over(
                    request, request_id, params, destination, peer, first, started, pushing,
                    context,
                )  # fmt: skip
            except asyncio.CancelledError:
                if not ended_on_decode:
                    raise  # the caller left: gRPC has ended the call already
                # Stopped from within: a cancelled handler would send no status, and the caller
                # would wait on this call until its deadline (forever without one). ABORTED is
                # retryable: the gateway tries again with a fresh reservation.
                owner.uncancel()
                await context.abort(
                    grpc.StatusCode.ABORTED,
                    f"the decode node ended transfer {request.destination.transfer_id} before "
                    f"its push: {ended_on_decode[0]}",
                )
            finally:
                if keep_alive is not None:
                    keep_alive.cancel()
                    await asyncio.gather(keep_alive, return_exceptions=True)
            return result

    async def _hand_over(
        self,
        request: prefill_pb2.PrefillRequest,
        request_id: str,
        params: SamplingParams,
        destination: kv_pb2.KvReservation | None,
        peer: PeerAddress | None,
        first: EngineCoreOutput,
        started: float,
        pushing: asyncio.Event,
        context: _PrefillContext,
    ) -> prefill_pb2.PrefillResult:
        """Push and commit (with a destination), release the held blocks, and the result."""
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
                assert peer is not None  # checked with the destination
                pushing.set()  # one last renew: the push and commit must fit in one lease
                pushed, push_s = await self._push(request_id, destination, peer, context)
                timings = dataclasses.replace(timings, kv_transfer_s=push_s)
                await self._commit(request, destination, first, timings, context)
        except BaseException:
            await self._release(request_id)
            raise
        # The reply (the client's first token) goes out now: the release waits for the engine's
        # next step boundary, a whole prefill chunk on a busy node, which the token need not.
        release = asyncio.ensure_future(self._release(request_id))
        self._releases.add(release)
        release.add_done_callback(self._releases.discard)
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
        if first.prompt_logprobs is not None:
            assert first.prompt_logprob_ranks is not None
            result.prompt_logprobs.extend(
                prompt_logprobs_to_proto(
                    request.prompt_token_ids, first.prompt_logprobs, first.prompt_logprob_ranks
                )
            )
        # The first token may already end the request (EOS, max_tokens=1).
        if first.finish_reason is not None and _stops_for_good(first, params.max_tokens):
            result.finish_reason = finish_reason_to_proto(first.finish_reason)
        return result

    def _decode_stub(self, target: str) -> decode_pb2_grpc.DecodeServiceStub:
        channel = self._decode_channels.get(target)
        if channel is None:
            channel = aio_channel(target, self.config.tls)
            self._decode_channels[target] = channel
        return decode_pb2_grpc.DecodeServiceStub(channel)

    async def _keep_alive(
        self,
        request: prefill_pb2.PrefillRequest,
        started_computing: asyncio.Event,
        pushing: asyncio.Event,
        stop: Callable[[str], None],
    ) -> None:
        """Renew the reservation's lease while the request queues and computes here, once more
        as its push begins, then stop: a push that stalls is caught by the lease as before.
        ``stop(reason)`` stops the request's work when the decode node ended the transfer
        before its push began."""
        stub = self._decode_stub(request.decode_target)
        transfer_id = request.destination.transfer_id
        interval = FIRST_RENEW_INTERVAL_S
        while True:
            is_last = pushing.is_set()
            started = started_computing.is_set() or is_last
            try:
                ack = await stub.RenewKv(
                    kv_pb2.KvRenew(transfer_id=transfer_id, started=started), timeout=interval
                )
                interval = max(ack.lease_ms / 3000, 0.01)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                    if pushing.is_set():
                        # The push (or the commit) now answers for the transfer. A renew sent
                        # before the push began can be answered after the commit ended the
                        # transfer: on a GPU, prefill, push and commit of a short prompt take
                        # less than one renew's round trip.
                        return
                    # The decode node ended the transfer (its caller left, or the lease passed):
                    # nobody will take these pages, so stop computing them.
                    logger.info(
                        "transfer %s ended on %s (%s): stopping its prefill",
                        transfer_id,
                        request.decode_target,
                        exc.details(),
                    )
                    stop(exc.details() or "transfer ended")
                    return
                # Unreachable for a moment: try again within the lease.
                logger.warning("renewing transfer %s failed: %s", transfer_id, exc.details())
            if is_last:
                return
            # The renew that says "started", and the last one, go out at once.
            events = [pushing] if started else [started_computing, pushing]
            waiters = [asyncio.ensure_future(event.wait()) for event in events]
            try:
                await asyncio.wait(waiters, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()

    async def _check_destination(
        self,
        request: prefill_pb2.PrefillRequest,
        prompt: list[int],
        lora_name: str | None,
        context: _PrefillContext,
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
            if destination.cached_blocks >= num_blocks:
                await invalid(
                    f"destination.cached_blocks={destination.cached_blocks} leaves none of the "
                    f"{num_blocks} blocks to push (it must be below len(block_ids))"
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
        own = self.engine.stats.lora_fingerprint(lora_name)
        if lora_name is not None and own and destination.lora_fingerprint != own:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"destination.lora_fingerprint {destination.lora_fingerprint!r} does not match "
                f"this node's {own!r}: the decode node loaded other files as LoRA adapter "
                f"{lora_name!r}",
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
        context: _PrefillContext,
        on_started: Callable[[], None] | None = None,
    ) -> EngineCoreOutput:
        try:
            outputs = [
                out
                async for out in self.engine.generate(
                    request_id, prompt, first_params, hold_kv=hold_kv, on_started=on_started
                )
            ]
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), refusal_metadata(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        first = outputs[-1]
        if first.finish_reason is FinishReason.ERROR:
            # Its grammar failed on the first token (llguidance gave up on it): the request is
            # at fault, no token went anywhere, and its blocks are already free.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, first.error or "request failed")
        return first

    async def _push(
        self,
        request_id: str,
        destination: kv_pb2.KvReservation,
        peer: PeerAddress,
        context: _PrefillContext,
    ) -> tuple[int, float]:
        dst_layout = dataclasses.replace(self.layout, num_blocks=destination.num_blocks_total)
        src_blocks = await self.engine.call(lambda engine: engine.kv_block_ids(request_id))
        # The decode node's first cached_blocks hold this prefix already (its prefix cache,
        # shared with its running requests): they are neither pushed nor written.
        skip = destination.cached_blocks
        pages = kv_page_table(
            self.layout, src_blocks[skip:], dst_layout, list(destination.block_ids)[skip:]
        )
        started = time.monotonic()
        num_bytes = int(pages.table[:, 4].sum())
        push_timeout_s = PUSH_TIMEOUT_S + num_bytes / PUSH_MIN_BYTES_PER_S
        try:
            await asyncio.to_thread(self.transport.connect, peer)
            handle: TransferHandle = self.transport.write(
                peer,
                pages,
                transfer_id=destination.transfer_id,
                deadline=time.monotonic() + push_timeout_s,
            )
        except (ConnectionError, ValueError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push failed to start: {exc}")
        try:
            status = await handle.wait_async(push_timeout_s)
        except asyncio.CancelledError:
            handle.cancel()
            await asyncio.shield(handle.wait_async(push_timeout_s))
            raise
        if not status.is_terminal:
            # Past our own wait: stop the writer and let it finish before the blocks it reads
            # are released.
            handle.cancel()
            status = await handle.wait_async(push_timeout_s)
        if status is not TransferStatus.DONE:
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
        context: _PrefillContext,
    ) -> None:
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
            # The request's own deadline: the commit waits for the decode engine's step
            # boundary, which no fixed constant bounds on every host.
            await self._decode_stub(request.decode_target).CommitKv(
                commit, timeout=context.time_remaining()
            )
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
    return first.finish_reason is not FinishReason.LENGTH or max_tokens == 1
