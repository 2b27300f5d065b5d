"""A registered memory region: a named, writable byte range a transport may read or write."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class RegionHandle:
    """What `KvTransport.register` returns; `name` is how pages and peers refer to the region."""

    name: str
    # Bytes in the region.
    length: int
    # Host virtual address of the first byte (for logs and the cuda_ipc transport's handles).
    address: int
    # A flat uint8 view of the caller's memory; the caller keeps the memory alive while registered.
    view: np.ndarray = field(repr=False, compare=False)


def as_byte_view(buffer: object) -> np.ndarray:
    """A flat, writable uint8 view of anything exposing the buffer protocol (numpy, memoryview,
    bytearray, `torch_tensor.numpy()`), without copying."""
    if hasattr(buffer, "__cuda_array_interface__") and not hasattr(buffer, "__array_interface__"):
        raise TypeError("device memory needs the cuda_ipc transport; this one moves host memory")
    try:
        array = np.asarray(memoryview(buffer))  # type: ignore[arg-type]
    except TypeError as exc:
        raise TypeError(f"{type(buffer).__name__} does not expose the buffer protocol") from exc
    if not array.flags.c_contiguous:
        raise ValueError("a registered region must be C-contiguous")
    if not array.flags.writeable:
        raise ValueError("a registered region must be writable")
    return array.reshape(-1).view(np.uint8)


def make_region(name: str, buffer: object) -> RegionHandle:
    view = as_byte_view(buffer)
    return RegionHandle(
        name=name, length=view.nbytes, address=view.__array_interface__["data"][0], view=view
    )
