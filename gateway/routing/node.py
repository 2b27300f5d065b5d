"""What the gateway's routing knows of one node: pure state, no channel (``NodeClient`` talks).

Life cycle of a node's health: UNKNOWN until its first poll; HEALTHY while polls answer
SERVING; UNHEALTHY when a poll fails or a request finds it unreachable (``mark_failed``), until
a later poll answers SERVING again. A draining node is healthy but gets no new requests.
``num_in_flight`` is the gateway's own count of legs open on the node (each leg counts itself
with ``in_flight()``), fresher than the last polled load.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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
    def __init__(self, address: str, role: Role, tls_name: str | None = None) -> None:
        """``tls_name``: the name the node's certificate is checked against instead of
        ``address`` (a node found through DNS is dialled at its pod IP, which no certificate
        names; its service name does)."""
        self.address = address
        self.role = role
        self.tls_name = tls_name
        self.health = NodeHealth.UNKNOWN
        self.load = NodeLoad()
        self.num_in_flight = 0
        self.last_error: str | None = None

    @property
    def is_healthy(self) -> bool:
        return self.health is NodeHealth.HEALTHY and not self.load.draining

    @contextmanager
    def in_flight(self) -> Iterator[None]:
        """Counts one leg on this node for as long as the block runs."""
        self.num_in_flight += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1
            assert self.num_in_flight >= 0, f"node {self.address}: more releases than legs"

    def mark_failed(self, reason: str) -> None:
        """A request saw the node unreachable: stop routing to it until a poll says otherwise."""
        if self.health is not NodeHealth.UNHEALTHY:
            logger.warning("node %s (%s) marked unhealthy: %s", self.address, self.role, reason)
        self.health = NodeHealth.UNHEALTHY
        self.last_error = reason

    def observe_poll(self, load: NodeLoad | None, error: str | None) -> bool:
        """Applies one poll: ``error`` None means SERVING. True when the node just came back
        from UNHEALTHY (it may have restarted with an empty cache)."""
        was_unhealthy = self.health is NodeHealth.UNHEALTHY
        if load is not None:
            self.load = load
        health = NodeHealth.HEALTHY if error is None else NodeHealth.UNHEALTHY
        if health is not self.health:
            if self.health is NodeHealth.UNKNOWN and error is not None:
                # Nodes start alongside the gateway and load their model first: not yet
                # reachable is the expected start, not a fault.
                logger.info("node %s (%s): waiting for it to serve (%s)", self.address,
                            self.role, error)  # fmt: skip
            else:
                log = logger.info if health is NodeHealth.HEALTHY else logger.warning
                log("node %s (%s): %s%s", self.address, self.role, health.value,
                    f" ({error})" if error else "")  # fmt: skip
        self.health = health
        self.last_error = error
        return was_unhealthy and health is NodeHealth.HEALTHY
