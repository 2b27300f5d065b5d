"""What runs where: the one description the local launcher, the compose generator and the Envoy
generator all read, so node counts, ports and GPU pins are written in one place.

A topology file is YAML (``deploy/topology.example.yaml`` documents every key)::

    model: models/tiny-llama
    prefill: {count: 2, gpu_ids: [0, 1]}
    decode: {count: 2, gpu_ids: [2, 3], args: {max-num-seqs: 128}}

Every key is optional; an unknown key, a key given twice, or a value of the wrong type is an
error naming it. ``Topology`` and its parts are frozen and validated on construction;
``Topology.nodes`` derives the node instances (``prefill-0`` on ``base_grpc_port``,
``prefill-1`` on ``base_grpc_port + 1``, ...).

The flags the launcher and compose derive from the topology (ports, host, model, dtypes,
device, peers, TLS files) may not be set again through ``args``: the launcher health-checks and
reports what it derived, so an override would make it wait on the wrong port or print the wrong
dtype. Each has its own topology key instead.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.types import Role as Role  # re-exported: deploy takes Role from here
from services.yaml_load import DuplicateKeyError, load_yaml

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = (*DTYPES, "fp8_e5m2")
"""fp8_e5m2: CPU nodes only (a topology with gpu_ids refuses it; so does a node started on a GPU,
naming the flag)."""
KV_TRANSPORTS = ("auto", "shm", "cuda_ipc", "ucx", "loopback")
_FLAG_NAME = re.compile(r"^[a-z][a-z0-9-]*$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")

# A flag and its value as argv pieces would carry them: ("max-num-seqs", "64"); a value of ""
# is a switch given alone (``no-prefix-caching: true`` in YAML).
FlagArgs = tuple[tuple[str, str], ...]
EnvVars = tuple[tuple[str, str], ...]


NODE_DERIVED_FLAGS = frozenset({
    "role", "model", "dtype", "kv-cache-dtype", "device", "host", "grpc-port", "metrics-port",
    "kv-transport", "node-id", "tls-cert", "tls-key", "tls-ca", "lora-modules",
})  # fmt: skip
"""Node flags the launcher (``deploy/commands.py``) and compose set from the topology."""
GATEWAY_DERIVED_FLAGS = frozenset({
    "model", "served-model-name", "host", "http-port", "grpc-port", *(str(r) for r in Role),
    "tls-cert", "tls-key", "tls-ca", "public-tls-cert", "public-tls-key", "lora-modules",
})  # fmt: skip
"""Gateway flags the launcher and compose set from the topology."""

DEFAULT_BASE_PORTS = {Role.PREFILL: 50061, Role.DECODE: 50071, Role.COLOCATED: 50081}
# A group left out of a topology, or given without a count: one prefill+decode pair.
DEFAULT_COUNTS = {Role.PREFILL: 1, Role.DECODE: 1, Role.COLOCATED: 0}


def _check_int(name: str, value: object) -> None:
    # bool is an int to Python, but `count: true` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def _check_port(name: str, port: object) -> None:
    _check_int(name, port)
    assert isinstance(port, int)
    if not 1 <= port <= 65535:
        raise ValueError(f"{name} must be in [1, 65535], got {port}")


def _check_flags(owner: str, args: FlagArgs, env: EnvVars, derived: frozenset[str]) -> None:
    for flag, _ in args:
        if not _FLAG_NAME.match(flag):
            raise ValueError(f"{owner}.args: {flag!r} is not a flag name like 'max-num-seqs'")
    # argparse takes a unique prefix for the whole flag (--http-p for --http-port): a prefix of
    # a derived flag overrides it just the same.
    overriding = sorted(flag for flag, _ in args if any(name.startswith(flag) for name in derived))
    if overriding:
        raise ValueError(
            f"{owner}.args may not set {overriding}: the topology derives them "
            f"({', '.join(sorted(derived))}); set its own key instead"
        )
    for name, _ in env:
        if not _ENV_NAME.match(name):
            raise ValueError(f"{owner}.env: {name!r} is not an environment variable name")


def _check_unique_ports(ports: list[tuple[str, int]]) -> None:
    owners: dict[int, str] = {}
    for owner, port in ports:
        if port in owners:
            raise ValueError(f"port {port} is used by both {owners[port]} and {owner}")
        owners[port] = owner


@dataclass(frozen=True)
class NodeInstance:
    """One node process (locally) or one container (compose)."""

    role: Role
    index: int
    grpc_port: int
    metrics_port: int | None
    gpu_id: int | None
    """The GPU this node is pinned to under compose; None runs it on the CPU."""

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclass(frozen=True)
class NodeGroup:
    """All nodes of one role: how many, their ports and GPUs, and extra flags."""

    role: Role
    count: int = 0
    base_grpc_port: int | None = None
    """Node i listens on base_grpc_port + i; None takes the role's default (50061, 50071,
    50081)."""
    base_metrics_port: int | None = None
    """Node i serves Prometheus metrics on base_metrics_port + i; None serves none."""
    gpu_ids: tuple[int, ...] = ()
    """One GPU per node, in node order (compose pins them); empty: the nodes run on the CPU."""
    args: FlagArgs = ()
    """Extra node flags, e.g. (("max-num-seqs", "64"),), passed to every node of the role."""
    env: EnvVars = ()

    def __post_init__(self) -> None:
        _check_int(f"{self.role}.count", self.count)
        if self.count < 0:
            raise ValueError(f"{self.role}.count must be >= 0, got {self.count}")
        _check_port(f"{self.role}.base_grpc_port", self.first_grpc_port)
        _check_port(f"{self.role}.last grpc port", self.first_grpc_port + max(self.count - 1, 0))
        if self.base_metrics_port is not None:
            _check_port(f"{self.role}.base_metrics_port", self.base_metrics_port)
            last = self.base_metrics_port + max(self.count - 1, 0)
            _check_port(f"{self.role}.last metrics port", last)
        if self.gpu_ids and len(self.gpu_ids) != self.count:
            raise ValueError(
                f"{self.role}.gpu_ids names {len(self.gpu_ids)} GPUs for {self.count} nodes; "
                "give one per node, or none for CPU"
            )
        for gpu in self.gpu_ids:
            _check_int(f"{self.role}.gpu_ids[]", gpu)
        if any(gpu < 0 for gpu in self.gpu_ids):
            raise ValueError(f"{self.role}.gpu_ids must be >= 0, got {list(self.gpu_ids)}")
        _check_flags(str(self.role), self.args, self.env, NODE_DERIVED_FLAGS)

    @property
    def first_grpc_port(self) -> int:
        if self.base_grpc_port is None:
            return DEFAULT_BASE_PORTS[self.role]
        return self.base_grpc_port

    @property
    def instances(self) -> tuple[NodeInstance, ...]:
        return tuple(
            NodeInstance(
                role=self.role,
                index=i,
                grpc_port=self.first_grpc_port + i,
                metrics_port=None if self.base_metrics_port is None else self.base_metrics_port + i,
                gpu_id=self.gpu_ids[i] if self.gpu_ids else None,
            )
            for i in range(self.count)
        )


def _default_group(role: Role) -> NodeGroup:
    return NodeGroup(role, count=DEFAULT_COUNTS[role])


@dataclass(frozen=True)
class GatewaySpec:
    http_port: int = 8000
    grpc_port: int = 50051
    replicas: int = 1
    """Gateway replicas under compose (stateless; Envoy balances them), replica i on
    http_port + i and grpc_port + i. The launcher runs one."""
    args: FlagArgs = ()
    """Extra gateway flags, e.g. (("max-concurrent-requests", "64"),)."""
    env: EnvVars = ()

    def __post_init__(self) -> None:
        _check_port("gateway.http_port", self.http_port)
        _check_port("gateway.grpc_port", self.grpc_port)
        _check_int("gateway.replicas", self.replicas)
        if self.replicas < 1:
            raise ValueError(f"gateway.replicas must be >= 1, got {self.replicas}")
        _check_flags("gateway", self.args, self.env, GATEWAY_DERIVED_FLAGS)


@dataclass(frozen=True)
class EnvoySpec:
    """The edge proxy of a compose deployment (the local launcher runs none)."""

    http_port: int = 8080
    """OpenAI HTTP/SSE API."""
    grpc_port: int = 8081
    """Public gRPC API (HTTP/2)."""
    admin_port: int = 9901
    """Admin interface, bound to 127.0.0.1 only."""
    image: str = "envoyproxy/envoy:v1.34.1"
    stream_idle_timeout_s: float = 300.0
    """A stream that moves no byte for this long is reset (a stuck generation, a dead client)."""
    max_requests: int = 1024
    """Circuit breaker: concurrent requests to all gateway replicas together."""
    tls: bool = False
    """Both listeners terminate TLS with ``deploy/certs/edge.crt`` and ``edge.key``."""

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "admin_port"):
            _check_port(f"envoy.{name}", getattr(self, name))
        _check_str("envoy.image", self.image)
        _check_bool("envoy.tls", self.tls)
        timeout = self.stream_idle_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ValueError(f"envoy.stream_idle_timeout_s must be a number, got {timeout!r}")
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError("envoy.stream_idle_timeout_s must be > 0")
        _check_int("envoy.max_requests", self.max_requests)
        if self.max_requests < 1:
            raise ValueError("envoy.max_requests must be >= 1")


@dataclass(frozen=True)
class KubernetesSpec:
    """The Kubernetes manifests' own settings (``deploy/k8s``; compose and the launcher ignore
    them)."""

    namespace: str = "pdserve"
    models_claim: str = "pdserve-models"
    """A PersistentVolumeClaim the operator creates, holding the model directories; mounted
    read-only at /models."""
    gateway_max_replicas: int = 8
    """The HorizontalPodAutoscaler's ceiling; its floor is ``gateway.replicas``."""
    gateway_queue_target: int = 16
    """Queued requests per gateway replica the autoscaler aims at."""
    tls: bool = False
    """Mount Secret ``pdserve-tls-<role>`` (tls.crt, tls.key, ca.crt) into every pod and point
    ``PDSERVE_TLS_CERT`` / ``_KEY`` / ``_CA`` at it."""

    def __post_init__(self) -> None:
        for name in ("namespace", "models_claim"):
            _check_str(f"kubernetes.{name}", getattr(self, name))
        for name in ("gateway_max_replicas", "gateway_queue_target"):
            _check_int(f"kubernetes.{name}", getattr(self, name))
        _check_bool("kubernetes.tls", self.tls)
        if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", self.namespace):
            raise ValueError(f"kubernetes.namespace {self.namespace!r} is not a DNS label")
        if not self.models_claim:
            raise ValueError("kubernetes.models_claim must name a PersistentVolumeClaim")
        if self.gateway_max_replicas < 1 or self.gateway_queue_target < 1:
            raise ValueError(
                "kubernetes.gateway_max_replicas and gateway_queue_target must be >= 1"
            )


