"""The gateway's view of its nodes: one gRPC channel each, health and load refreshed by polling.

Life cycle of a node here: UNKNOWN (start) → HEALTHY when grpc.health.v1 says SERVING and a
GetLoad answered → UNHEALTHY when a poll fails, the node reports NOT_SERVING or draining, or a
request to it failed with UNAVAILABLE (passive: marked at once, not at the next poll) → HEALTHY
again at the next good poll. The state is soft (peers.md #12): everything comes from the last
poll, so a restarted node is judged by what it reports now, never by what it held before.

Life cycle of the node set: a ``dns:///`` entry is resolved again before every poll
(``gateway.node_discovery``). A new address becomes a node in UNKNOWN, polled at once and routed
to only once that poll finds it HEALTHY. An address gone from the answer RETIRES its node: no new
request is routed to it, the requests it has finish, and its channel closes once it has none (if
the address comes back first, the node returns as it is). A failed lookup changes nothing.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.node_discovery import DnsResolver, ResolveError, Resolver, parse_target
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
from services.tls import TlsFiles, aio_channel
from services.types import Role

logger = logging.getLogger(__name__)


class NodeHealth(enum.Enum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True)
class NodeLoad:
    num_running: int = 0
    num_waiting: int = 0
    num_reserved: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    draining: bool = False

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class Node:
    """One node: its channel and stubs, its last health and load, and the gateway's own count of
    requests it has sent there (fresher than the last poll)."""

    def __init__(
        self,
        address: str,
        role: Role,
        tls: TlsFiles | None = None,
        tls_name: str | None = None,
    ) -> None:
        """``tls_name``: the name the node's certificate is checked against instead of
        ``address`` (a node found through DNS is dialled at its pod IP, which no certificate
        names; its service name does)."""
        self.address = address
        self.role = role
        self.tls_name = tls_name
        options: list[tuple[str, object]] = [
            # Streams may be idle for long between tokens of a slow model; keep them alive.
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.max_receive_message_length", 64 * 2**20),
        ]
        if tls is not None and tls_name is not None:
            options.append(("grpc.ssl_target_name_override", tls_name))
        self.channel = aio_channel(address, tls, options=options)
        self.prefill = prefill_pb2_grpc.PrefillServiceStub(self.channel)
        self.decode = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self.health = NodeHealth.UNKNOWN
        self.load = NodeLoad()
        self.num_in_flight = 0
        self.last_error: str | None = None

    @property
    def is_healthy(self) -> bool:
        return self.health is NodeHealth.HEALTHY and not self.load.draining

    def mark_failed(self, reason: str) -> None:
        """A request saw the node unreachable: stop routing to it until a poll says otherwise."""
        if self.health is not NodeHealth.UNHEALTHY:
            logger.warning("node %s (%s) marked unhealthy: %s", self.address, self.role, reason)
        self.health = NodeHealth.UNHEALTHY
        self.last_error = reason

    async def poll(self, timeout_s: float) -> bool:
        """Refreshes health and load; True when the node just came back from UNHEALTHY (it may
        have restarted with an empty cache)."""
        was_unhealthy = self.health is NodeHealth.UNHEALTHY
        try:
            status = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            stub = self.prefill if self.role is Role.PREFILL else self.decode
            report = await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            self._set(NodeHealth.UNHEALTHY, f"{exc.code().name}: {exc.details()}")
            return False
        self.load = NodeLoad(
            num_running=report.num_running,
            num_waiting=report.num_waiting,
            num_reserved=report.num_reserved,
            kv_blocks_used=report.kv_blocks_used,
            kv_blocks_total=report.kv_blocks_total,
            draining=report.draining,
        )
        if status.status != health_pb2.HealthCheckResponse.SERVING:
            self._set(NodeHealth.UNHEALTHY, "health: NOT_SERVING")
            return False
        self._set(NodeHealth.HEALTHY, None)
        return was_unhealthy

    def _set(self, health: NodeHealth, error: str | None) -> None:
        if health is not self.health:
            log = logger.info if health is NodeHealth.HEALTHY else logger.warning
            log("node %s (%s): %s%s", self.address, self.role, health.value,
                f" ({error})" if error else "")  # fmt: skip
        self.health = health
        self.last_error = error

    async def close(self) -> None:
        await self.channel.close()


class NodePool:
    """Every node the gateway routes to, by role; the gateway polls them every ``interval_s``.

    ``prefill`` / ``decode`` / ``colocated`` hold the nodes requests may be routed to;
    ``retiring`` those whose address left the DNS answer and that still have requests.
    """

    def __init__(
        self,
        prefill: tuple[str, ...],
        decode: tuple[str, ...],
        colocated: tuple[str, ...],
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        resolver: Resolver | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        """``tls``: mutual TLS to every node (see ``services/tls.py``); None: plaintext."""
        self.tls = tls
        self._targets = {
            Role.PREFILL: [parse_target(a) for a in prefill],
            Role.DECODE: [parse_target(a) for a in decode],
            Role.COLOCATED: [parse_target(a) for a in colocated],
        }
        # Fixed entries are nodes from the start; DNS names get theirs at the first refresh.
        self.prefill = self._fixed_nodes(Role.PREFILL)
        self.decode = self._fixed_nodes(Role.DECODE)
        self.colocated = self._fixed_nodes(Role.COLOCATED)
        self.retiring: list[Node] = []
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.resolver: Resolver = resolver or DnsResolver(timeout_s)

    def _fixed_nodes(self, role: Role) -> list[Node]:
        return [Node(t.address, role, self.tls) for t in self._targets[role] if not t.dns]

    def _role_nodes(self, role: Role) -> list[Node]:
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode,
                Role.COLOCATED: self.colocated}[role]  # fmt: skip

    @property
    def nodes(self) -> list[Node]:
        return [*self.prefill, *self.decode, *self.colocated]

    def is_ready(self) -> bool:
        """At least one healthy prefill + decode pair, or one healthy colocated node."""
        has_pair = any(n.is_healthy for n in self.prefill) and any(
            n.is_healthy for n in self.decode
        )
        return has_pair or any(n.is_healthy for n in self.colocated)

    async def refresh(self) -> None:
        """Resolves every DNS entry again: adds the nodes that appeared, retires those gone, and
        closes retired nodes that have finished their requests."""
        for role, targets in self._targets.items():
            dns = [t for t in targets if t.dns]
            if not dns:
                continue
            # address -> the DNS name it was found under (None: a fixed entry)
            wanted: dict[str, str | None] = {t.address: None for t in targets if not t.dns}
            try:
                for target in dns:
                    for address in await self.resolver.resolve(target.host, target.port):
                        wanted.setdefault(address, target.host)
            except (ResolveError, OSError) as exc:  # the poll loop must outlive DNS trouble
                logger.warning("%s nodes: keeping the current set: %s", role, exc)
                continue
            self._reconcile(role, wanted)
        finished = [n for n in self.retiring if n.num_in_flight == 0]
        self.retiring = [n for n in self.retiring if n.num_in_flight > 0]
        for node in finished:
            logger.info("node %s (%s) retired", node.address, node.role)
        await asyncio.gather(*(node.close() for node in finished))

    def _reconcile(self, role: Role, wanted: dict[str, str | None]) -> None:
        current = self._role_nodes(role)
        have = {n.address for n in current}
        for node in [n for n in current if n.address not in wanted]:
            logger.info("node %s (%s) left discovery: retiring (%d in flight)",
                        node.address, role, node.num_in_flight)  # fmt: skip
            current.remove(node)
            self.retiring.append(node)
        for address in sorted(wanted.keys() - have):
            back = [n for n in self.retiring if n.address == address and n.role is role]
            if back:
                self.retiring.remove(back[0])
                current.append(back[0])
            else:
                logger.info("node %s (%s) discovered", address, role)
                current.append(Node(address, role, self.tls, wanted[address]))

    async def poll_once(self) -> list[Node]:
        """Refreshes the node set, then polls every node; returns those that came back from
        UNHEALTHY."""
        await self.refresh()
        nodes = self.nodes
        recovered = await asyncio.gather(*(node.poll(self.timeout_s) for node in nodes))
        return [node for node, back in zip(nodes, recovered, strict=True) if back]

    async def close(self) -> None:
        await asyncio.gather(*(node.close() for node in [*self.nodes, *self.retiring]))
