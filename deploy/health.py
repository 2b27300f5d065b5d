"""Health probes of the launcher and of the compose healthchecks: grpc.health.v1 ``Check`` on a
node's or the gateway's gRPC port, and HTTP ``GET /health`` on the gateway.

Both ignore ``http_proxy``/``https_proxy``: a probe of 127.0.0.1 or of a compose service name
sent through a corporate proxy would report the proxy's health, not the server's.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
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

    def __str__(self) -> str:
        return f"http {self.url}"


HealthTarget = GrpcHealth | HttpHealth


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


def http_ok(url: str, timeout_s: float = 2.0, ca: Path | None = None) -> bool:
    opener = _NO_PROXY
    if ca is not None:
        context = ssl.create_default_context(cafile=str(ca))
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )
    try:
        with opener.open(url, timeout=timeout_s) as response:
            status: int = response.status  # open() is typed Any
            return status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
