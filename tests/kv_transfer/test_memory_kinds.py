"""Regions of every memory kind, and transports refusing the kinds they cannot carry."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from kv_transfer import make_transport, shared_memory
from kv_transfer.memory import MemoryKind, UnsupportedMemoryError, describe_memory


class FakeCudaArray:
    """What a CUDA tensor or CuPy array shows a transport: a pointer and a device, no host view
    (the address is never dereferenced on the host)."""

    class _Device:
        def __init__(self, index: int) -> None:
            self.index = index

    def __init__(self, num_bytes: int, device: int = 1) -> None:
        self.device = self._Device(device)
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (0x7F0000000000, False),
            "version": 3,
        }


def test_host_memory_is_described_in_place() -> None:
    array = np.zeros(4096, np.uint8)
    memory = describe_memory(array)
    assert memory.kind is MemoryKind.HOST and memory.device is None
    assert memory.address == array.ctypes.data and memory.length == 4096
    assert np.shares_memory(memory.view, array)


def test_shared_memory_and_views_into_it_are_host_shm() -> None:
    array = shared_memory.allocate(1 << 16)
    assert describe_memory(array).kind is MemoryKind.HOST_SHM
    assert describe_memory(array[4096:8192]).kind is MemoryKind.HOST_SHM
    assert describe_memory(array.view(np.float32)).length == 1 << 16


def test_a_released_allocation_is_forgotten_and_its_fd_closed() -> None:
    array = shared_memory.allocate(1 << 16)
    address = array.ctypes.data
    handle, offset = shared_memory.find_allocation(address, 1 << 16)
    assert offset == 0
    del array
    gc.collect()
    assert shared_memory.find_allocation(address, 1 << 16) is None
    with pytest.raises(ConnectionError):
        shared_memory.map_peer(handle)


def test_cuda_memory_is_described_by_its_interface() -> None:
    memory = describe_memory(FakeCudaArray(1 << 20, device=1))
    assert memory.kind is MemoryKind.CUDA and memory.device == 1
    assert memory.address == 0x7F0000000000 and memory.length == 1 << 20
    assert memory.view is None


@pytest.mark.parametrize("name", ["loopback", "ucx", "shm"])
def test_host_transports_refuse_cuda_memory_naming_both(name: str) -> None:
    transport = make_transport(name)
    try:
        with pytest.raises(UnsupportedMemoryError) as refused:
            transport.register("kv.layer0", FakeCudaArray(1 << 20, device=1))
        message = str(refused.value)
        assert name in message and "cuda:1" in message and "kv.layer0" in message
        assert transport.region_lengths() == {}
    finally:
        transport.close()


def test_shm_publishes_only_regions_a_peer_can_map() -> None:
    transport = make_transport("shm")
    try:
        transport.register("private", np.zeros(4096, np.uint8))
        transport.register("shared", transport.allocate(4096))
        assert transport.address().regions == {"shared": 4096}
    finally:
        transport.close()
