"""``python -m decode_node [--role decode|colocated] [flags]``: run a decode node."""

from __future__ import annotations

from services.host_memory import restart_with_huge_page_heap


def main() -> None:
    # First, before torch loads: the restart would throw the import away.
    restart_with_huge_page_heap()
    from decode_node.role import decode_services
    from services.node.config import parse_node_config
    from services.node.runtime import run
    from services.types import Role

    # --role prefill is a usage error here (exit 2), naming prefill_node.
    config = parse_node_config(role=Role.DECODE)
    run(config, decode_services)


if __name__ == "__main__":
    main()
