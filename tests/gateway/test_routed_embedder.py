"""One embedding over the nodes (``gateway/routing/routed_embedder.py``), over scripted node
clients: a failing node is left for the next, a refusal of the input is the client's 400 at
once, and with every node failed the 503 names each failure."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.config import RouterConfig
from gateway.embedding import EmbeddingRequest
from gateway.errors import ErrorKind, GatewayError
from gateway.routing.node import NodeHealth
from gateway.routing.node_pool import NodePool
from gateway.routing.routed_embedder import RoutedEmbedder
from gateway.routing.router import Router
from pdserve.v1 import common_pb2
from services.convert import PARAM_METADATA_KEY
from services.types import PoolingParams


def rpc_error(code: grpc.StatusCode, details: str, param: str | None = None):
    trailing = grpc.aio.Metadata(*([(PARAM_METADATA_KEY, param)] if param else []))
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=details)


class ScriptedNode:
    def __init__(self, answer: list[float] | Exception) -> None:
        self.answer = answer
        self.ids: list[str] = []

    async def embed(self, message: common_pb2.EmbedRequest, timeout_s: float | None):
        self.ids.append(message.request_id)
        if isinstance(self.answer, Exception):
            raise self.answer
        return common_pb2.EmbedResult(embedding=self.answer, num_prompt_tokens=3)


@pytest.fixture
def embedder(monkeypatch: pytest.MonkeyPatch):
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # node channels want a loop while they are created
    pool = NodePool(("127.0.0.1:6100", "127.0.0.1:6101"), ("127.0.0.1:7100",), ())
    for node in pool.nodes:
        node.health = NodeHealth.HEALTHY
    nodes: dict[str, ScriptedNode] = {}
    monkeypatch.setattr(pool, "client", lambda node: nodes[node.address])
    config = RouterConfig(
        prefill=("127.0.0.1:6100", "127.0.0.1:6101"), decode=("127.0.0.1:7100",), colocated=()
    )
    yield RoutedEmbedder(Router(pool, config), config), nodes, loop
    loop.run_until_complete(pool.close())
    loop.close()


REQUEST = EmbeddingRequest("r", (1, 2, 3), PoolingParams())


def test_a_failed_node_is_left_for_the_next(embedder) -> None:
    routed, nodes, loop = embedder
    down = ScriptedNode(rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    nodes.update({"127.0.0.1:6100": down, "127.0.0.1:6101": down,
                  "127.0.0.1:7100": ScriptedNode([0.5, 0.5])})  # fmt: skip
    result = loop.run_until_complete(routed.embed(REQUEST))
    assert result.vector == [0.5, 0.5]
    # Each attempt a fresh id; the unavailable nodes are marked so, the decode node served.
    assert len(set(down.ids)) == 2 and all(i.startswith("r.") for i in down.ids)
    assert not any(n.is_healthy for n in routed.router.pool.prefill)


def test_a_refused_input_is_the_clients_error_at_once(embedder) -> None:
    routed, nodes, loop = embedder
    refused = ScriptedNode(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "too big", "dimensions"))
    nodes.update({a: refused for a in ("127.0.0.1:6100", "127.0.0.1:6101", "127.0.0.1:7100")})
    with pytest.raises(GatewayError) as error:
        loop.run_until_complete(routed.embed(REQUEST))
    assert (error.value.kind, error.value.param) == (ErrorKind.INVALID_ARGUMENT, "dimensions")
    assert len(refused.ids) == 1


def test_every_node_failed_is_503_naming_each(embedder) -> None:
    routed, nodes, loop = embedder
    broken = ScriptedNode(rpc_error(grpc.StatusCode.INTERNAL, "boom"))
    nodes.update({a: broken for a in ("127.0.0.1:6100", "127.0.0.1:6101", "127.0.0.1:7100")})
    with pytest.raises(GatewayError) as error:
        loop.run_until_complete(routed.embed(REQUEST))
    assert error.value.kind is ErrorKind.UNAVAILABLE
    assert error.value.message.count("boom") == 3