@dataclass(frozen=True)
class Topology:
    model: str = "models/tiny-llama"
    """A Hugging Face model directory or a GGUF file: a host path locally, the path inside the
    model volume (``/models/<name>``) under compose."""
    served_model_name: str | None = None
    """The name clients send; default: the model directory's (or file's) name."""
    dtype: str = "auto"
    """auto: each node measures bfloat16 against float32 on its CPU (bfloat16 on CUDA)."""
    kv_cache_dtype: str = "auto"
    """The dtype every node's KV cache holds (prefill and decode must agree); auto: bfloat16 on
    CPU whatever the compute dtype, the compute dtype on CUDA."""
    kv_transport: str = "auto"
    """auto: every node of a topology runs on one host, so shm for host KV caches and cuda_ipc
    for GPU ones; ucx also works between processes; loopback only inside one process."""
    host: str = "127.0.0.1"
    """Where the launcher binds every server and where it connects to them."""
    image: str = "pdserve"
    """Compose: image name prefix (``pdserve-node``, ``pdserve-gateway``)."""
    model_volume: str = "${PDSERVE_MODELS_DIR:-../models}"
    """Compose: host directory (or named volume) mounted read-only at /models; relative paths
    are relative to deploy/."""
    shm_size: str = "16gb"
    """Compose: size of /dev/shm in the IPC namespace the nodes share (UCX shared memory)."""
    tls: bool = False
    """Compose: mutual TLS between the services, each with its certificate from
    ``deploy/certs/`` (``python -m deploy.certs --out deploy/certs --topology FILE``)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters (name, PEFT directory: a host path locally, under /models with compose)
    every node loads and the gateway serves under their names; a YAML mapping name: path."""
    prefill: NodeGroup = field(default_factory=lambda: _default_group(Role.PREFILL))
    decode: NodeGroup = field(default_factory=lambda: _default_group(Role.DECODE))
    colocated: NodeGroup = field(default_factory=lambda: _default_group(Role.COLOCATED))
    gateway: GatewaySpec = field(default_factory=GatewaySpec)
    envoy: EnvoySpec = field(default_factory=EnvoySpec)
    kubernetes: KubernetesSpec = field(default_factory=KubernetesSpec)

    def __post_init__(self) -> None:
        _check_bool("tls", self.tls)
        for name in ("model", "dtype", "kv_cache_dtype", "kv_transport", "host", "image",
                     "model_volume", "shm_size"):  # fmt: skip
            _check_str(name, getattr(self, name))
        if self.served_model_name is not None:
            _check_str("served_model_name", self.served_model_name)
        object.__setattr__(self, "lora_modules", tuple(tuple(m) for m in self.lora_modules))
        for name, path in self.lora_modules:
            # Both travel as one comma-separated PDSERVE_LORA_MODULES of NAME=PATH items.
            if not isinstance(name, str) or not name or any(c in name for c in "=, "):
                raise ValueError(
                    f"lora_modules: names must be non-empty strings without '=', ',' or spaces, "
                    f"got {name!r}"
                )
            if not isinstance(path, str) or not path or "," in path:
                raise ValueError(f"lora_modules.{name} must be a path without ',', got {path!r}")
        if not self.model:
            raise ValueError("model must name a model directory or a GGUF file")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "fp8_e5m2" and any(n.gpu_id is not None for n in self.nodes):
            raise ValueError("kv_cache_dtype fp8_e5m2 is supported on CPU nodes only (gpu_ids)")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(
                f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}"
            )
        if self.kv_transport == "loopback" and self.prefill.count:
            # Every deployment runs each node as its own process; loopback moves KV pages only
            # between objects of one process, so every request would fail at the KV push.
            raise ValueError(
                "kv_transport (--kv-transport) loopback works only inside one process, and "
                "prefill and decode nodes run as separate processes: use auto, shm, cuda_ipc "
                "or ucx"
            )
        for group, role in (
            (self.prefill, Role.PREFILL),
            (self.decode, Role.DECODE),
            (self.colocated, Role.COLOCATED),
        ):
            if group.role is not role:
                raise ValueError(f"the {role} group has role {group.role}")
        if (self.prefill.count == 0) != (self.decode.count == 0):
            raise ValueError(
                f"prefill and decode nodes come in pairs: got {self.prefill.count} prefill, "
                f"{self.decode.count} decode (use colocated nodes for a single-process node)"
            )
        if self.decode.count == 0 and self.colocated.count == 0:
            raise ValueError("no nodes: give prefill and decode counts, or a colocated count")
        _check_unique_ports(self.local_ports())
        if self.kubernetes.gateway_max_replicas < self.gateway.replicas:
            raise ValueError("kubernetes.gateway_max_replicas must be >= gateway.replicas")
        self._check_shared_gpus()

    def _check_shared_gpus(self) -> None:
        """Nodes may share a GPU (prefill and decode on one card) only with a KV cache size of
        their own: each would otherwise size its cache from the whole device, and the second to
        start would find the first one's memory gone."""
        sharing: dict[int, list[NodeInstance]] = {}
        for node in self.nodes:
            if node.gpu_id is not None:
                sharing.setdefault(node.gpu_id, []).append(node)
        for gpu, nodes in sharing.items():
            unsized = [
                n.name for n in nodes if "kv-cache-memory" not in dict(self.group(n.role).args)
            ]
            if len(nodes) > 1 and unsized:
                raise ValueError(
                    f"GPU {gpu} is pinned to {[n.name for n in nodes]}: nodes that share a GPU "
                    f"must each set args.kv-cache-memory ({unsized} do not)"
                )

    def local_ports(self) -> list[tuple[str, int]]:
        """(owner, port) of every port the local launcher binds: each node's, one gateway's.
        Every deployment binds these, so construction checks they differ."""
        ports = [("gateway-0 http", self.gateway.http_port),
                 ("gateway-0 grpc", self.gateway.grpc_port)]  # fmt: skip
        for node in self.nodes:
            ports.append((f"{node.name} grpc", node.grpc_port))
            if node.metrics_port is not None:
                ports.append((f"{node.name} metrics", node.metrics_port))
        return ports

    def check_compose_ports(self) -> None:
        """Under compose every service shares the host's network, so no two may share a port:
        Envoy's and every gateway replica's too, which the local launcher never binds."""
        ports = [(f"envoy {name}", getattr(self.envoy, f"{name}_port"))
                 for name in ("http", "grpc", "admin")]  # fmt: skip
        for i in range(1, self.gateway.replicas):
            ports += [(f"gateway-{i} http", self.gateway.http_port + i),
                      (f"gateway-{i} grpc", self.gateway.grpc_port + i)]  # fmt: skip
        _check_unique_ports(ports + self.local_ports())

    @property
    def nodes(self) -> tuple[NodeInstance, ...]:
        return self.prefill.instances + self.decode.instances + self.colocated.instances

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def lora_flag_values(self, *, with_paths: bool) -> list[str]:
        """``--lora-modules``' values: ``NAME=PATH`` for the nodes, ``NAME`` for the gateway."""
        return [f"{name}={path}" if with_paths else name for name, path in self.lora_modules]

    def group(self, role: Role) -> NodeGroup:
        return {
            Role.PREFILL: self.prefill,
            Role.DECODE: self.decode,
            Role.COLOCATED: self.colocated,
        }[role]

    def with_counts(
        self, *, prefill: int | None = None, decode: int | None = None, colocated: int | None = None
    ) -> Topology:
        """Another node count per role; GPU pins are dropped where the count changes."""
        changed: dict[str, Any] = {}  # Any: mypy matches ** against every field of replace()
        for role, count in (
            (Role.PREFILL, prefill),
            (Role.DECODE, decode),
            (Role.COLOCATED, colocated),
        ):
            group = self.group(role)
            if count is not None and count != group.count:
                changed[str(role)] = dataclasses.replace(group, count=count, gpu_ids=())
        return dataclasses.replace(self, **changed)


