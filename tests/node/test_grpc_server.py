"""NodeServer over real gRPC on localhost: health, reflection, and graceful drain."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.node.grpc_server import NodeServer

SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


class SlowDecode(decode_pb2_grpc.DecodeServiceServicer):
    """GetLoad holds until released: a request in flight."""

    def __init__(self) -> None:
        self.node: NodeServer | None = None
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def GetLoad(self, request, context):
        async with self.node.admit(context):
            self.entered.set()
            await self.release.wait()
            return common_pb2.LoadReport(node_id="slow")


async def start(grace_s: float) -> tuple[NodeServer, SlowDecode, grpc.aio.Channel]:
    servicer = SlowDecode()
    node = NodeServer(
        "127.0.0.1:0",
        [SERVICE],
        [lambda server: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)],
        drain_grace_s=grace_s,
    )
    servicer.node = node
    await node.start()
    return node, servicer, grpc.aio.insecure_channel(f"127.0.0.1:{node.port}")


async def health(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)).status


def test_health_and_reflection() -> None:
    async def main() -> None:
        node, servicer, channel = await start(grace_s=1)
        assert await health(channel, "") == health_pb2.HealthCheckResponse.SERVING
        assert await health(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(iter([request])):
            names = {s.name for s in reply.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health"} <= names
        servicer.release.set()
        await node.drain()
        await channel.close()

    asyncio.run(main())


def test_drain_refuses_new_work_and_lets_in_flight_finish() -> None:
    async def main() -> None:
        node, servicer, channel = await start(grace_s=10)
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        in_flight = asyncio.ensure_future(stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10))
        await servicer.entered.wait()
        drain = asyncio.ensure_future(node.drain())
        for _ in range(100):  # NOT_SERVING is visible while the request still runs
            if await health(channel, SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("health never went NOT_SERVING")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        assert not drain.done()
        servicer.release.set()
        assert (await in_flight).node_id == "slow"
        await asyncio.wait_for(drain, timeout=5)
        await asyncio.wait_for(node.wait(), timeout=1)
        assert node.num_in_flight == 0
        await channel.close()

    asyncio.run(main())


def test_drain_cancels_what_outlives_the_grace() -> None:
    async def main() -> None:
        node, servicer, channel = await start(grace_s=0.2)
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        stuck = asyncio.ensure_future(stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10))
        await servicer.entered.wait()
        await asyncio.wait_for(node.drain(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError):
            await stuck
        await channel.close()

    asyncio.run(main())


def test_a_malformed_request_is_invalid_argument() -> None:
    """The nodes' servers refuse bytes that are no request as the gateway's does (shared
    ``services.malformed_requests``)."""

    async def main() -> None:
        node, servicer, channel = await start(grace_s=1)
        get_load = channel.unary_unary(
            f"/{SERVICE}/GetLoad", request_serializer=lambda x: x, response_deserializer=lambda x: x
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await get_load(b"\xff\xff\xff", timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GetLoadRequest" in (refused.value.details() or "")
        assert not servicer.entered.is_set()
        servicer.release.set()
        await node.drain()
        await channel.close()

    asyncio.run(main())
