"""Where the gateway's nodes are: a node list entry is either one node (``host:port``) or a DNS
name that stands for many (``dns:///prefill.pdserve.svc.cluster.local:50061``, a Kubernetes
headless Service: one A record per ready pod).

``NodePool`` asks the ``Resolver`` again before every health poll, so the node set follows the
DNS answer: an address that appears becomes a node (routed to once a poll finds it healthy), an
address that disappears retires its node (it finishes what it has). A resolver is injected, so
tests can change the answers while requests are in flight.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
# getaddrinfo's "the name has no address" (as opposed to "the resolver failed").
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>\d{1,5})$")


@dataclass(frozen=True)
class NodeTarget:
    """One entry of ``--prefill`` / ``--decode`` / ``--colocated``."""

    host: str
    port: int
    dns: bool
    """True: ``host`` names a set of nodes, resolved again every health interval."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return DNS_SCHEME + self.address if self.dns else self.address


def parse_target(text: str) -> NodeTarget:
    """``host:port`` or ``dns:///name:port``; a ValueError says which form was expected."""
    dns = text.startswith(DNS_SCHEME)
    match = _HOST_PORT.match(text.removeprefix(DNS_SCHEME))
    if match is None or not 1 <= int(match["port"]) <= 65535:
        raise ValueError(f"{text!r} is not host:port or dns:///name:port")
    return NodeTarget(match["host"], int(match["port"]), dns)


class ResolveError(Exception):
    """The name could not be resolved this time (a DNS outage, a timeout): the pool keeps the
    nodes it has rather than retiring them all."""


class Resolver(Protocol):
    async def resolve(self, host: str, port: int) -> list[str]:
        """Every ``address:port`` the name stands for now; [] when it names no node (a
        headless Service with no ready pod); ``ResolveError`` when the answer is unknown."""
        ...


def format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class DnsResolver:
    """The system resolver (``getaddrinfo``, as cluster DNS is configured in the pod)."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s

    async def resolve(self, host: str, port: int) -> list[str]:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), self.timeout_s
            )
        except socket.gaierror as exc:
            if exc.errno in _NO_SUCH_NAME:
                return []  # the name exists in no record now: no ready node
            raise ResolveError(f"{host}: {exc}") from None
        except TimeoutError:
            raise ResolveError(f"{host}: no answer in {self.timeout_s:g} s") from None
        return sorted({format_address(str(info[4][0]), port) for info in infos})
