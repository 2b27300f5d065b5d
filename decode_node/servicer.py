"""DecodeService over an ``AsyncEngine``: protobuf in, engine dataclasses inside, protobuf out.

This first version serves requests whose prompt the node computes itself (``kv_source`` empty:
the colocated role, and the recompute fallback). Receiving a prefill node's KV through a
reservation arrives with ``kv_transfer``; such requests are refused with ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import logging
import uuid

import grpc

from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_pb2
from services.async_engine import AsyncEngine, EngineDeadError
from services.convert import (
    finish_reason_to_proto,
    load_report_to_proto,
    logprobs_to_proto,
    prompt_from_proto,
    sampling_params_from_proto,
)
from services.engine import EngineCoreOutput
from services.node_config import NodeConfig
from services.node_runtime import NodeServerRef

logger = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, config: NodeConfig, engine: AsyncEngine, server: NodeServerRef) -> None:
        self.config = config
        self.engine = engine
        self.server = server

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        async with self.server.get().admit(context):
            if request.kv_source:
                await context.abort(
                    grpc.StatusCode.UNIMPLEMENTED,
                    "kv_source: receiving KV from a prefill node is not available yet",
                )
            try:
                params = sampling_params_from_proto(request.sampling)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            request_id = request.request_id or f"dec-{uuid.uuid4().hex}"
            prompt = prompt_from_proto(request.prompt_token_ids)
            num_generated = 0
            last: EngineCoreOutput | None = None
            try:
                async for out in self.engine.generate(request_id, prompt, params):
                    last = out
                    num_generated += len(out.new_token_ids)
                    if out.new_token_ids:
                        yield decode_pb2.GenerateResponse(tokens=_delta(out))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except EngineDeadError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            assert last is not None and last.finish_reason is not None
            yield decode_pb2.GenerateResponse(
                finished=decode_pb2.Finished(
                    finish_reason=finish_reason_to_proto(last.finish_reason),
                    usage=common_pb2.Usage(
                        prompt_tokens=len(prompt),
                        completion_tokens=num_generated,
                        cached_prompt_tokens=last.num_cached_tokens,
                    ),
                )
            )

    async def CommitKv(self, request: kv_pb2.KvCommit, context: grpc.aio.ServicerContext):
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"transfer_id {request.transfer_id!r}: this node holds no KV reservations yet",
        )

    async def Abort(self, request: decode_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        # AsyncEngine.abort, not EngineCore.abort: the request's open stream must end too.
        try:
            found = await self.engine.abort(request.request_id)
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return decode_pb2.AbortResponse(found=found)

    async def GetLoad(self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        stats, fingerprint = await self._call(
            context, lambda engine: (engine.stats(), engine.kv_layout.fingerprint)
        )
        return load_report_to_proto(
            stats,
            node_id=self.config.node_id,
            role=str(self.config.role),
            fingerprint=fingerprint,
            draining=self.server.get().is_draining,
        )

    async def _call(self, context: grpc.aio.ServicerContext, fn):
        try:
            return await self.engine.call(fn)
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


def _delta(out: EngineCoreOutput) -> decode_pb2.TokenDelta:
    delta = decode_pb2.TokenDelta(token_ids=out.new_token_ids)
    if out.new_logprobs is not None:
        for token_id, logprobs in zip(out.new_token_ids, out.new_logprobs, strict=True):
            delta.logprobs.append(logprobs_to_proto(token_id, logprobs))
    return delta
