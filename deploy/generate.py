"""``python -m deploy.generate [--topology FILE]``: writes ``deploy/docker-compose.yml``, its CPU
override ``deploy/docker-compose.cpu.yml`` and ``deploy/envoy/envoy.yaml`` from one topology, so
node counts, ports and GPU pins agree.

All three are committed, generated from ``deploy/topology.yaml``; a test regenerates them and
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
from deploy.topology import load_topology

DEPLOY_DIR = Path(__file__).parent
DEFAULT_TOPOLOGY = DEPLOY_DIR / "topology.yaml"
COMPOSE_FILE = DEPLOY_DIR / "docker-compose.yml"
CPU_OVERRIDE_FILE = DEPLOY_DIR / "docker-compose.cpu.yml"
ENVOY_FILE = DEPLOY_DIR / "envoy" / "envoy.yaml"


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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.generate", description=__doc__)
    parser.add_argument("--topology", type=Path, default=DEFAULT_TOPOLOGY)
    args = parser.parse_args()
    topology = load_topology(args.topology)
    write_yaml(COMPOSE_FILE, compose_dict(topology), source=args.topology)
    write_yaml(CPU_OVERRIDE_FILE, cpu_override_dict(topology), source=args.topology)
    write_yaml(ENVOY_FILE, envoy_bootstrap(topology), source=args.topology)
    print(f"wrote {COMPOSE_FILE}, {CPU_OVERRIDE_FILE} and {ENVOY_FILE}")


if __name__ == "__main__":
    main()
