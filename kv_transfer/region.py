"""A registered memory region: a named, writable byte range a transport may read or write."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kv_transfer.memory import MemoryKind, as_byte_view, describe_memory

__all__ = ["RegionHandle", "as_byte_view", "make_region"]


@dataclass(frozen=True)
class RegionHandle:
    """What `KvTransport.register` returns; `name` is how pages and peers refer to the region."""

    name: str
    # Bytes in the region.
    length: int
    # Address of the first byte in this process: host virtual, or a CUDA device pointer.
    address: int
    # A flat uint8 view of the caller's host memory (None for device memory); the caller keeps
    # the memory alive while registered.
    view: np.ndarray | None = field(repr=False, compare=False)
    memory: MemoryKind = MemoryKind.HOST
    # CUDA device ordinal of device memory; None for host memory.
    device: int | None = None

    def host_view(self) -> np.ndarray:
        """The flat uint8 view of a host region; device memory has none (ValueError)."""
        if self.view is None:
            raise ValueError(f"region {self.name!r} is {self.where()} memory, not host memory")
        return self.view

    def where(self) -> str:
        return f"cuda:{self.device}" if self.memory is MemoryKind.CUDA else str(self.memory)


def make_region(name: str, buffer: object) -> RegionHandle:
    memory = describe_memory(buffer)
    return RegionHandle(
        name=name,
        length=memory.length,
        address=memory.address,
        view=memory.view,
        memory=memory.kind,
        device=memory.device,
    )
