"""``python -m deploy.probe``, the compose healthcheck: exit 0 only for SERVING / HTTP 200."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deploy.probe import main as probe


@pytest.fixture
def health_server() -> Iterator[tuple[health.HealthServicer, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


def test_grpc_probe_follows_the_serving_status(health_server) -> None:
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert probe(["grpc", f"127.0.0.1:{port}"]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # a draining node
    assert probe(["grpc", f"127.0.0.1:{port}"]) == 1
    servicer.set("pdserve.v1.DecodeService", health_pb2.HealthCheckResponse.SERVING)
    assert probe(["grpc", f"127.0.0.1:{port}", "--service", "pdserve.v1.DecodeService"]) == 0


def test_grpc_probe_of_a_closed_port_fails_fast(health_server) -> None:
    _, port = health_server
    assert probe(["grpc", "127.0.0.1:1", "--timeout-s", "0.5"]) == 1


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (the http.server API)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_http_probe_wants_200(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a probe must not use a proxy
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert probe(["http", f"{url}/health"]) == 0
        _Health.status = 503  # no healthy pair yet
        assert probe(["http", f"{url}/health"]) == 1
        assert probe(["http", f"{url}/nowhere"]) == 1
    finally:
        _Health.status = 200
        server.shutdown()
