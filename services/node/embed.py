"""Embed for the roles that compute prompts (prefill, colocated): one prompt's embedding, as an
engine request that ends when its prompt is computed (``EngineCore.add_request(pooling=...)``),
in the node's steps beside its generation requests. Closing the call aborts the request."""

from __future__ import annotations

import contextlib
import uuid

import grpc

from pdserve.v1 import common_pb2
from services.async_engine import AsyncEngine, EngineDeadError
from services.convert import refusal_metadata
from services.engine import EngineCoreOutput, PoolingParams, SamplingParams
from services.node.runtime import NodeServerRef

EmbedContext = grpc.aio.ServicerContext[common_pb2.EmbedRequest, common_pb2.EmbedResult]


async def embed(
    engine: AsyncEngine,
    server: NodeServerRef,
    request: common_pb2.EmbedRequest,
    context: EmbedContext,
) -> common_pb2.EmbedResult:
    async with server.get().admit(context):
        request_id = request.request_id or f"emb-{uuid.uuid4().hex}"
        prompt = list(request.prompt_token_ids)
        last: EngineCoreOutput | None = None
        try:
            params = SamplingParams(
                max_tokens=1,
                priority=request.priority,
                lora_name=request.lora_name if request.HasField("lora_name") else None,
                cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
            )
            pooling = PoolingParams(
                normalize=request.normalize if request.HasField("normalize") else None,
                dimensions=request.dimensions if request.HasField("dimensions") else None,
            )
            stream = engine.generate(request_id, prompt, params, pooling=pooling)
            async with contextlib.aclosing(stream):
                async for output in stream:
                    last = output
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), refusal_metadata(exc))
        except EngineDeadError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        if last is None or last.embedding is None:  # the engine stopped it (shutdown)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the request was aborted")
        return common_pb2.EmbedResult(
            embedding=last.embedding,
            num_prompt_tokens=len(prompt),
            cached_prompt_tokens=last.num_cached_tokens,
        )
