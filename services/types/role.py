"""What a pdserve node runs; the gateway routes by it and the deploy tools launch by it."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    PREFILL = "prefill"
    """Computes prompts and pushes their KV pages to a decode node."""
    DECODE = "decode"
    """Receives KV pages and generates; also recomputes a prompt when no prefill node can."""
    COLOCATED = "colocated"
    """Computes the prompt and decodes it in one process (no KV transfer)."""

    @property
    def module(self) -> str:
        """The ``python -m`` entry point that runs this role."""
        return "prefill_node" if self is Role.PREFILL else "decode_node"
