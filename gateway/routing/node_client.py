"""One node's gRPC channel and stubs: what the gateway sends requests and health polls over.

The routing state of the same node (health, load, work in flight) is ``gateway.routing.node.Node``;
``NodePool`` keeps the two side by side and closes the channel when the node retires.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.routing.node import NodeLoad
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from services.tls import TlsFiles, aio_channel
from services.types import Role

logger = logging.getLogger(__name__)


REDIAL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""Channel options that redial a node not listening yet (starting, restarting) at most a poll
apart: gRPC's default back-off grows to two minutes, and after 15 s of refused connections at
start-up the gateway saw a node 3-4 s after it listened."""


class NodeClient:
    def __init__(
        self, address: str, role: Role, tls: TlsFiles | None = None, tls_name: str | None = None
    ) -> None:
        self.address = address
        self.role = role
        options: list[tuple[str, object]] = [
            # Streams may be idle for long between tokens of a slow model; keep them alive.
            ("grpc.keepalive_time_ms", 30_000),
            # How long a ping waits for its ack before the connection and its streams fail: the
            # second line of defence against a hung node (the first is ``Node.is_unresponsive``).
            # gRPC's default is 60 s, and the pings that catch a node hung mid-stream are the
            # flow-control (BDP) pings sent as data arrives: a SIGSTOPped node held its streams
            # 61 s. A node's transport acks a ping without its event loop or engine, so 20 s
            # (keepalive's own default timeout) is far beyond any loaded host's answer.
            ("grpc.http2.ping_timeout_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.max_receive_message_length", 64 * 2**20),
            *REDIAL_OPTIONS,
        ]
        if tls is not None and tls_name is not None:
            options.append(("grpc.ssl_target_name_override", tls_name))
        self.channel = aio_channel(address, tls, options=options)
        self.prefill = prefill_pb2_grpc.PrefillServiceStub(self.channel)
        self.decode = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    async def poll(self, timeout_s: float) -> tuple[NodeLoad | None, str | None]:
        """The node's load and, when it is not SERVING or did not answer, why (else None). The
        load is None when the node did not answer (a deadline passed, the connection failed)."""
        try:
            # The health stubs (types-grpcio-health-checking) declare no methods on HealthStub.
            status = await self._health.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
            report = await self._stub().GetLoad(common_pb2.GetLoadRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return None, f"{exc.code().name}: {exc.details()}"
        load = NodeLoad(
            num_running=report.num_running,
            num_waiting=report.num_waiting,
            num_reserved=report.num_reserved,
            kv_blocks_used=report.kv_blocks_used,
            kv_blocks_total=report.kv_blocks_total,
            draining=report.draining,
            lora_names=frozenset(report.lora_names),
        )
        if status.status != health_pb2.HealthCheckResponse.SERVING:
            return load, "health: NOT_SERVING"
        return load, None

    def _stub(self) -> prefill_pb2_grpc.PrefillServiceStub | decode_pb2_grpc.DecodeServiceStub:
        return self.prefill if self.role is Role.PREFILL else self.decode

    async def load_lora_adapter(self, name: str, path: str, timeout_s: float) -> bool:
        """LoadLoraAdapter on the node: False where it had those files under ``name`` already;
        ``grpc.aio.AioRpcError`` for its refusal."""
        request = common_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        reply = await self._stub().LoadLoraAdapter(request, timeout=timeout_s)
        return bool(reply.loaded)

    async def unload_lora_adapter(self, name: str, timeout_s: float, grace_ms: int = 0) -> int:
        """UnloadLoraAdapter on the node: the requests still running with it."""
        request = common_pb2.UnloadLoraAdapterRequest(lora_name=name, grace_ms=grace_ms)
        reply = await self._stub().UnloadLoraAdapter(request, timeout=timeout_s)
        return int(reply.num_requests)

    async def embed(
        self, message: common_pb2.EmbedRequest, timeout_s: float | None
    ) -> common_pb2.EmbedResult:
        """Embed on the node; ``grpc.aio.AioRpcError`` for its refusal or failure."""
        reply: common_pb2.EmbedResult = await self._stub().Embed(message, timeout=timeout_s)
        return reply

    async def close(self) -> None:
        await self.channel.close()
