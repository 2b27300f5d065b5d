"""A node's KV cache as transport memory regions: one region per layer, named ``kv.layer{i}``.

Both roles register their caches the same way, so a copy of the engine's (layer, offsets)
becomes a transport page between regions of the same name on either side: a push's copies are
one ``PageTable`` whose region index on both sides is the layer (`kv_page_table`).

Each layer is registered where it lives: a CUDA cache by its device pointer
(``__cuda_array_interface__`` of a flat uint8 view), a host cache by a flat numpy view, never by
a copy. A transport that receives only into shared memory (shm) first moves each host layer
into a shared allocation, in place (``Tensor.set_``: every holder of the tensor sees the new
memory). A transport that cannot carry the cache's memory raises ``UnsupportedMemoryError``
naming both; the node exits with that one line (services/node/runtime.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from kv_transfer import KvTransport, PageTable, make_transport, run_self_test
from kv_transfer.loopback import LoopbackTransport
from kv_transfer.memory import MemoryKind, describe_memory
from services.engine.kv_layout import KvLayout, layer_copy_table

logger = logging.getLogger(__name__)


def region_name(layer: int) -> str:
    return f"kv.layer{layer}"


def open_kv_transport(
    name: str, kv_caches: list[torch.Tensor], *, push_pause_s: float = 0.0
) -> KvTransport:
    """Create the transport, register every layer's cache, and run the start-up self-test.

    ``push_pause_s`` is fault injection for tests (``NodeConfig.test_kv_push_pause_s``): every
    push this node writes after the self-test holds its last message back that long. The
    self-test's own pushes do not pause: they held every such node's start-up back by the pause
    (30 s for a test that pauses a push until it kills the node) and timed the pause as the
    transport's rate."""
    transport = make_transport(name)
    try:
        for layer, cache in enumerate(kv_caches):
            transport.register(region_name(layer), layer_memory(transport, cache))
    except Exception:
        transport.close()
        raise
    report = run_self_test(transport)
    logger.info("KV transport self-test: %s", report)
    if push_pause_s:
        pause_pushes(transport, push_pause_s)
        logger.warning(
            "testing only: every KV push pauses %.3f s before its last message", push_pause_s
        )
    return transport


def pause_pushes(transport: KvTransport, pause_s: float) -> None:
    """From now on, each push ``transport`` writes holds its last message back ``pause_s``."""
    if isinstance(transport, LoopbackTransport):
        transport.faults = replace(transport.faults, pause_before_last_s=pause_s)
    elif hasattr(transport, "pause_before_last_s"):  # ucx, shm
        transport.pause_before_last_s = pause_s
    else:
        transport.close()
        raise ValueError(f"the {transport.name} KV transport cannot pause its pushes")


def layer_memory(transport: KvTransport, cache: torch.Tensor) -> object:
    """The memory of one layer's cache ``[2, blocks, block_size, kv_heads, head_dim]`` as the
    transport registers it: a flat uint8 CUDA tensor, or a flat numpy view of host memory."""
    flat = cache.view(-1).view(torch.uint8)
    if flat.is_cuda:
        return flat  # __cuda_array_interface__: pointer and device, no host copy
    view = flat.numpy()
    if _needs_shared(transport) and describe_memory(view).kind is not MemoryKind.HOST_SHM:
        move_to_shared_memory(transport, cache)
        view = cache.view(-1).view(torch.uint8).numpy()
    return view


def _needs_shared(transport: KvTransport) -> bool:
    return getattr(transport, "receive_kind", None) is MemoryKind.HOST_SHM


def move_to_shared_memory(transport: KvTransport, cache: torch.Tensor) -> None:
    """Rehomes a host tensor's bytes into the transport's shared memory, keeping the tensor
    object (and its contents): the engine and model keep using the same tensor."""
    shared = np.asarray(transport.allocate(cache.nbytes))
    storage = torch.frombuffer(shared, dtype=torch.uint8).view(cache.dtype)
    storage.copy_(cache.reshape(-1))
    cache.set_(storage.untyped_storage(), 0, cache.shape, cache.stride())


def kv_page_table(
    src: KvLayout, src_block_ids: Sequence[int], dst: KvLayout, dst_block_ids: Sequence[int]
) -> PageTable:
    """The pages that push ``src_block_ids`` of this node's cache into ``dst_block_ids`` of the
    peer's: `layer_copy_table` (which checks the pairing) with each layer's region on both
    sides."""
    copies = layer_copy_table(src, src_block_ids, dst, dst_block_ids)
    regions = [region_name(layer) for layer in range(src.num_layers)]
    # copies: (layer, src offset, dst offset, length) -> the table's (src region, src offset,
    # dst region, dst offset, length), one gather.
    return PageTable(regions, list(regions), copies[:, [0, 1, 0, 2, 3]])
