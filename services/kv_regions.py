"""A node's KV cache as transport memory regions: one region per layer, named ``kv.layer{i}``.

Both roles register their caches the same way, so a ``LayerCopy`` (layer, offsets) from the
engine becomes a transport ``PageCopy`` between regions of the same name on either side.
"""

from __future__ import annotations

import logging

import torch

from kv_transfer import KvTransport, LoopbackFaults, PageCopy, make_transport, run_self_test
from services.engine.kv_layout import LayerCopy

logger = logging.getLogger(__name__)


def region_name(layer: int) -> str:
    return f"kv.layer{layer}"


def open_kv_transport(
    name: str, kv_caches: list[torch.Tensor], *, push_pause_s: float = 0.0
) -> KvTransport:
    """Create the transport, register every layer's cache, and run the start-up self-test.

    ``push_pause_s`` is fault injection for tests (``NodeConfig.test_kv_push_pause_s``): every
    push this node writes holds its last message back that long."""
    if name == "loopback":
        transport = make_transport(name, faults=LoopbackFaults(pause_before_last_s=push_pause_s))
    else:
        transport = make_transport(name, pause_before_last_s=push_pause_s)
    if push_pause_s:
        logger.warning(
            "testing only: every KV push pauses %.3f s before its last message", push_pause_s
        )
    for layer, cache in enumerate(kv_caches):
        # A flat byte view of the whole layer: [2, blocks, block_size, kv_heads, head_dim].
        transport.register(region_name(layer), cache.view(-1).view(torch.uint8).numpy())
    report = run_self_test(transport)
    logger.info("KV transport self-test: %s", report)
    return transport


def to_page_copies(copies: list[LayerCopy]) -> list[PageCopy]:
    return [
        PageCopy(region_name(c.layer), c.src_offset, region_name(c.layer), c.dst_offset, c.length)
        for c in copies
    ]
