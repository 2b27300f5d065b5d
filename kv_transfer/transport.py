"""The KV transport interface, and choosing one by name.

A transport moves pages one way, writer → receiver, between registered memory regions:

1. both sides `register()` their KV memory; the receiver publishes `address()`;
2. the writer `connect()`s to that address and `write()`s pages into the receiver's regions,
   getting a `TransferHandle` to poll, await or cancel;
3. the receiver learns the outcome per transfer id (`inbound_status`, `wait_inbound`) and, before
   it reuses blocks of a transfer that did not end DONE, `fence()`s it.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kv_transfer.inbound import InboundTransfers
from kv_transfer.memory import MemoryKind, UnsupportedMemoryError
from kv_transfer.page_copy import PageCopy
from kv_transfer.page_table import PageTable
from kv_transfer.peer_address import PeerAddress
from kv_transfer.region import RegionHandle, make_region
from kv_transfer.transfer_handle import TransferHandle
from kv_transfer.transfer_plan import TransferPlan, make_plan
from kv_transfer.transfer_status import TransferStatus


@dataclass(frozen=True)
class TransportInfo:
    """What the start-up self-test reports and the node exports as metric labels."""

    # "loopback", "ucx", ...
    transport: str
    # The lanes in use, e.g. ["cma/memory", "posix/memory", "tcp/eth0"]; ["memcpy"] for loopback.
    lanes: list[str]
    # Library version, e.g. "ucx 1.21.0 / ucxx 0.52.00".
    version: str


class KvTransport(abc.ABC):
    name: str
    # The memory kinds this transport can read and write; `register` refuses any other.
    memory_kinds: frozenset[MemoryKind] = frozenset({MemoryKind.HOST, MemoryKind.HOST_SHM})

    def __init__(self) -> None:
        # Registered regions by name.
        self._regions: dict[str, RegionHandle] = {}
        # Receiver-side record of every transfer writing into this transport: the same
        # bookkeeping (status, fencing, forgetting) whatever carries the bytes.
        self.inbound = InboundTransfers()

    def register(self, name: str, buffer: object) -> RegionHandle:
        """Registers memory under a unique name: host memory (anything with the buffer
        protocol) or device memory (``__cuda_array_interface__``). Raises
        UnsupportedMemoryError, naming the transport and the memory, for a kind it cannot carry."""
        if name in self._regions:
            raise ValueError(f"region {name!r} is already registered")
        region = make_region(name, buffer)
        if region.memory not in self.memory_kinds:
            carries = ", ".join(sorted(str(k) for k in self.memory_kinds))
            raise UnsupportedMemoryError(
                f"the {self.name} KV transport cannot carry {region.where()} memory (region "
                f"{name!r}); it carries {carries} memory"
            )
        self._regions[name] = region
        return region

    def allocate(self, num_bytes: int) -> object:
        """Zeroed memory this transport can receive into (plain host memory here; shared memory
        for shm, device memory for cuda_ipc): what a receiver registers as its KV regions."""
        return np.zeros(num_bytes, dtype=np.uint8)

    def unregister(self, name: str) -> None:
        """Forgets a region; the caller must first make sure no transfer still uses it."""
        self._regions.pop(name, None)

    def region_lengths(self) -> dict[str, int]:
        return {n: r.length for n, r in self._regions.items()}

    @abc.abstractmethod
    def address(self) -> PeerAddress:
        """What a writer needs to reach this transport and its registered regions."""

    @abc.abstractmethod
    def connect(self, peer: PeerAddress, timeout: float = 5.0) -> None:
        """Prepares writing to `peer` (idempotent); raises ConnectionError if it cannot."""

    @abc.abstractmethod
    def write(
        self,
        peer: PeerAddress,
        pages: Sequence[PageCopy] | PageTable,
        *,
        transfer_id: str,
        deadline: float,
    ) -> TransferHandle:
        """Pushes `pages` into `peer`'s regions. Bad pages raise ValueError before any byte
        moves; everything after is reported by the handle. `deadline` is a time.monotonic()."""

    def _plan_write(
        self, peer: PeerAddress, pages: Sequence[PageCopy] | PageTable, *, is_closed: bool
    ) -> TransferPlan:
        """What every ``write`` checks before any byte moves: the transport is open, the peer is
        reached over this transport, every page lies inside its regions on both sides."""
        if is_closed:
            raise RuntimeError("the transport is closed")
        if peer.transport != self.name:
            raise ValueError(f"a {peer.transport} address cannot be reached over {self.name}")
        return make_plan(pages, self.region_lengths(), peer.regions)

    def inbound_status(self, transfer_id: str) -> TransferStatus | None:
        """Receiver side: the status of a transfer writing into this transport (None: unseen)."""
        return self.inbound.status(transfer_id)

    def wait_inbound(self, transfer_id: str, timeout: float) -> TransferStatus | None:
        """Receiver side: waits until the transfer is terminal or the timeout passes."""
        return self.inbound.wait(transfer_id, timeout)

    def fence(self, transfer_id: str, timeout: float) -> bool:
        """Receiver side: refuses every further byte of the transfer and waits until none is
        being written. True: the blocks are safe to reuse. False: still busy at the timeout."""
        return self.inbound.fence(transfer_id, timeout)

    def forget_inbound(self, transfer_id: str) -> bool:
        """Receiver side: drops the record of a terminal, quiet transfer (call it once its blocks
        are freed); the id stays refused. False if it is still running or writing."""
        return self.inbound.forget(transfer_id)

    @abc.abstractmethod
    def info(self) -> TransportInfo:
        """Which lanes this transport uses (for the self-test and metrics)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Fails every unfinished transfer (its handle says why) and releases the transport."""

    def __enter__(self) -> KvTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_FACTORIES: dict[str, Callable[..., KvTransport]] = {}
# Transports whose module is imported on first use (UCX takes ~0.5 s to load).
_LAZY_MODULES = {
    "ucx": "kv_transfer.ucx",
    "shm": "kv_transfer.shm",
    "cuda_ipc": "kv_transfer.cuda_ipc",
}


def register_transport(name: str, factory: Callable[..., KvTransport]) -> None:
    _FACTORIES[name] = factory


def available_transports() -> list[str]:
    return sorted({*_FACTORIES, *_LAZY_MODULES})


def make_transport(name: str, **options: object) -> KvTransport:
    """`make_transport("loopback")`, `make_transport("ucx", error_handling=True)`, ..."""
    if name not in _FACTORIES and name in _LAZY_MODULES:
        importlib.import_module(_LAZY_MODULES[name])
    if name not in _FACTORIES:
        raise ValueError(f"unknown KV transport {name!r}; known: {available_transports()}")
    return _FACTORIES[name](**options)
