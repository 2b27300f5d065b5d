"""deploy/Dockerfile's targets against each other and against the compose files: the CUDA ``node``
image is the ``node-cpu`` recipe on another base, so what the CPU deployment builds and runs
(tests/container) is what the GPU compose file would build, less the base."""

from __future__ import annotations

import re
from pathlib import Path

from deploy.compose import compose_dict, cpu_override_dict
from deploy.generate import DEFAULT_TOPOLOGY, DEPLOY_DIR
from deploy.podman import merge, podman_override_dict
from deploy.topology import load_topology

DOCKERFILE = DEPLOY_DIR / "Dockerfile"


def stages(path: Path = DOCKERFILE) -> dict[str, list[str]]:
    """Stage name → its instructions (continuation lines joined, comments dropped), FROM first."""
    joined = re.sub(r"\\\n", " ", path.read_text())
    result: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^FROM \S+ AS (\S+)$", line)
        if match:
            current = result.setdefault(match.group(1), [])
        if current is not None:
            current.append(re.sub(r"\s+", " ", line))
    return result


def build_env(instructions: list[str]) -> set[str]:
    names: set[str] = set()
    for instruction in instructions:
        if instruction.startswith("ENV "):
            names |= set(re.findall(r"(PDSERVE_BUILD_\w+)=", instruction))
    return names


def test_node_and_node_cpu_share_every_instruction_but_their_base() -> None:
    all_stages = stages()
    node, node_cpu = all_stages["node"], all_stages["node-cpu"]
    assert node[0] == "FROM node-base AS node"
    assert node_cpu[0] == "FROM node-cpu-base AS node-cpu"
    assert node[1:] == node_cpu[1:]
    assert any("pip install" in i for i in node[1:]), "the shared recipe installs the project"


def test_both_bases_define_everything_the_shared_recipe_reads() -> None:
    all_stages = stages()
    used = set(re.findall(r"PDSERVE_BUILD_\w+", " ".join(all_stages["node"])))
    assert used
    assert build_env(all_stages["node-base"]) == used
    assert build_env(all_stages["node-cpu-base"]) == used
    assert all_stages["node-base"][0] == "FROM ${CUDA_IMAGE} AS node-base"
    assert all_stages["node-cpu-base"][0] == "FROM ${PYTHON_IMAGE} AS node-cpu-base"


def test_every_image_the_compose_files_build_is_a_dockerfile_target() -> None:
    topology = load_topology(DEFAULT_TOPOLOGY)
    gpu = compose_dict(topology)["services"]
    cpu = merge(merge(compose_dict(topology), cpu_override_dict(topology)),
                podman_override_dict(topology))["services"]  # fmt: skip
    targets = set(stages())
    for services in (gpu, cpu):
        for name, service in services.items():
            assert "build" in service, f"{name}: every image is built here, none pulled"
            assert service["build"]["target"] in targets, name
    for node in topology.nodes:
        assert gpu[node.name]["build"]["target"] == "node"
        assert cpu[node.name]["build"]["target"] == "node-cpu"
    assert gpu["envoy"]["build"]["target"] == cpu["envoy"]["build"]["target"] == "envoy"


def test_the_local_python_base_matches_the_default_one() -> None:
    """deploy/base stands in for python:3.11-slim-bookworm: same Debian release and Python."""
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim-bookworm$", text, re.M)
    containerfile = (DEPLOY_DIR / "base" / "python.Containerfile").read_text()
    assert "(3, 11)" in containerfile and "bookworm" in containerfile
