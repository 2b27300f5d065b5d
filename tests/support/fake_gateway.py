"""A gateway in front of one in-process fake colocated node (``support.fake_node``), on an event
loop of its own: cheap enough for hypothesis examples, and the node records the prompt each
request became.

Life cycle: ``FakeGateway.start(model_dir)`` starts the node, the gateway and a client channel;
``call`` runs one Generate to its end; ``close`` stops all three and the loop.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from gateway.config import parse_gateway_config
from gateway.server import GatewayServer
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc
from support import fake_node


@dataclass
class FakeGateway:
    loop: asyncio.AbstractEventLoop
    node: fake_node.FakeNode
    server: grpc.aio.Server
    gateway: GatewayServer
    channel: grpc.aio.Channel
    stub: gateway_pb2_grpc.GatewayServiceStub

    @classmethod
    def start(
        cls, model_dir: Path, script: list[int] | None = None, extra: Sequence[str] = ()
    ) -> FakeGateway:
        """``script``: the token ids the node answers every request with (then it stops);
        ``extra``: more gateway flags."""
        loop = asyncio.new_event_loop()

        async def start() -> FakeGateway:
            args = argparse.Namespace(
                role="colocated", port=0, ttft_ms=0.0, itl_ms=0.0, fail_after_tokens=None,
                refuse=False, script=script,
            )  # fmt: skip
            node = fake_node.FakeNode(args)
            server = grpc.aio.server()
            fake_node.decode_pb2_grpc.add_DecodeServiceServicer_to_server(node, server)
            health = fake_node.health.aio.HealthServicer()
            fake_node.health_pb2_grpc.add_HealthServicer_to_server(health, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            config = parse_gateway_config(
                ["--model", str(model_dir), "--served-model-name", "tiny", "--host",
                 "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--max-model-len", "256",
                 "--max-tokens-limit", "64", "--colocated", f"127.0.0.1:{port}", *extra],
                {},
            )  # fmt: skip
            gateway = GatewayServer(config)
            await gateway.start()
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}")
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            return cls(loop, node, server, gateway, channel, stub)

        return loop.run_until_complete(start())

    def call(
        self, request: gateway_pb2.GatewayGenerateRequest
    ) -> tuple[grpc.StatusCode, str, list[gateway_pb2.GatewayGenerateResponse]]:
        """(status, details, responses) of one Generate call, read to its end."""

        async def call() -> tuple[grpc.StatusCode, str, list[gateway_pb2.GatewayGenerateResponse]]:
            responses = []
            try:
                async for response in self.stub.Generate(request, timeout=10):
                    responses.append(response)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or "", responses
            return grpc.StatusCode.OK, "", responses

        return self.loop.run_until_complete(call())

    def close(self) -> None:
        self.loop.run_until_complete(self.channel.close())
        self.loop.run_until_complete(self.gateway.stop(grace_s=0.5))
        self.loop.run_until_complete(self.server.stop(0))
        self.loop.close()
