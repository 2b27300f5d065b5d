"""How many nodes of each role the gateway knows and how many of them it may route to: one
snapshot of the node pool (``NodePool.census``).

Readiness (``/health`` 200, grpc.health.v1 SERVING), the ``/health`` body and the
``pdserve:healthy_nodes`` gauge all read one snapshot, so a body never counts a different pool
than the status it comes with. The body is what lets a launcher tell "one pair is up" from
"every node is up" (``deploy.health.GatewayNodesHealth``).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.types import Role


@dataclass(frozen=True)
class RoleCensus:
    num_healthy: int = 0
    """Nodes that pass health polls and are not draining: those a request may be routed to."""
    num_total: int = 0
    """Nodes the gateway knows (fixed addresses and those found through DNS); retiring ones,
    gone from the DNS answer, are not counted."""

    def __post_init__(self) -> None:
        assert 0 <= self.num_healthy <= self.num_total, self


@dataclass(frozen=True)
class NodeCensus:
    prefill: RoleCensus = RoleCensus()
    decode: RoleCensus = RoleCensus()
    colocated: RoleCensus = RoleCensus()

    def role(self, role: Role) -> RoleCensus:
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode,
                Role.COLOCATED: self.colocated}[role]  # fmt: skip

    @property
    def is_ready(self) -> bool:
        """At least one healthy prefill + decode pair, or one healthy colocated node: enough to
        serve a request."""
        has_pair = self.prefill.num_healthy > 0 and self.decode.num_healthy > 0
        return has_pair or self.colocated.num_healthy > 0

    def as_json(self) -> dict[str, dict[str, int]]:
        """``{"prefill": {"healthy": 2, "total": 2}, ...}``, every role present."""
        return {
            str(role): {"healthy": self.role(role).num_healthy, "total": self.role(role).num_total}
            for role in Role
        }
