"""`--kv-transport auto`: which transport a node uses, and why (logged at start-up).

Same-host peers share memory directly: cuda_ipc for KV caches in device memory, shm for KV
caches in host memory. Peers on other hosts need a network: ucx. Both ends of a handoff apply
the same rule, so a prefill and a decode node of one deployment agree.
"""

from __future__ import annotations

from kv_transfer.memory import MemoryKind

# Where a node's KV peers run: "host" (this machine only: the launcher, compose) or "cluster"
# (possibly other machines).
KV_SCOPES = ("host", "cluster")


def choose_transport(requested: str, memory: MemoryKind, scope: str) -> tuple[str, str]:
    """(transport name, why) for a node whose KV cache is `memory` and whose peers run in
    `scope`. A name other than "auto" is kept as given."""
    if scope not in KV_SCOPES:
        raise ValueError(f"kv scope must be one of {KV_SCOPES}, got {scope!r}")
    where = "device memory" if memory is MemoryKind.CUDA else "host memory"
    if requested != "auto":
        return requested, f"--kv-transport {requested} was asked for (KV cache in {where})"
    if scope == "cluster":
        return "ucx", f"auto: peers may run on other hosts (kv scope cluster); KV cache in {where}"
    if memory is MemoryKind.CUDA:
        return "cuda_ipc", "auto: KV cache in device memory and every peer on this host"
    return "shm", "auto: KV cache in host memory and every peer on this host"
