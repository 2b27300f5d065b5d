"""The gateway's nodes: each one's routing state (``node.Node``) and its client
(``node_client.NodeClient``: one gRPC channel), health and load refreshed by polling.

Life cycle of a node here: UNKNOWN (start) → HEALTHY when grpc.health.v1 says SERVING and a
GetLoad answered → UNHEALTHY when a poll fails, the node reports NOT_SERVING or draining, or a
request to it failed with UNAVAILABLE (passive: marked at once, not at the next poll) → HEALTHY
again at the next good poll. An UNHEALTHY node whose polls went unanswered a few times in a row
(``Node.is_unresponsive``: hung, not merely draining or slow) also has its open legs ended by
each such poll, so streams on a hung node fail within seconds instead of waiting for gRPC's
ping timeout. The state is soft (peers.md #12): everything comes from the last
poll, so a restarted node is judged by what it reports now, never by what it held before.

Life cycle of the node set: a ``dns:///`` entry is resolved again before every poll
(``node_discovery``). A new address becomes a node in UNKNOWN, polled at once and routed to only
once that poll finds it HEALTHY. An address gone from the answer RETIRES its node: no new request
is routed to it, the requests it has finish, and its channel closes once it has none (if the
address comes back first, the node returns as it is). A failed lookup changes nothing.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.routing.node import Node
from gateway.routing.node_census import NodeCensus, RoleCensus
from gateway.routing.node_client import NodeClient
from gateway.routing.node_discovery import DnsResolver, ResolveError, Resolver, parse_target
from services.tls import TlsFiles
from services.types import Role

logger = logging.getLogger(__name__)


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
        self._clients: dict[Node, NodeClient] = {}
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
        return [self._add(t.address, role, None) for t in self._targets[role] if not t.dns]

    def _add(self, address: str, role: Role, tls_name: str | None) -> Node:
        node = Node(address, role, tls_name)
        self._clients[node] = NodeClient(address, role, self.tls, tls_name)
        return node

    def client(self, node: Node) -> NodeClient:
        """The channel and stubs of a node this pool holds (routed or retiring)."""
        return self._clients[node]

    def _role_nodes(self, role: Role) -> list[Node]:
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode,
                Role.COLOCATED: self.colocated}[role]  # fmt: skip

    @property
    def nodes(self) -> list[Node]:
        return [*self.prefill, *self.decode, *self.colocated]

    def census(self) -> NodeCensus:
        """How many nodes of each role are routed to, and how many of them are healthy now."""

        def count(nodes: list[Node]) -> RoleCensus:
            return RoleCensus(num_healthy=sum(n.is_healthy for n in nodes), num_total=len(nodes))

        return NodeCensus(count(self.prefill), count(self.decode), count(self.colocated))

    def lora_names(self) -> frozenset[str] | None:
        """The LoRA adapters any node routed to last reported; None while none has reported."""
        reports = [n.load.lora_names for n in self.nodes if n.load.lora_names is not None]
        return frozenset().union(*reports) if reports else None

    def is_ready(self) -> bool:
        """At least one healthy prefill + decode pair, or one healthy colocated node."""
        return self.census().is_ready

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
        await asyncio.gather(*(self._clients.pop(node).close() for node in finished))

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
                current.append(self._add(address, role, wanted[address]))

    async def poll_once(self) -> list[Node]:
        """Refreshes the node set, then polls every node (ending the legs on an unresponsive
        one); returns those that just turned HEALTHY (new, or back from UNHEALTHY)."""
        await self.refresh()
        nodes = self.nodes
        versions = [node.lora_version for node in nodes]
        polls = await asyncio.gather(*(self._clients[n].poll(self.timeout_s) for n in nodes))
        recovered = [
            node.observe_poll(*poll, lora_version=version)
            for node, poll, version in zip(nodes, polls, versions, strict=True)
        ]
        return [node for node, back in zip(nodes, recovered, strict=True) if back]

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self._clients.values()))
        self._clients.clear()
