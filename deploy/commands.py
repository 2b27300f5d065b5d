"""The processes a topology runs on one machine: argv, environment and health targets of each
node and of the gateway, as the local launcher starts them.

Nodes with a GPU pin run on ``cuda:<id>``, the others on the CPU. Everything binds
``topology.host``; peers are reached at the same host (127.0.0.1 when it binds 0.0.0.0).

With ``tls_dir`` (what ``python -m deploy.certs`` wrote), every process gets its own certificate
(mutual TLS between the services) and the gateway's public ports serve TLS with the gateway's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from deploy.health import GatewayNodesHealth, GrpcHealth, HealthTarget, HttpHealth
from deploy.topology import EnvVars, FlagArgs, NodeInstance, Role, Topology
from services.tls import TlsFiles


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    """Log prefix and id: ``prefill-0``, ``gateway``."""
    argv: tuple[str, ...]
    env: EnvVars
    """Set on top of the launcher's own environment."""
    health: tuple[HealthTarget, ...]
    """All must pass before the process counts as up, at start and after a restart."""
    startup: tuple[HealthTarget, ...] = ()
    """Must pass too, after ``health``, before the launcher's banner; not after a restart,
    where a node left down must not keep the restarted process from counting as up."""


def connect_host(topology: Topology) -> str:
    """Where a client on this machine reaches a server bound to ``topology.host``."""
    return "127.0.0.1" if topology.host in ("0.0.0.0", "") else topology.host


def flag_argv(args: FlagArgs) -> list[str]:
    argv: list[str] = []
    for flag, value in args:
        argv.append(f"--{flag}")
        if value != "":
            argv.append(value)
    return argv


def tls_files(tls_dir: Path, name: str) -> TlsFiles:
    return TlsFiles(tls_dir / f"{name}.crt", tls_dir / f"{name}.key", tls_dir / "ca.crt")


def tls_argv(tls: TlsFiles) -> list[str]:
    return ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)]


def node_process(
    topology: Topology, node: NodeInstance, python: str, tls_dir: Path | None = None
) -> ProcessSpec:
    group = topology.group(node.role)
    device = "cpu" if node.gpu_id is None else f"cuda:{node.gpu_id}"
    argv = [
        python, "-m", node.role.module,
        "--role", str(node.role),
        "--model", topology.model,
        "--dtype", topology.dtype,
        "--kv-cache-dtype", topology.kv_cache_dtype,
        "--device", device,
        "--host", topology.host,
        "--grpc-port", str(node.grpc_port),
        "--kv-transport", topology.kv_transport,
        "--node-id", node.name,
    ]  # fmt: skip
    if node.metrics_port is not None:
        argv += ["--metrics-port", str(node.metrics_port)]
    if topology.lora_modules:
        argv += ["--lora-modules", *topology.lora_flag_values(with_paths=True)]
    tls = None if tls_dir is None else tls_files(tls_dir, node.name)
    if tls is not None:
        argv += tls_argv(tls)
    argv += flag_argv(group.args)
    address = f"{connect_host(topology)}:{node.grpc_port}"
    # With TLS the launcher's probe presents the node's own certificate.
    return ProcessSpec(node.name, tuple(argv), group.env, (GrpcHealth(address, tls=tls),))


def node_addresses(topology: Topology, role: Role) -> list[str]:
    host = connect_host(topology)
    return [f"{host}:{node.grpc_port}" for node in topology.group(role).instances]


def gateway_process(topology: Topology, python: str, tls_dir: Path | None = None) -> ProcessSpec:
    gateway = topology.gateway
    argv = [
        python, "-m", "gateway",
        "--model", topology.model,
        "--served-model-name", topology.model_name,
        "--host", topology.host,
        "--http-port", str(gateway.http_port),
        "--grpc-port", str(gateway.grpc_port),
    ]  # fmt: skip
    for role in Role:
        addresses = node_addresses(topology, role)
        if addresses:
            argv += [f"--{role}", ",".join(addresses)]
    if topology.lora_modules:
        argv += ["--lora-modules", *topology.lora_flag_values(with_paths=False)]
    tls = None if tls_dir is None else tls_files(tls_dir, "gateway")
    if tls is not None:
        argv += tls_argv(tls)
        argv += ["--public-tls-cert", str(tls.cert), "--public-tls-key", str(tls.key)]
    argv += flag_argv(gateway.args)
    host = connect_host(topology)
    scheme, ca = ("http", None) if tls is None else ("https", tls.ca)
    health_url = f"{scheme}://{host}:{gateway.http_port}/health"
    health = (HttpHealth(health_url, ca), GrpcHealth(f"{host}:{gateway.grpc_port}", tls=tls))
    # /health is 200 once one pair serves; the banner waits until the gateway has polled every
    # node healthy, or the first requests all land on the first pair.
    counts = tuple((str(g.role), g.count) for g in map(topology.group, Role) if g.count)
    startup = (GatewayNodesHealth(health_url, counts, ca),)
    return ProcessSpec("gateway", tuple(argv), gateway.env, health, startup)


def local_processes(
    topology: Topology,
    *,
    with_gateway: bool = True,
    python: str = sys.executable,
    tls_dir: Path | None = None,
) -> tuple[ProcessSpec, ...]:
    """Nodes first, then the gateway (it stops first: see ``Supervisor.stop``)."""
    specs = [node_process(topology, node, python, tls_dir) for node in topology.nodes]
    if with_gateway:
        specs.append(gateway_process(topology, python, tls_dir))
    return tuple(specs)
