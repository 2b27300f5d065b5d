"""Health probes of the launcher and of the compose healthchecks: grpc.health.v1 ``Check`` on a
node's or the gateway's gRPC port, and HTTP ``GET /health`` on the gateway.

Both ignore ``http_proxy``/``https_proxy``: a probe of 127.0.0.1 or of a compose service name
sent through a corporate proxy would report the proxy's health, not the server's.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class GrpcHealth:
    """SERVING from grpc.health.v1 ``Check(service)`` at ``address`` (host:port)."""

    address: str
    service: str = ""

    def check(self, timeout_s: float) -> bool:
        return grpc_serving(self.address, self.service, timeout_s)

    def __str__(self) -> str:
        return f"grpc {self.address}"


@dataclass(frozen=True)
class HttpHealth:
    """Status 200 from ``GET url``."""

    url: str

    def check(self, timeout_s: float) -> bool:
        return http_ok(self.url, timeout_s)

    def __str__(self) -> str:
        return f"http {self.url}"


HealthTarget = GrpcHealth | HttpHealth


def grpc_serving(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    options = [("grpc.enable_http_proxy", 0)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with _NO_PROXY.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
