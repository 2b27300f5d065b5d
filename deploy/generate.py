"""``python -m deploy.generate [--topology FILE]``: writes ``deploy/docker-compose.yml``, its CPU
override ``deploy/docker-compose.cpu.yml``, what podman needs besides them
(``deploy/docker-compose.podman.yml``, ``deploy/containers.podman.conf``),
``deploy/envoy/envoy.yaml`` and the Kubernetes manifests ``deploy/k8s/*.yaml`` from one
topology, so node counts, ports and GPU pins agree.

All of them are committed, generated from ``deploy/topology.yaml``; a test regenerates them and
fails when they differ, so a hand edit cannot drift from the topology unnoticed.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

import yaml

from deploy.compose import Reset, compose_dict, cpu_override_dict
from deploy.envoy.config import envoy_bootstrap
from deploy.kubernetes import envoy_config, k8s_files
from deploy.podman import containers_conf, podman_override_dict
from deploy.topology import Topology, load_topology

DEPLOY_DIR = Path(__file__).parent
DEFAULT_TOPOLOGY = DEPLOY_DIR / "topology.yaml"
COMPOSE_FILE = DEPLOY_DIR / "docker-compose.yml"
CPU_OVERRIDE_FILE = DEPLOY_DIR / "docker-compose.cpu.yml"
ENVOY_FILE = DEPLOY_DIR / "envoy" / "envoy.yaml"
PODMAN_OVERRIDE_FILE = DEPLOY_DIR / "docker-compose.podman.yml"
CONTAINERS_CONF_FILE = DEPLOY_DIR / "containers.podman.conf"
K8S_DIR = DEPLOY_DIR / "k8s"


class _Dumper(yaml.SafeDumper):
    """Writes a shared sub-dict out in full each time instead of as a YAML alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(Reset, lambda dumper, _: dumper.represent_mapping("!reset", {}))


def render_yaml(data: Any, *, source: Path | str) -> str:
    with contextlib.suppress(ValueError):  # outside the repository: keep the path as given
        source = Path(source).resolve().relative_to(DEPLOY_DIR.parent)
    header = f"# Generated from {source} by python -m deploy.generate; do not edit by hand.\n"
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    return header + body


def write_yaml(path: Path, data: Any, *, source: Path | str) -> None:
    path.write_text(render_yaml(data, source=source))


def render_k8s(topology: Topology, *, source: Path | str) -> dict[str, str]:
    """File name under deploy/k8s → its text: several YAML documents each."""
    envoy_yaml = render_yaml(envoy_config(topology), source=source)
    files = {}
    for name, resources in k8s_files(topology, envoy_yaml).items():
        documents = [render_yaml(resource, source=source) for resource in resources]
        header, _, _ = documents[0].partition("\n")
        files[name] = header + "\n" + "---\n".join(d.partition("\n")[2] for d in documents)
    return files


def write_k8s(topology: Topology, *, source: Path | str) -> None:
    K8S_DIR.mkdir(exist_ok=True)
    files = render_k8s(topology, source=source)
    for stale in K8S_DIR.glob("*.yaml"):
        if stale.name not in files:  # a role the topology no longer has
            stale.unlink()
    for name, text in files.items():
        (K8S_DIR / name).write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.generate", description=__doc__)
    parser.add_argument("--topology", type=Path, default=DEFAULT_TOPOLOGY)
    args = parser.parse_args()
    try:
        topology = load_topology(args.topology)
        topology.check_compose_ports()
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    write_yaml(COMPOSE_FILE, compose_dict(topology), source=args.topology)
    write_yaml(CPU_OVERRIDE_FILE, cpu_override_dict(topology), source=args.topology)
    write_yaml(PODMAN_OVERRIDE_FILE, podman_override_dict(topology), source=args.topology)
    CONTAINERS_CONF_FILE.write_text(containers_conf())
    write_yaml(ENVOY_FILE, envoy_bootstrap(topology), source=args.topology)
    write_k8s(topology, source=args.topology)
    print(
        f"wrote {COMPOSE_FILE}, {CPU_OVERRIDE_FILE}, {PODMAN_OVERRIDE_FILE}, "
        f"{CONTAINERS_CONF_FILE}, {ENVOY_FILE} and {K8S_DIR}/*.yaml"
    )


if __name__ == "__main__":
    main()
