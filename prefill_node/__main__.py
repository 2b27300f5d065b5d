"""``python -m prefill_node [flags]``: run a prefill node."""

from __future__ import annotations

from services.host_memory import restart_with_huge_page_heap


def main() -> None:
    # First, before torch loads: the restart would throw the import away.
    restart_with_huge_page_heap()
    from prefill_node.role import prefill_services
    from services.node.config import parse_node_config
    from services.node.runtime import run
    from services.types import Role

    # --role decode or colocated is a usage error here (exit 2), naming decode_node.
    config = parse_node_config(role=Role.PREFILL)
    run(config, prefill_services)


if __name__ == "__main__":
    main()