def load_topology(path: str | Path) -> Topology:
    """Reads a topology YAML file; errors name the file and the offending key."""
    text = Path(path).read_text()
    try:
        raw = load_yaml(text)
    except DuplicateKeyError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = "" if mark is None else f" (line {mark.line + 1})"
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ValueError(f"{path}: not valid YAML{where}: {problem}") from None
    try:
        return topology_from_dict(raw or {})
    except (ValueError, TypeError) as exc:  # TypeError: a shape no check above foresaw
        raise ValueError(f"{path}: {exc}") from exc


def topology_from_dict(raw: Mapping[str, Any]) -> Topology:
    if not isinstance(raw, Mapping):
        raise ValueError(f"a topology is a mapping, got {type(raw).__name__}")
    _check_keys("topology", raw, Topology)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("prefill", "decode", "colocated"):
            values[key] = _group_from_dict(Role(key), value or {})
        elif key == "gateway":
            values[key] = _spec_from_dict("gateway", GatewaySpec, value or {})
        elif key == "envoy":
            values[key] = _spec_from_dict("envoy", EnvoySpec, value or {})
        elif key == "kubernetes":
            values[key] = _spec_from_dict("kubernetes", KubernetesSpec, value or {})
        elif key == "lora_modules":
            if not isinstance(value or {}, Mapping):
                raise ValueError(f"lora_modules must be a mapping of name: path, got {value!r}")
            values[key] = tuple((value or {}).items())
        else:
            values[key] = _scalar(key, value)
    return Topology(**values)


