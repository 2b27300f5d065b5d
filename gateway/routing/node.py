"""What the gateway's routing knows of one node: pure state, no channel (``NodeClient`` talks).

Life cycle of a node's health: UNKNOWN until its first poll; HEALTHY while polls answer
SERVING; UNHEALTHY when a poll fails or a request finds it unreachable (``mark_failed``), until
a later poll answers SERVING again. A draining node is healthy but gets no new requests.
``num_in_flight`` is the gateway's own count of legs open on the node (each leg counts itself
with ``add_leg`` / ``remove_leg``, or ``in_flight()``), fresher than the last polled load.

UNRESPONSIVE (``is_unresponsive``): an UNHEALTHY node whose last ``MAX_UNANSWERED_POLLS`` polls
got no answer at all (a deadline passed or the connection failed). Routing stops at the first
failed poll; from this point on, each poll also ends every leg still open on the node
(``add_leg``'s ``end``), so a hung node (SIGSTOP, a stuck process or VM: TCP open, nothing
answered) fails its streams within a few polls, as a killed node's fail at once. A node that
answers, even NOT_SERVING (draining, it lets its requests finish), keeps its legs, and a slow
node answers its polls: they never wait for an engine step.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from services.types import Role

logger = logging.getLogger(__name__)

# Polls in a row that got no answer before a node's legs are ended. Each waited out the poll's
# timeout (2 s by default; a node answers from a stats snapshot, never waiting for a step), so a
# late answer or two on a loaded host end nothing; a hung node's streams end about 3 x (timeout
# + interval) after it stopped, 9 s by default (they waited 61 s for gRPC's ping timeout).
MAX_UNANSWERED_POLLS = 3


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
    lora_names: frozenset[str] | None = None
    """The LoRA adapters the node loaded; None until it has reported (then it may have any)."""

    def serves(self, lora_name: str | None) -> bool:
        """Whether a request of adapter ``lora_name`` (None: the base model) may go there."""
        return lora_name is None or self.lora_names is None or lora_name in self.lora_names

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
        self.num_unanswered_polls = 0
        """Polls in a row that got no answer (reset by any answer, NOT_SERVING included)."""
        self.last_error: str | None = None
        self.lora_version = 0
        """Counts ``set_lora_names``: a poll sent before one must not undo it."""
        self._leg_ends: set[Callable[[str], None]] = set()

    @property
    def is_healthy(self) -> bool:
        return self.health is NodeHealth.HEALTHY and not self.load.draining

    @property
    def is_unresponsive(self) -> bool:
        """Its last ``MAX_UNANSWERED_POLLS`` polls got no answer: its legs are ended."""
        return self.num_unanswered_polls >= MAX_UNANSWERED_POLLS

    def add_leg(self, end: Callable[[str], None]) -> None:
        """Counts one leg in flight on this node until ``remove_leg(end)``; ``end(reason)`` is
        called (at most once per poll) should the node turn unresponsive meanwhile."""
        self.num_in_flight += 1
        self._leg_ends.add(end)

    def remove_leg(self, end: Callable[[str], None]) -> None:
        self._leg_ends.discard(end)
        self.num_in_flight -= 1
        assert self.num_in_flight >= 0, f"node {self.address}: more releases than legs"

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

    def set_lora_names(self, names: frozenset[str]) -> None:
        """The node's adapters after a run-time update it answered: routed by at once, not
        from the next poll."""
        self.load = dataclasses.replace(self.load, lora_names=names)
        self.lora_version += 1

    def observe_poll(
        self, load: NodeLoad | None, error: str | None, lora_version: int | None = None
    ) -> bool:
        """Applies one poll: ``error`` None means SERVING; ``load`` None means the node did not
        answer (ends its legs once it is unresponsive). True when the node just turned HEALTHY:
        new to the gateway, or back from UNHEALTHY (it may have restarted with an empty cache
        and without its run-time LoRA adapters). ``lora_version``: the node's
        ``lora_version`` when the poll was sent; an update since keeps its adapters (the node
        may have answered before it)."""
        assert load is not None or error is not None, "an unanswered poll says why"
        was_not_healthy = self.health is not NodeHealth.HEALTHY
        if load is not None:
            if lora_version is not None and lora_version != self.lora_version:
                load = dataclasses.replace(load, lora_names=self.load.lora_names)
            self.load = load
        self.num_unanswered_polls = self.num_unanswered_polls + 1 if load is None else 0
        if self.is_unresponsive and self._leg_ends:
            self._end_legs(f"no answer to {self.num_unanswered_polls} health polls in a row"
                           f" (last: {error})")  # fmt: skip
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
        return was_not_healthy and health is NodeHealth.HEALTHY

    def _end_legs(self, reason: str) -> None:
        logger.warning("node %s (%s): ending the %d legs open on it: %s", self.address, self.role,
                       len(self._leg_ends), reason)  # fmt: skip
        for end in list(self._leg_ends):  # an end may remove its leg
            end(reason)
