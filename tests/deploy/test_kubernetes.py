"""The generated Kubernetes manifests (``deploy/k8s``): committed as generated, valid against the
Kubernetes OpenAPI schema of a pinned version in strict mode (unknown fields fail), and carrying
what a cluster deployment needs: GPUs, gRPC probes, drain-safe grace periods, discovery, and
configuration from ConfigMaps and Secrets. No cluster is needed."""

from __future__ import annotations

import dataclasses

import kubernetes_validate
import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2

# Imported for their side effect: the typed_config "@type" URLs resolve to these messages.
from envoy.extensions.access_loggers.stream.v3 import stream_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: F401
    http_connection_manager_pb2,
)
from envoy.extensions.resource_monitors.downstream_connections.v3 import (  # noqa: F401
    downstream_connections_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format

from deploy.generate import DEFAULT_TOPOLOGY, K8S_DIR, render_k8s
from deploy.kubernetes import API_KEYS_SECRET, TLS_MOUNT, k8s_files
from deploy.topology import KubernetesSpec, Topology, load_topology, topology_from_dict
from gateway.config import parse_gateway_config

# The oldest Kubernetes still in upstream support when this was written; gRPC probes (GA 1.27),
# autoscaling/v2 and policy/v1 are all in it.
KUBERNETES_VERSION = "1.32.0"


def documents(files: dict[str, str]) -> list[dict]:
    return [doc for text in files.values() for doc in yaml.safe_load_all(text)]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


@pytest.fixture(scope="module")
def topology() -> Topology:
    return load_topology(DEFAULT_TOPOLOGY)


@pytest.fixture(scope="module")
def committed() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(K8S_DIR.glob("*.yaml"))}


@pytest.fixture(scope="module")
def docs(committed) -> list[dict]:
    return documents(committed)


def container(workload: dict) -> dict:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env_of(docs: list[dict], workload: dict) -> dict[str, str]:
    """The container's environment as the kubelet would assemble it from its ConfigMaps."""
    maps = by_kind(docs, "ConfigMap")
    spec = container(workload)
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for item in spec.get("env", []):
        env[item["name"]] = item.get("value", item.get("valueFrom"))
    return env


def test_the_committed_files_are_what_the_topology_generates(committed, topology) -> None:
    assert committed == render_k8s(topology, source=DEFAULT_TOPOLOGY), (
        "run: python -m deploy.generate"
    )


