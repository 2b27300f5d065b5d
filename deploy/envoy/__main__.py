"""``python -m deploy.envoy [--topology FILE] [--upstream-host HOST] [--out FILE]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from deploy.envoy.config import envoy_bootstrap
from deploy.generate import DEFAULT_TOPOLOGY, write_yaml
from deploy.topology import load_topology


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deploy.envoy", description=__doc__)
    parser.add_argument("--topology", type=Path, default=DEFAULT_TOPOLOGY)
    parser.add_argument("--upstream-host", default="127.0.0.1", help="where the gateways are")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "envoy.yaml")
    args = parser.parse_args()
    bootstrap = envoy_bootstrap(load_topology(args.topology), upstream_host=args.upstream_host)
    write_yaml(args.out, bootstrap, source=args.topology)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
