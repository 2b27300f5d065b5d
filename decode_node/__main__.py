"""``python -m decode_node [--role decode|colocated] [flags]``: run a decode node."""

from __future__ import annotations

from decode_node.role import decode_services
from services.node.config import parse_node_config
from services.node.runtime import run
from services.types import Role


def main() -> None:
    config = parse_node_config(role=Role.DECODE)
    if config.role is Role.PREFILL:
        raise SystemExit(
            "decode_node serves --role decode or colocated; use python -m prefill_node"
        )
    run(config, decode_services)


if __name__ == "__main__":
    main()
