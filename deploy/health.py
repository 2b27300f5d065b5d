"""Health probes of the launcher and of the compose healthchecks: grpc.health.v1 ``Check`` on a
node's or the gateway's gRPC port, HTTP ``GET /health`` on the gateway, and, for the launcher's
start-up, the node counts in that body (``GatewayNodesHealth``).

Both ignore ``http_proxy``/``https_proxy``: a probe of 127.0.0.1 or of a compose service name
sent through a corporate proxy would report the proxy's health, not the server's.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.tls import TlsFiles, sync_channel

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class GrpcHealth:
    """SERVING from grpc.health.v1 ``Check(service)`` at ``address`` (host:port)."""

    address: str
    service: str = ""
    tls: TlsFiles | None = None
    """Mutual TLS (a node with ``--tls-*``): the probe presents a certificate from the CA."""

    def check(self, timeout_s: float) -> bool:
        return grpc_serving(self.address, self.service, timeout_s, self.tls)

    def waiting_for(self, timeout_s: float) -> str:
        return "" if self.check(timeout_s) else f"{self} to be SERVING"

    def __str__(self) -> str:
        return f"grpc {self.address}"


@dataclass(frozen=True)
class HttpHealth:
    """Status 200 from ``GET url``."""

    url: str
    ca: Path | None = None
    """For an ``https`` URL: the CA that signed the server's certificate (None: the system's)."""

    def check(self, timeout_s: float) -> bool:
        return http_ok(self.url, timeout_s, self.ca)

    def waiting_for(self, timeout_s: float) -> str:
        return "" if self.check(timeout_s) else f"{self} to answer 200"

    def __str__(self) -> str:
        return f"http {self.url}"


@dataclass(frozen=True)
class GatewayNodesHealth:
    """``GET url`` (the gateway's ``/health``) answers 200 with a body counting at least
    ``expected`` healthy nodes of each role: the gateway has polled every node of the topology
    healthy, not only the first pair (which is all its 200 says), so the first requests spread
    over all of them."""

    url: str
    expected: tuple[tuple[str, int], ...]
    """(role, number of nodes) for each role the topology runs: ``(("prefill", 2), ...)``."""
    ca: Path | None = None
    """As ``HttpHealth.ca``."""

    def check(self, timeout_s: float) -> bool:
        return not self.waiting_for(timeout_s)

    def waiting_for(self, timeout_s: float) -> str:
        """What the gateway does not see yet, "" once it sees every node healthy."""
        body = http_json(self.url, timeout_s, self.ca)
        if body is None:
            return f"http {self.url} to answer 200"
        missing = nodes_waited_for(body, self.expected)
        return missing and f"the gateway to see every node healthy ({missing}, at {self.url})"

    def __str__(self) -> str:
        wanted = ", ".join(f"{count} {role}" for role, count in self.expected)
        return f"http {self.url} reports {wanted} healthy"


HealthTarget = GrpcHealth | HttpHealth | GatewayNodesHealth


def grpc_serving(
    address: str, service: str = "", timeout_s: float = 2.0, tls: TlsFiles | None = None
) -> bool:
    options = [("grpc.enable_http_proxy", 0)]
    with sync_channel(address, tls, options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            # The health stubs (types-grpcio-health-checking) declare no methods on HealthStub.
            response: health_pb2.HealthCheckResponse = stub.Check(  # type: ignore[attr-defined]
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def _opener(ca: Path | None) -> urllib.request.OpenerDirector:
    if ca is None:
        return _NO_PROXY
    context = ssl.create_default_context(cafile=str(ca))
    return urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )


def http_ok(url: str, timeout_s: float = 2.0, ca: Path | None = None) -> bool:
    try:
        with _opener(ca).open(url, timeout=timeout_s) as response:
            status: int = response.status  # open() is typed Any
            return status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def http_json(url: str, timeout_s: float = 2.0, ca: Path | None = None) -> object | None:
    """The JSON body of a 200 from ``GET url``; None for any other answer, or none."""
    try:
        with _opener(ca).open(url, timeout=timeout_s) as response:
            if response.status != 200:
                return None
            body: object = json.loads(response.read())
            return body
    except (urllib.error.URLError, OSError, ValueError):  # JSONDecodeError is a ValueError
        return None


def nodes_waited_for(body: object, expected: tuple[tuple[str, int], ...]) -> str:
    """What a gateway ``/health`` body (``{"nodes": {"prefill": {"healthy": 1, "total": 2},
    ...}}``) shows is not healthy yet of ``expected`` (role, count) pairs: ``"prefill 1/2
    healthy"``, joined by ", "; "" when every expected node is."""
    nodes = body.get("nodes") if isinstance(body, Mapping) else None
    if not isinstance(nodes, Mapping):
        return f"no node counts in {body!r}"
    waiting = []
    for role, count in expected:
        counts = nodes.get(role)
        healthy = counts.get("healthy") if isinstance(counts, Mapping) else None
        if not isinstance(healthy, int):
            waiting.append(f"no {role} count in {counts!r}")
        elif healthy < count:
            waiting.append(f"{role} {healthy}/{count} healthy")
    return ", ".join(waiting)
