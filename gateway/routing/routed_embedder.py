"""Runs one embedding request on a node that computes prompts: a prefill node, a colocated node,
or (with neither healthy) a decode node, by the router's prefix affinity and queue lengths.

Life cycle: PICK a node this request has not tried (``Router.pick_embedder``) → one ``Embed``
call, counted in flight on the node, bounded by the request's deadline → its vector. A node's
refusal of the input (INVALID_ARGUMENT naming the field) is the client's 400 at once; a node
that fails or is unreachable (marked unhealthy where it answered UNAVAILABLE) is tried no more
and the next is picked, up to ``--max-retries``; then 503 naming each failure. Cancelling the
call (a client gone) cancels the RPC, which aborts the request on its node.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from gateway.config import RouterConfig
from gateway.embedding import Embedding, EmbeddingRequest
from gateway.errors import ErrorKind, GatewayError
from gateway.routing.grpc_legs import rpc_failure
from gateway.routing.legs import RetryableFailure
from gateway.routing.router import Router
from pdserve.v1 import common_pb2

logger = logging.getLogger(__name__)


class RoutedEmbedder:
    def __init__(self, router: Router, config: RouterConfig) -> None:
        self.router = router
        self.config = config

    async def embed(self, request: EmbeddingRequest) -> Embedding:
        node_id = f"{request.request_id}.{uuid.uuid4().hex[:12]}"
        message = common_pb2.EmbedRequest(
            request_id=node_id,
            prompt_token_ids=request.prompt_token_ids,
            normalize=request.pooling.normalize,
            dimensions=request.pooling.dimensions,
            priority=request.priority,
            lora_name=request.lora_name,
        )
        tried: set[str] = set()
        failures: list[RetryableFailure] = []
        for attempt in range(self.config.max_retries + 1):
            node = self.router.pick_embedder(
                request.prompt_token_ids, exclude=tried, lora_name=request.lora_name
            )
            if node is None:
                break
            timeout = None if request.deadline is None else request.deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                raise GatewayError(ErrorKind.DEADLINE_EXCEEDED, "the request deadline passed")
            if attempt:
                message.request_id = f"{node_id}.r{attempt}"  # a node's ids are never reused
            try:
                with node.in_flight():
                    reply = await self.router.pool.client(node).embed(message, timeout)
                return Embedding(list(reply.embedding))
            except grpc.aio.AioRpcError as exc:
                failure = rpc_failure(exc, node, "embed")
                if isinstance(failure, GatewayError):
                    raise failure from None
                assert isinstance(failure, RetryableFailure)
                logger.warning("embedding %s: attempt %d on %s failed (%s): %s",
                               request.request_id, attempt, node.address, failure.cause,
                               failure.message)  # fmt: skip
                failures.append(failure)
                tried.add(node.address)
        why = (
            self.router.why_none(request.prompt_token_ids, request.lora_name)
            if len(failures) <= self.config.max_retries
            else f"{len(failures)} attempts failed (--max-retries {self.config.max_retries})"
        )
        detail = "; ".join(f"{f.node.address}: {f.message}" for f in reversed(failures))
        raise GatewayError(
            ErrorKind.UNAVAILABLE,
            f"no node could embed the input: {why}"
            + (f" (failed attempts, latest first: {detail})" if detail else ""),
            reason="no_node",
        )
