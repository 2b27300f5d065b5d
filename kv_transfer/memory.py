"""What kind of memory a KV region is, and which transports can carry it.

A region is (memory kind, device, address, length). Host memory is any buffer-protocol object;
host *shared* memory is host memory inside a live allocation of `kv_transfer.shared_memory`
(another process of this host can map it); CUDA memory is anything with
``__cuda_array_interface__`` (a CUDA torch tensor, a CuPy array), described by its pointer and
device, never copied to the host to find out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np


class MemoryKind(enum.StrEnum):
    HOST = "host"
    HOST_SHM = "host_shm"
    CUDA = "cuda"


class UnsupportedMemoryError(ValueError):
    """A transport was given a region whose memory it cannot carry (a start-up error)."""


@dataclass(frozen=True)
class MemoryRegion:
    kind: MemoryKind
    # CUDA device ordinal for CUDA memory; None for host memory.
    device: int | None
    # Address of the first byte in this process (host virtual or CUDA device pointer).
    address: int
    length: int
    # A flat writable uint8 view for host memory; None for device memory.
    view: np.ndarray | None

    def where(self) -> str:
        return f"cuda:{self.device}" if self.kind is MemoryKind.CUDA else str(self.kind)


def describe_memory(buffer: object) -> MemoryRegion:
    """The memory of `buffer`, without copying it: a CUDA array by its interface, host memory by
    the buffer protocol (``torch_cpu_tensor.numpy()``, numpy, bytearray, mmap)."""
    cuda = getattr(buffer, "__cuda_array_interface__", None)
    if cuda is not None and not hasattr(buffer, "__array_interface__"):
        return _describe_cuda(buffer, cuda)
    view = as_byte_view(buffer)
    address = view.__array_interface__["data"][0]
    from kv_transfer.shared_memory import find_allocation

    kind = MemoryKind.HOST if find_allocation(address, view.nbytes) is None else MemoryKind.HOST_SHM
    return MemoryRegion(kind, None, address, view.nbytes, view)


def as_byte_view(buffer: object) -> np.ndarray:
    """A flat, writable uint8 view of anything exposing the buffer protocol, without copying."""
    try:
        array = np.asarray(memoryview(buffer))  # type: ignore[arg-type]
    except TypeError as exc:
        raise TypeError(f"{type(buffer).__name__} does not expose the buffer protocol") from exc
    if not array.flags.c_contiguous:
        raise ValueError("a registered region must be C-contiguous")
    if not array.flags.writeable:
        raise ValueError("a registered region must be writable")
    return array.reshape(-1).view(np.uint8)


def _describe_cuda(buffer: object, interface: dict[str, Any]) -> MemoryRegion:
    shape = tuple(interface["shape"])
    strides = interface.get("strides")
    itemsize = np.dtype(interface["typestr"]).itemsize
    if strides is not None and tuple(strides) != _c_strides(shape, itemsize):
        raise ValueError("a registered region must be C-contiguous")
    address, read_only = interface["data"]
    if read_only:
        raise ValueError("a registered region must be writable")
    length = int(np.prod(shape, dtype=np.int64)) * itemsize
    return MemoryRegion(MemoryKind.CUDA, _cuda_device(buffer), int(address), length, None)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _cuda_device(buffer: object) -> int:
    """The device ordinal: torch (``.device.index``), CuPy (``.device.id``), else 0."""
    device = getattr(buffer, "device", None)
    for attr in ("index", "id"):
        value = getattr(device, attr, None)
        if isinstance(value, int):
            return value
    return 0
