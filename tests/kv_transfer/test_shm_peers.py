"""The shm writer's view of its peers: each write lands where the address it was given names,
though the writer remembers every peer's region addresses between writes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kv_transfer import KvTransport, PageTable, PeerAddress, TransferStatus, make_transport

pytestmark = pytest.mark.timeout(30)

PAGE = 8192
SLOTS = 64


@pytest.fixture
def writer() -> Iterator[KvTransport]:
    transport = make_transport("shm")
    transport.register("src", np.random.default_rng(0).integers(0, 256, SLOTS * PAGE, np.uint8))
    yield transport
    transport.close()


def make_receiver() -> tuple[KvTransport, np.ndarray]:
    receiver = make_transport("shm")
    memory = receiver.allocate(SLOTS * PAGE)
    receiver.register("dst", memory)
    return receiver, memory


def push(writer: KvTransport, peer: PeerAddress, src: list[int], dst: list[int], tid: str) -> None:
    pages = PageTable.from_blocks("src", src, "dst", dst, PAGE)
    handle = writer.write(peer, pages, transfer_id=tid, deadline=time.monotonic() + 10)
    assert handle.wait(10) is TransferStatus.DONE, handle


def pages_of(memory: np.ndarray, blocks: list[int]) -> np.ndarray:
    return memory.reshape(SLOTS, PAGE)[blocks]


def test_writes_alternating_between_two_peers_land_in_each_ones_memory(writer) -> None:
    (first, first_memory), (second, second_memory) = make_receiver(), make_receiver()
    try:
        source = writer._regions["src"].host_view().reshape(SLOTS, PAGE)
        for round_index in range(3):  # each peer's addresses are looked up, then remembered
            push(writer, first.address(), [round_index], [round_index], f"a{round_index}")
            push(writer, second.address(), [10 + round_index], [round_index], f"b{round_index}")
        assert np.array_equal(pages_of(first_memory, [0, 1, 2]), source[[0, 1, 2]])
        assert np.array_equal(pages_of(second_memory, [0, 1, 2]), source[[10, 11, 12]])
        assert not first_memory[3 * PAGE :].any() and not second_memory[3 * PAGE :].any()
    finally:
        first.close()
        second.close()


def test_a_region_registered_again_is_written_through_the_new_address(writer) -> None:
    receiver, old_memory = make_receiver()
    try:
        push(writer, receiver.address(), [1], [1], "before")
        receiver.unregister("dst")
        new_memory = receiver.allocate(SLOTS * PAGE)
        receiver.register("dst", new_memory)
        push(writer, receiver.address(), [2], [2], "after")
        source = writer._regions["src"].host_view().reshape(SLOTS, PAGE)
        assert np.array_equal(pages_of(new_memory, [2]), source[[2]])
        assert not pages_of(old_memory, [2]).any()  # the old memory kept only "before"
        assert np.array_equal(pages_of(old_memory, [1]), source[[1]])
    finally:
        receiver.close()
