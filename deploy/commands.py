"""The processes a topology runs on one machine: argv, environment and health targets of each
node and of the gateway, as the local launcher starts them.

Nodes with a GPU pin run on ``cuda:<id>``, the others on the CPU. Everything binds
``topology.host``; peers are reached at the same host (127.0.0.1 when it binds 0.0.0.0).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from deploy.health import GrpcHealth, HealthTarget, HttpHealth
from deploy.topology import EnvVars, FlagArgs, NodeInstance, Role, Topology


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    """Log prefix and id: ``prefill-0``, ``gateway``."""
    argv: tuple[str, ...]
    env: EnvVars
    """Set on top of the launcher's own environment."""
    health: tuple[HealthTarget, ...]
    """All must pass before the process counts as up."""


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


def node_process(topology: Topology, node: NodeInstance, python: str) -> ProcessSpec:
    group = topology.group(node.role)
    device = "cpu" if node.gpu_id is None else f"cuda:{node.gpu_id}"
    argv = [
        python, "-m", node.role.module,
        "--role", str(node.role),
        "--model", topology.model,
        "--dtype", topology.dtype,
        "--device", device,
        "--host", topology.host,
        "--grpc-port", str(node.grpc_port),
        "--kv-transport", topology.kv_transport,
        "--node-id", node.name,
    ]  # fmt: skip
    if node.metrics_port is not None:
        argv += ["--metrics-port", str(node.metrics_port)]
    argv += flag_argv(group.args)
    address = f"{connect_host(topology)}:{node.grpc_port}"
    return ProcessSpec(node.name, tuple(argv), group.env, (GrpcHealth(address),))


def node_addresses(topology: Topology, role: Role) -> list[str]:
    host = connect_host(topology)
    return [f"{host}:{node.grpc_port}" for node in topology.group(role).instances]


def gateway_process(topology: Topology, python: str) -> ProcessSpec:
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
    argv += flag_argv(gateway.args)
    host = connect_host(topology)
    health = (
        HttpHealth(f"http://{host}:{gateway.http_port}/health"),
        GrpcHealth(f"{host}:{gateway.grpc_port}"),
    )
    return ProcessSpec("gateway", tuple(argv), gateway.env, health)


def local_processes(
    topology: Topology, *, with_gateway: bool = True, python: str = sys.executable
) -> tuple[ProcessSpec, ...]:
    """Nodes first, then the gateway (it stops first: see ``Supervisor.stop``)."""
    specs = [node_process(topology, node, python) for node in topology.nodes]
    if with_gateway:
        specs.append(gateway_process(topology, python))
    return tuple(specs)
