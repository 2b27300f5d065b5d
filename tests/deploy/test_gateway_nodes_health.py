"""The launcher's start-up wait for the gateway to see every node: the ``/health`` body parsed,
the target the launcher gives the gateway, and the banner held back until every pair is up (a
fake gateway process, no model)."""

from __future__ import annotations

import dataclasses
import http.server
import io
import json
import sys
import threading
from collections.abc import Iterator

import pytest

from deploy.commands import gateway_process
from deploy.health import GatewayNodesHealth, nodes_waited_for
from deploy.launch import Launcher
from deploy.local_ports import free_ports
from deploy.supervisor import Output
from deploy.topology import GatewaySpec, Topology

TWO_PAIRS = (("prefill", 2), ("decode", 2))


def health_body(prefill: int, decode: int) -> dict[str, object]:
    """What the gateway's ``/health`` answers with two pairs, ``prefill`` and ``decode`` of them
    healthy."""
    return {
        "status": "ok",
        "nodes": {
            "prefill": {"healthy": prefill, "total": 2},
            "decode": {"healthy": decode, "total": 2},
            "colocated": {"healthy": 0, "total": 0},
        },
    }


def test_the_body_passes_only_when_every_expected_node_is_healthy() -> None:
    assert nodes_waited_for(health_body(2, 2), TWO_PAIRS) == ""
    assert nodes_waited_for(health_body(2, 1), TWO_PAIRS) == "decode 1/2 healthy"
    assert nodes_waited_for(health_body(1, 0), TWO_PAIRS) == (
        "prefill 1/2 healthy, decode 0/2 healthy"
    )
    # A role the topology does not run is not waited for.
    assert nodes_waited_for(health_body(0, 0), (("colocated", 0),)) == ""


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"status": "ok"}, "no node counts in {'status': 'ok'}"),  # a gateway without counts
        ([1, 2], "no node counts in [1, 2]"),
        ({"status": "ok", "nodes": {"prefill": {"healthy": 2}}}, "no decode count in None"),
        ({"status": "ok", "nodes": {"prefill": {"healthy": "2"}, "decode": {"healthy": 2}}},
         "no prefill count in {'healthy': '2'}"),
    ],
)  # fmt: skip
def test_a_body_without_counts_never_passes_and_says_why(body: object, said: str) -> None:
    assert nodes_waited_for(body, TWO_PAIRS) == said


class _Gateway(http.server.BaseHTTPRequestHandler):
    status = 200
    body: object = health_body(2, 1)

    def do_GET(self) -> None:  # noqa: N802 (the http.server API)
        payload = json.dumps(self.body).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gateway_url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a probe must not use a proxy
    server = http.server.HTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/health"
    server.shutdown()
    _Gateway.status, _Gateway.body = 200, health_body(2, 1)


def test_the_target_reads_the_gateway_health_body(gateway_url: str) -> None:
    target = GatewayNodesHealth(gateway_url, TWO_PAIRS)
    assert not target.check(timeout_s=2.0)
    assert target.waiting_for(timeout_s=2.0) == (
        f"the gateway to see every node healthy (decode 1/2 healthy, at {gateway_url})"
    )
    _Gateway.body = health_body(2, 2)
    assert target.check(timeout_s=2.0) and target.waiting_for(timeout_s=2.0) == ""
    _Gateway.status = 503  # no healthy pair: the body is an error, not counts
    assert target.waiting_for(timeout_s=2.0) == f"http {gateway_url} to answer 200"


def test_the_launcher_waits_for_the_gateway_to_see_every_node_of_the_topology() -> None:
    topology = Topology().with_counts(prefill=2, decode=2, colocated=1)
    spec = gateway_process(topology, sys.executable)
    (target,) = spec.startup
    assert target == GatewayNodesHealth(
        f"http://127.0.0.1:{topology.gateway.http_port}/health",
        (("prefill", 2), ("decode", 2), ("colocated", 1)),
    )
    # After a restart only /health 200 and gRPC SERVING count: a node left down must not hold it.
    assert target not in spec.health


# A gateway stand-in: grpc.health.v1 SERVING at once, /health 200 with one decode node of two
# healthy for its first ALL_UP_AFTER answers, then both (never, when 0).
FAKE_GATEWAY = """
import http.server, json, os
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2_grpc

server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
server.add_insecure_port("127.0.0.1:" + os.environ["GRPC_PORT"])
server.start()
all_up_after = int(os.environ["ALL_UP_AFTER"])

class Health(http.server.BaseHTTPRequestHandler):
    served = 0

    def do_GET(self):
        Health.served += 1
        all_up = 0 < all_up_after <= Health.served
        if all_up and Health.served == all_up_after:
            print("now reporting every node healthy", flush=True)
        count = {"healthy": 2 if all_up else 1, "total": 2}
        body = json.dumps({"status": "ok", "nodes": {"prefill": {"healthy": 2, "total": 2},
                           "decode": count, "colocated": {"healthy": 0, "total": 0}}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(os.environ["HTTP_PORT"])), Health).serve_forever()
"""


def run_fake_gateway(
    monkeypatch: pytest.MonkeyPatch, all_up_after: int, startup_timeout_s: float
) -> tuple[int, str]:
    """The launcher over two pairs whose gateway is ``FAKE_GATEWAY``, stopped once its banner is
    out; its exit code and log."""
    monkeypatch.setattr(Launcher, "watch", lambda self: 0)  # stop once the banner is out
    http_port, grpc_port = free_ports(2)
    topology = Topology(gateway=GatewaySpec(http_port=http_port, grpc_port=grpc_port))
    topology = topology.with_counts(prefill=2, decode=2)
    env = (("HTTP_PORT", str(http_port)), ("GRPC_PORT", str(grpc_port)),
           ("ALL_UP_AFTER", str(all_up_after)))  # fmt: skip
    spec = dataclasses.replace(
        gateway_process(topology, sys.executable),
        argv=(sys.executable, "-c", FAKE_GATEWAY),
        env=env,
    )
    out = io.StringIO()
    launcher = Launcher(
        topology, [spec], grace_s=5, startup_timeout_s=startup_timeout_s, output=Output(out)
    )
    return launcher.run(), out.getvalue()


def test_the_banner_waits_until_the_gateway_reports_both_pairs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, log = run_fake_gateway(monkeypatch, all_up_after=4, startup_timeout_s=60)
    assert code == 0, log
    lines = log.splitlines()
    # Its output, behind the [gateway] prefix (its argv, logged at start, holds the text too).
    all_up = [
        i
        for i, line in enumerate(lines)
        if line.startswith("[gateway]") and line.endswith("now reporting every node healthy")
    ]
    (banner,) = [i for i, line in enumerate(lines) if "pdserve is up" in line]
    assert all_up and all_up[0] < banner, log


def test_the_timeout_says_which_nodes_the_gateway_still_waits_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code, log = run_fake_gateway(monkeypatch, all_up_after=0, startup_timeout_s=2)
    assert code == 1, log
    assert "pdserve is up" not in log
    assert "not healthy after 2 s: gateway (waiting for the gateway to see every node " in log
    assert "(decode 1/2 healthy, at http://127.0.0.1:" in log, log
