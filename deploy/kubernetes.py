"""The Kubernetes manifests of a topology (``deploy/k8s/``): the same nodes, gateway and Envoy as
the compose file, spread over a cluster.

What each piece is, and why:

- **Nodes**: one StatefulSet per role, ``count`` pods of one GPU each (``nvidia.com/gpu: 1``
  when the topology pins GPUs). The stable pod name (``prefill-0``) is the node id. Each pod
  listens on its role's base port: pods have their own IPs, so they need no port offsets. The
  kubelet's gRPC probes ask grpc.health.v1, the same check ``deploy.probe`` makes under compose:
  a startup probe while the model loads, then readiness and liveness. A node that drains says
  NOT_SERVING, so its readiness fails and it leaves its headless Service's DNS answer, which the
  gateway re-reads (``dns:///`` node lists) and retires it; the liveness threshold outlasts the
  drain so the kubelet does not kill a draining node early, and
  ``terminationGracePeriodSeconds`` is the drain grace plus a margin.
- **Headless Services** (``clusterIP: None``) per role: one DNS A record per ready pod, the
  gateway's node discovery. A PodDisruptionBudget per role lets a host drain evict one node of
  the role at a time.
- **Gateway**: a Deployment behind a headless Service (Envoy's ``STRICT_DNS`` cluster resolves
  it to every replica and health-checks each), a PodDisruptionBudget, and a
  HorizontalPodAutoscaler on queued requests per replica (``pdserve:num_requests_waiting``,
  which the cluster's custom-metrics adapter must expose as ``pdserve_num_requests_waiting``).
  Readiness is ``GET /health`` (200 while a prefill+decode pair is healthy); liveness is a TCP
  connect, because a gateway whose nodes are all down is alive and must not be restarted.
- **Envoy**: a Deployment with the generated bootstrap in a ConfigMap, behind a LoadBalancer
  Service: the public edge.
- **Configuration**: the ``PDSERVE_*`` variables in one ConfigMap per role, built from
  ``deploy/env/<role>.env`` and the topology (the same sources as compose); API keys from the
  Secret ``pdserve-api-keys`` (key ``api-keys``), which the operator creates. With
  ``kubernetes.tls`` every pod also mounts Secret ``pdserve-tls-<role>``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from deploy.compose import ENV_FILES, flag_env, kv_cache_dtype_env, lora_env
from deploy.envoy.config import envoy_bootstrap
from deploy.topology import NodeGroup, Role, Topology

DEPLOY_DIR = Path(__file__).parent
MODEL_MOUNT = "/models"
TLS_MOUNT = "/etc/pdserve/tls"
API_KEYS_SECRET = "pdserve-api-keys"
API_KEYS_KEY = "api-keys"
QUEUE_METRIC = "pdserve_num_requests_waiting"
DEFAULT_DRAIN_GRACE_S = 30.0
# Seconds the kubelet waits beyond a node's drain grace before SIGKILL: the gRPC server's own
# stop and the process exit.
TERMINATION_MARGIN_S = 15
# Loading a model (and compiling kernels) precedes the first SERVING: as compose's start_period.
STARTUP_BUDGET_S = 600
PROBE_PERIOD_S = 5
LIVENESS_PERIOD_S = 10
GATEWAY_GRACE_S = 45
ENVOY_REPLICAS = 2
"""Two, so that a rolling update or a lost host never leaves the edge empty."""


def labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": component}


def metadata(topology: Topology, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": topology.kubernetes.namespace, "labels": labels(component)}


def service_host(topology: Topology, service: str) -> str:
    return f"{service}.{topology.kubernetes.namespace}.svc.cluster.local"


def env_file(component: str) -> dict[str, str]:
    """``KEY=VALUE`` lines of ``deploy/env/<role>.env``; comments and blanks skipped."""
    values: dict[str, str] = {}
    for line in (DEPLOY_DIR / ENV_FILES[component]).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


def quantity(size: str) -> str:
    """A compose size (``16gb``, ``512m``) as a Kubernetes quantity (``16Gi``, ``512Mi``)."""
    match = re.fullmatch(r"(\d+)\s*([kmgt]?)i?b?", size.strip().lower())
    if match is None:
        raise ValueError(f"shm_size {size!r} is not a size like 16gb")
    number, unit = match.groups()
    return number + (unit.upper() + "i" if unit else "")


def drain_grace_s(group: NodeGroup, config: dict[str, str]) -> float:
    for flag, value in group.args:
        if flag == "drain-grace-s":
            return float(value)
    return float(config.get("PDSERVE_DRAIN_GRACE_S", DEFAULT_DRAIN_GRACE_S))


def namespace(topology: Topology) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": topology.kubernetes.namespace, "labels": labels("namespace")},
    }


def config_map(topology: Topology, component: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(topology, f"pdserve-{component}-env", component),
        "data": data,
    }


def node_config(topology: Topology, group: NodeGroup) -> dict[str, str]:
    """Every node of the role shares it; per-pod values (the node id) come from the pod."""
    config = env_file(str(group.role))
    config.update(
        {
            "PDSERVE_HOST": "0.0.0.0",  # a pod's own network: reachable on its pod IP
            "PDSERVE_ROLE": str(group.role),
            "PDSERVE_MODEL": topology.model,
            "PDSERVE_DTYPE": topology.dtype,
            # Only when set: the committed files stay those of the default (auto).
            **kv_cache_dtype_env(topology),
            **lora_env(topology, with_paths=True),
            "PDSERVE_DEVICE": "cuda" if group.gpu_ids else "cpu",
            "PDSERVE_KV_TRANSPORT": topology.kv_transport,
            # Pods of a pair may land on different hosts: auto must pick ucx, never shm or
            # cuda_ipc, which need one host (and one PID namespace).
            "PDSERVE_KV_SCOPE": "cluster",
            "PDSERVE_GRPC_PORT": str(group.first_grpc_port),
        }
    )
    if group.base_metrics_port is not None:
        config["PDSERVE_METRICS_PORT"] = str(group.base_metrics_port)
    config.update(flag_env(group.args))
    config.update(dict(group.env))
    return config


def discovery_address(topology: Topology, role: Role) -> str:
    """The gateway re-resolves this every health interval: one node per ready pod."""
    group = topology.group(role)
    return f"dns:///{service_host(topology, str(role))}:{group.first_grpc_port}"


def gateway_config(topology: Topology) -> dict[str, str]:
    gateway = topology.gateway
    config = env_file("gateway")
    config.update(
        {
            "PDSERVE_HOST": "0.0.0.0",
            "PDSERVE_MODEL": topology.model,
            "PDSERVE_SERVED_MODEL_NAME": topology.model_name,
            "PDSERVE_HTTP_PORT": str(gateway.http_port),
            "PDSERVE_GRPC_PORT": str(gateway.grpc_port),
            **lora_env(topology, with_paths=False),
        }
    )
    for role in Role:
        if topology.group(role).count:
            config[f"PDSERVE_{str(role).upper()}"] = discovery_address(topology, role)
    config.update(flag_env(gateway.args))
    config.update(dict(gateway.env))
    return config


def grpc_probe(port: int, period_s: int, failures: int, tls: bool = False) -> dict[str, Any]:
    """The kubelet's own gRPC probe cannot present a client certificate: under mutual TLS the
    pod runs ``deploy.probe``, which reads the pod's ``PDSERVE_TLS_*``."""
    check: dict[str, Any] = {"grpc": {"port": port}}
    if tls:
        argv = ["python", "-m", "deploy.probe", "grpc", f"127.0.0.1:{port}", "--timeout-s", "4"]
        check = {"exec": {"command": argv}}
    return {
        **check,
        "periodSeconds": period_s,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def tls_parts(
    topology: Topology, component: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(env, volume mounts, volumes) for the pod's certificate, when the topology asks."""
    if not topology.kubernetes.tls:
        return [], [], []
    env = [
        {"name": f"PDSERVE_TLS_{name}", "value": f"{TLS_MOUNT}/{file}"}
        for name, file in (("CERT", "tls.crt"), ("KEY", "tls.key"), ("CA", "ca.crt"))
    ]
    mounts = [{"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True}]
    volumes = [{"name": "tls", "secret": {"secretName": f"pdserve-tls-{component}"}}]
    return env, mounts, volumes


def models_volume(topology: Topology) -> dict[str, Any]:
    return {
        "name": "models",
        "persistentVolumeClaim": {"claimName": topology.kubernetes.models_claim, "readOnly": True},
    }


def node_manifests(topology: Topology, group: NodeGroup) -> list[dict[str, Any]]:
    role = str(group.role)
    config = node_config(topology, group)
    port = group.first_grpc_port
    grace_s = drain_grace_s(group, config)
    tls_env, tls_mounts, tls_volumes = tls_parts(topology, role)
    ports = [{"name": "grpc", "containerPort": port}]
    if group.base_metrics_port is not None:
        ports.append({"name": "metrics", "containerPort": group.base_metrics_port})
    container: dict[str, Any] = {
        "name": "node",
        "image": f"{topology.image}-node",
        "command": ["python", "-m", group.role.module],
        "envFrom": [{"configMapRef": {"name": f"pdserve-{role}-env"}}],
        "env": [
            {"name": "PDSERVE_NODE_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            *tls_env,
        ],
        "ports": ports,
        "startupProbe": grpc_probe(
            port, PROBE_PERIOD_S, STARTUP_BUDGET_S // PROBE_PERIOD_S, topology.kubernetes.tls
        ),
        "readinessProbe": grpc_probe(port, PROBE_PERIOD_S, 2, topology.kubernetes.tls),
        # A draining node says NOT_SERVING on purpose: liveness tolerates that for longer
        # than the whole termination grace, so only a node that stays wedged is restarted.
        "livenessProbe": grpc_probe(
            port,
            LIVENESS_PERIOD_S,
            math.ceil((grace_s + TERMINATION_MARGIN_S) / LIVENESS_PERIOD_S) + 1,
            topology.kubernetes.tls,
        ),
        "volumeMounts": [
            {"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            *tls_mounts,
        ],
        # UCX registers (pins) the KV cache; RDMA NICs need to lock memory.
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
    }
    if group.gpu_ids:
        container["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    pod_labels = labels(role)
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(topology, role, role),
        "spec": {
            "serviceName": role,
            "replicas": group.count,
            # Nodes are independent: start and replace them all at once, not one by one.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "terminationGracePeriodSeconds": int(grace_s) + TERMINATION_MARGIN_S,
                    "containers": [container],
                    "volumes": [
                        models_volume(topology),
                        {
                            "name": "dshm",
                            "emptyDir": {
                                "medium": "Memory",
                                "sizeLimit": quantity(topology.shm_size),
                            },
                        },
                        *tls_volumes,
                    ],  # fmt: skip
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(topology, role, role),
        "spec": {
            "clusterIP": "None",
            # Only ready pods are in DNS: a draining or loading node is not discovered.
            "publishNotReadyAddresses": False,
            "selector": pod_labels,
            "ports": [{"name": "grpc", "port": port, "targetPort": "grpc"}],
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(topology, role, role),
        # A host drain takes one node of the role at a time; the others keep serving.
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pod_labels}},
    }
    return [config_map(topology, role, config), service, statefulset, budget]


def gateway_manifests(topology: Topology) -> list[dict[str, Any]]:
    gateway = topology.gateway
    spec = topology.kubernetes
    tls_env, tls_mounts, tls_volumes = tls_parts(topology, "gateway")
    pod_labels = labels("gateway")
    container = {
        "name": "gateway",
        "image": f"{topology.image}-gateway",
        "command": ["python", "-m", "gateway"],
        "envFrom": [{"configMapRef": {"name": "pdserve-gateway-env"}}],
        "env": [
            {
                "name": "PDSERVE_API_KEYS",
                "valueFrom": {"secretKeyRef": {"name": API_KEYS_SECRET, "key": API_KEYS_KEY}},
            },
            *tls_env,
        ],
        "ports": [
            {"name": "http", "containerPort": gateway.http_port},
            {"name": "grpc", "containerPort": gateway.grpc_port},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": LIVENESS_PERIOD_S,
            "failureThreshold": 3,
        },
        # The tokenizer, chat template and config.json; the gateway reads no weights.
        "volumeMounts": [
            {"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True},
            *tls_mounts,
        ],  # fmt: skip
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(topology, "gateway", "gateway"),
        # No replicas: the autoscaler owns the count (an apply would reset it otherwise).
        "spec": {
            "selector": {"matchLabels": pod_labels},
            "strategy": {"rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "terminationGracePeriodSeconds": GATEWAY_GRACE_S,
                    "containers": [container],
                    "volumes": [models_volume(topology), *tls_volumes],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(topology, "gateway", "gateway"),
        # Headless: Envoy resolves every replica and balances and health-checks each itself.
        "spec": {
            "clusterIP": "None",
            "selector": pod_labels,
            "ports": [
                {"name": "http", "port": gateway.http_port, "targetPort": "http"},
                {"name": "grpc", "port": gateway.grpc_port, "targetPort": "grpc"},
            ],
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(topology, "gateway", "gateway"),
        # One at a time: a voluntary eviction never takes several replicas down together,
        # yet a single-replica gateway can still be moved off a host being drained.
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pod_labels}},
    }
    autoscaler = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(topology, "gateway", "gateway"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"},
            "minReplicas": gateway.replicas,
            "maxReplicas": spec.gateway_max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": QUEUE_METRIC},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": str(spec.gateway_queue_target),
                        },
                    },
                }
            ],
            # Queues swing with bursts; shrink only after a calm spell.
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }
    return [config_map(topology, "gateway", gateway_config(topology)), service, deployment,
            budget, autoscaler]  # fmt: skip


def envoy_config(topology: Topology) -> dict[str, Any]:
    """The bootstrap with one upstream name: the gateway's headless Service, which resolves to
    every replica on the same ports (no per-replica port offsets as under compose)."""
    single = dataclasses.replace(
        topology, gateway=dataclasses.replace(topology.gateway, replicas=1)
    )
    return envoy_bootstrap(single, upstream_host=service_host(topology, "gateway"))


def envoy_manifests(topology: Topology, envoy_yaml: str) -> list[dict[str, Any]]:
    envoy = topology.envoy
    pod_labels = labels("envoy")
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(topology, "envoy-config", "envoy"),
        "data": {"envoy.yaml": envoy_yaml},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(topology, "envoy", "envoy"),
        "spec": {
            "replicas": ENVOY_REPLICAS,
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "containers": [
                        {
                            "name": "envoy",
                            "image": envoy.image,
                            "args": [
                                "--config-path",
                                "/etc/envoy/envoy.yaml",
                                "--log-level",
                                "info",
                            ],  # fmt: skip
                            "ports": [
                                {"name": "http", "containerPort": envoy.http_port},
                                {"name": "grpc", "containerPort": envoy.grpc_port},
                            ],
                            # The admin interface (with /ready) is bound to 127.0.0.1 only.
                            "readinessProbe": {
                                "tcpSocket": {"port": "http"},
                                "periodSeconds": PROBE_PERIOD_S,
                            },
                            "volumeMounts": [
                                {"name": "config", "mountPath": "/etc/envoy", "readOnly": True}
                            ],
                        }
                    ],
                    "volumes": [{"name": "config", "configMap": {"name": "envoy-config"}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(topology, "envoy", "envoy"),
        "spec": {
            "type": "LoadBalancer",
            "selector": pod_labels,
            "ports": [
                {"name": "http", "port": envoy.http_port, "targetPort": "http"},
                {"name": "grpc", "port": envoy.grpc_port, "targetPort": "grpc"},
            ],
        },
    }
    return [config, service, deployment]


def k8s_files(topology: Topology, envoy_yaml: str) -> dict[str, list[dict[str, Any]]]:
    """File name → its resources. Numbered so ``kubectl apply -f deploy/k8s/`` creates the
    namespace first."""
    files: dict[str, list[dict[str, Any]]] = {"00-namespace.yaml": [namespace(topology)]}
    for role in Role:
        group = topology.group(role)
        if group.count:
            files[f"10-{role}.yaml"] = node_manifests(topology, group)
    files["20-gateway.yaml"] = gateway_manifests(topology)
    files["30-envoy.yaml"] = envoy_manifests(topology, envoy_yaml)
    return files
