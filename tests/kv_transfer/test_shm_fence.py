"""The shm table's fence in one process: copies against fences, forgets and slot reuse."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kv_transfer import TransferStatus, shared_memory
from kv_transfer.shm_table import CONTROL_BYTES, ShmTable

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def tables() -> tuple[ShmTable, ShmTable]:
    """(receiver's table, a writer's table over the same memory mapped a second time)."""
    control = shared_memory.allocate(CONTROL_BYTES)
    handle, _ = shared_memory.find_allocation(control.ctypes.data, CONTROL_BYTES)
    receiver = ShmTable(control, owner=True)
    writer = ShmTable(np.frombuffer(shared_memory.map_peer(handle), np.uint8), owner=False)
    return receiver, writer


def test_a_fence_waits_for_the_copy_inside_and_refuses_the_next(tables) -> None:
    receiver, writer = tables
    slot, generation = writer.claim("t")
    assert writer.begin_copy(slot, generation, 1.0)
    assert not receiver.fence("t", timeout=0.1)  # the copy is still inside
    fenced = threading.Event()
    thread = threading.Thread(target=lambda: receiver.fence("t", 5) and fenced.set())
    thread.start()
    assert not fenced.wait(0.1)
    writer.end_copy(slot, 4096)
    thread.join(5)
    assert fenced.is_set()
    assert not writer.begin_copy(slot, generation, 1.0)  # every later copy is refused
    assert receiver.status("t") is TransferStatus.CANCELLED
    assert receiver.bytes_received("t") == 4096


def test_a_stale_writer_cannot_write_into_a_reused_slot(tables) -> None:
    receiver, writer = tables
    slot, old = writer.claim("first")
    writer.finish_claim(slot, old, TransferStatus.DONE)
    assert receiver.forget("first")
    assert (
        writer.claim("first") == "transfer 'first' was already used and forgotten (use a fresh id)"
    )
    again, new = writer.claim("second")
    assert again == slot and new != old  # the same slot, a new generation
    assert not writer.begin_copy(slot, old, 0.1)
    assert writer.begin_copy(slot, new, 0.1)
    writer.end_copy(slot, 1)


def test_a_fence_before_arrival_refuses_the_transfer(tables) -> None:
    receiver, writer = tables
    assert receiver.fence("early", timeout=1)
    assert "fenced" in str(writer.claim("early"))


def test_forget_refuses_while_a_copy_is_inside_or_the_transfer_runs(tables) -> None:
    receiver, writer = tables
    slot, generation = writer.claim("busy")
    assert not receiver.forget("busy")  # still IN_PROGRESS
    assert writer.begin_copy(slot, generation, 1.0)
    writer.finish_claim(slot, generation, TransferStatus.FAILED, "boom")
    assert not receiver.forget("busy")  # terminal, but a copy is inside
    writer.end_copy(slot, 0)
    assert receiver.error("busy") == "boom"
    assert receiver.forget("busy")
    assert receiver.status("busy") is None


def test_a_closed_receiver_refuses_and_fails_running_transfers(tables) -> None:
    receiver, writer = tables
    writer.claim("running")
    receiver.close()
    assert receiver.status("running") is TransferStatus.FAILED
    assert writer.claim("new") == "the peer closed"


def test_finish_claim_reports_what_the_slot_says_under_its_lock(tables) -> None:
    receiver, writer = tables
    slot, generation = writer.claim("landed")
    assert writer.finish_claim(slot, generation, TransferStatus.DONE) is TransferStatus.DONE
    # The decode commits and forgets it at once: the claim is void, never reported as fenced.
    assert receiver.forget("landed")
    assert writer.finish_claim(slot, generation, TransferStatus.DONE) is None
    slot, generation = writer.claim("fenced late")
    assert receiver.fence("fenced late", timeout=1)  # after the last copy, before DONE
    assert writer.finish_claim(slot, generation, TransferStatus.DONE) is TransferStatus.CANCELLED
    assert receiver.status("fenced late") is TransferStatus.CANCELLED