def _group_from_dict(role: Role, raw: Mapping[str, Any]) -> NodeGroup:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{role}: expected a mapping, got {raw!r}")
    _check_keys(str(role), raw, NodeGroup, exclude=("role",))
    values = _spec_values(str(role), raw)
    values.setdefault("count", DEFAULT_COUNTS[role])
    if "gpu_ids" in values:
        gpu_ids = values["gpu_ids"]
        if not isinstance(gpu_ids, list) or not all(isinstance(g, int) for g in gpu_ids):
            raise ValueError(f"{role}.gpu_ids must be a list of GPU indexes, got {gpu_ids!r}")
        values["gpu_ids"] = tuple(gpu_ids)
    return NodeGroup(role=role, **values)


def _spec_from_dict(owner: str, cls: type, raw: Mapping[str, Any]) -> Any:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{owner}: expected a mapping, got {raw!r}")
    _check_keys(owner, raw, cls)
    return cls(**_spec_values(owner, raw))


def _spec_values(owner: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "args":
            values[key] = _flag_args(owner, value)
        elif key == "env":
            values[key] = _env_vars(owner, value)
        else:
            values[key] = value
    return values


def _flag_args(owner: str, raw: Any) -> FlagArgs:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{owner}.args must map flag names to values, got {raw!r}")
    pairs: list[tuple[str, str]] = []
    for flag, value in raw.items():
        if value is False or value is None:
            continue  # a switch that is off is simply not passed
        if isinstance(value, Mapping):
            # A flag that takes a JSON object (hf_overrides): the mapping as its JSON text.
            pairs.append((str(flag), json.dumps(value)))
            continue
        if isinstance(value, list):
            raise ValueError(f"{owner}.args.{flag} must be a single value, got {value!r}")
        pairs.append((str(flag), "" if value is True else str(value)))
    return tuple(pairs)


def _env_vars(owner: str, raw: Any) -> EnvVars:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{owner}.env must map variable names to values, got {raw!r}")
    pairs: list[tuple[str, str]] = []
    for name, value in raw.items():
        # An int is what it reads (OMP_NUM_THREADS: 2); anything else str() would turn into a
        # word the process never meant: an empty value into "None", yes into "True".
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            pairs.append((str(name), str(value)))
        else:
            raise ValueError(
                f'{owner}.env.{name} must be a string (quote it; "" for empty), got {value!r}'
            )
    return tuple(pairs)


def _scalar(key: str, value: Any) -> Any:
    if isinstance(value, Mapping | list):
        raise ValueError(f"topology.{key} must be a single value, got {value!r}")
    return value


def _check_keys(
    owner: str, raw: Mapping[str, Any], cls: type, exclude: tuple[str, ...] = ()
) -> None:
    known = {f.name for f in dataclasses.fields(cls)} - set(exclude)
    unknown = set(map(str, raw)) - known
    if unknown:
        raise ValueError(f"{owner}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