def test_every_resource_is_valid_in_strict_mode(docs) -> None:
    assert len(docs) >= 10
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_strict_validation_catches_a_misspelt_field(docs) -> None:
    statefulset = dict(by_kind(docs, "StatefulSet")["decode"])
    broken = {**statefulset, "spec": {**statefulset["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_every_resource_lives_in_the_namespace(docs, topology) -> None:
    namespaces = by_kind(docs, "Namespace")
    assert list(namespaces) == [topology.kubernetes.namespace]
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == topology.kubernetes.namespace


def test_each_role_is_a_statefulset_of_one_gpu_pods_behind_a_headless_service(
    docs, topology
) -> None:
    statefulsets = by_kind(docs, "StatefulSet")
    services = by_kind(docs, "Service")
    assert set(statefulsets) == {"prefill", "decode"}
    for role, statefulset in statefulsets.items():
        group = getattr(topology, role)
        spec = statefulset["spec"]
        assert spec["replicas"] == group.count
        assert spec["serviceName"] == role
        node = container(statefulset)
        assert node["resources"]["limits"] == {"nvidia.com/gpu": 1}
        assert node["command"] == ["python", "-m", group.role.module]
        env = env_of(docs, statefulset)
        # The pod name (prefill-0, ...) is the node id.
        assert env["PDSERVE_NODE_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["PDSERVE_ROLE"] == role and env["PDSERVE_DEVICE"] == "cuda"
        assert env["PDSERVE_HOST"] == "0.0.0.0"
        # A pair's pods may be on two hosts: the KV transport is chosen for a cluster.
        assert env["PDSERVE_KV_SCOPE"] == "cluster"
        port = group.first_grpc_port
        assert env["PDSERVE_GRPC_PORT"] == str(port)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert node[probe]["grpc"] == {"port": port}, probe
        # The drain outlasts neither the kubelet's patience nor the liveness probe's.
        grace = float(env["PDSERVE_DRAIN_GRACE_S"])
        pod = spec["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > grace
        liveness = node["livenessProbe"]
        assert (
            liveness["periodSeconds"] * liveness["failureThreshold"]
            > (pod["terminationGracePeriodSeconds"])
        )
        service = services[role]["spec"]
        assert service["clusterIP"] == "None" and not service["publishNotReadyAddresses"]
        assert service["selector"] == spec["selector"]["matchLabels"]
        assert spec["template"]["metadata"]["labels"] == service["selector"]
        assert service["ports"][0]["port"] == port
        budget = by_kind(docs, "PodDisruptionBudget")[role]["spec"]
        assert budget["selector"] == spec["selector"] and budget["maxUnavailable"] == 1


def test_the_gateway_discovers_nodes_through_their_services(docs, topology, tmp_path) -> None:
    gateway = by_kind(docs, "Deployment")["gateway"]
    env = env_of(docs, gateway)
    assert env["PDSERVE_PREFILL"] == "dns:///prefill.pdserve.svc.cluster.local:50061"
    assert env["PDSERVE_DECODE"] == "dns:///decode.pdserve.svc.cluster.local:50071"
    assert env["PDSERVE_API_KEYS"] == {"secretKeyRef": {"name": API_KEYS_SECRET, "key": "api-keys"}}
    # The gateway itself accepts the environment the manifest gives it.
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 128}')
    plain = {k: v for k, v in env.items() if isinstance(v, str)}
    config = parse_gateway_config([], {**plain, "PDSERVE_MODEL": str(tmp_path)})
    assert config.router.prefill == ("dns:///prefill.pdserve.svc.cluster.local:50061",)
    assert config.router.decode == ("dns:///decode.pdserve.svc.cluster.local:50071",)
    assert config.http_port == topology.gateway.http_port


def test_the_gateway_has_a_budget_and_scales_on_queue_depth(docs, topology) -> None:
    deployment = by_kind(docs, "Deployment")["gateway"]
    labels = deployment["spec"]["selector"]["matchLabels"]
    budget = by_kind(docs, "PodDisruptionBudget")["gateway"]["spec"]
    assert budget["selector"]["matchLabels"] == labels
    autoscaler = by_kind(docs, "HorizontalPodAutoscaler")["gateway"]["spec"]
    assert autoscaler["scaleTargetRef"]["name"] == "gateway"
    assert autoscaler["minReplicas"] == topology.gateway.replicas
    (metric,) = autoscaler["metrics"]
    assert metric["pods"]["metric"]["name"] == "pdserve_num_requests_waiting"
    # Readiness follows /health (a pair is healthy); liveness never restarts a gateway merely
    # because its nodes are down.
    gateway = container(deployment)
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in gateway["livenessProbe"]
    service = by_kind(docs, "Service")["gateway"]["spec"]
    assert service["clusterIP"] == "None"  # Envoy resolves every replica


def test_envoy_runs_the_generated_config_against_the_gateway_service(docs, topology) -> None:
    deployment = by_kind(docs, "Deployment")["envoy"]
    envoy = container(deployment)
    assert envoy["image"] == topology.envoy.image
    assert envoy["args"][:2] == ["--config-path", "/etc/envoy/envoy.yaml"]
    config = by_kind(docs, "ConfigMap")["envoy-config"]["data"]["envoy.yaml"]
    bootstrap = json_format.ParseDict(
        yaml.safe_load(config), bootstrap_pb2.Bootstrap(), ignore_unknown_fields=False
    )
    for cluster in bootstrap.static_resources.clusters:
        (locality,) = cluster.load_assignment.endpoints
        (endpoint,) = locality.lb_endpoints
        address = endpoint.endpoint.address.socket_address
        assert address.address == "gateway.pdserve.svc.cluster.local"
        assert address.port_value in (topology.gateway.http_port, topology.gateway.grpc_port)
    assert by_kind(docs, "Service")["envoy"]["spec"]["type"] == "LoadBalancer"


def test_every_referenced_config_map_is_generated(docs) -> None:
    maps = by_kind(docs, "ConfigMap")
    for doc in docs:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        for source in container(doc).get("envFrom", []):
            assert source["configMapRef"]["name"] in maps
        for volume in pod["volumes"]:
            if "configMap" in volume:
                assert volume["configMap"]["name"] in maps


def test_tls_mounts_a_secret_per_role_only_when_the_topology_asks(topology) -> None:
    plain = documents(render_k8s(topology, source="t.yaml"))
    for doc in plain:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            assert not any(v["name"] == "tls" for v in doc["spec"]["template"]["spec"]["volumes"])
            env = container(doc).get("env", [])
            assert not any(e["name"].startswith("PDSERVE_TLS") for e in env)

    tls = dataclasses.replace(topology, kubernetes=KubernetesSpec(tls=True))
    docs = documents(render_k8s(tls, source="t.yaml"))
    workloads = {**by_kind(docs, "StatefulSet"), "gateway": by_kind(docs, "Deployment")["gateway"]}
    for name, workload in workloads.items():
        kubernetes_validate.validate(workload, KUBERNETES_VERSION, strict=True)
        pod = workload["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == f"pdserve-tls-{name}"
        (mount,) = [m for m in container(workload)["volumeMounts"] if m["name"] == "tls"]
        assert mount["mountPath"] == TLS_MOUNT and mount["readOnly"]
        env = {e["name"]: e.get("value") for e in container(workload)["env"]}
        assert env["PDSERVE_TLS_CERT"] == f"{TLS_MOUNT}/tls.crt"
        assert env["PDSERVE_TLS_KEY"] == f"{TLS_MOUNT}/tls.key"
        assert env["PDSERVE_TLS_CA"] == f"{TLS_MOUNT}/ca.crt"
    # The kubelet's gRPC probe cannot present a client certificate: the nodes probe with
    # deploy.probe, which reads PDSERVE_TLS_*; without TLS they keep the built-in probe.
    for name, workload in by_kind(docs, "StatefulSet").items():
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container(workload)[probe]["exec"]["command"]
            port = container(workload)["ports"][0]["containerPort"]
            assert command[:5] == ["python", "-m", "deploy.probe", "grpc", f"127.0.0.1:{port}"]
            assert "grpc" not in container(workload)[probe]
        assert "grpc" in container(by_kind(plain, "StatefulSet")[name])["readinessProbe"]


def test_a_cpu_topology_with_colocated_nodes_asks_for_no_gpu() -> None:
    topology = topology_from_dict(
        {"prefill": {"count": 0}, "decode": {"count": 0}, "colocated": {"count": 3}}
    )
    files = k8s_files(topology, "{}")
    assert "10-colocated.yaml" in files and "10-prefill.yaml" not in files
    docs = [doc for resources in files.values() for doc in resources]
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    colocated = by_kind(docs, "StatefulSet")["colocated"]
    assert colocated["spec"]["replicas"] == 3
    assert "resources" not in container(colocated)
    assert env_of(docs, colocated)["PDSERVE_DEVICE"] == "cpu"
    gateway_env = env_of(docs, by_kind(docs, "Deployment")["gateway"])
    assert gateway_env["PDSERVE_COLOCATED"] == "dns:///colocated.pdserve.svc.cluster.local:50081"
    assert "PDSERVE_PREFILL" not in gateway_env


def test_kubernetes_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="namespace"):
        topology_from_dict({"kubernetes": {"namespace": "Not_A_Label"}})
    with pytest.raises(ValueError, match="unknown key"):
        topology_from_dict({"kubernetes": {"replicas": 3}})
    with pytest.raises(ValueError, match="gateway_max_replicas"):
        topology_from_dict({"gateway": {"replicas": 4}, "kubernetes": {"gateway_max_replicas": 2}})
