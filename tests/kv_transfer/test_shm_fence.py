"""The shm table's fence in one process: copies against fences, forgets and slot reuse."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kv_transfer import TransferStatus, shared_memory
from kv_transfer.inbound import MAX_TOMBSTONES
from kv_transfer.shm_table import _H_NEXT_TOMB, CONTROL_BYTES, ShmTable, TombstoneIndex

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


@pytest.mark.parametrize("seed", range(6))
def test_the_tombstone_index_answers_as_a_compare_of_the_whole_ring(seed: int) -> None:
    """Forgets written as `forget` writes them (entry, then count) into a small ring, with
    repeated digests, wrap-arounds and, between two questions, none, a few or more than the
    ring holds, read all at once or a few per question; the index must answer each question
    as comparing every entry does."""
    rng = np.random.default_rng(seed)
    size = 8
    index = TombstoneIndex(size, max_catch_up=3 if seed % 2 else size)
    ring, num_forgotten = np.zeros(size, np.uint64), 0
    for _ in range(300):
        for _ in range(int(rng.choice([0, 1, 3, size + 5], p=[0.3, 0.4, 0.2, 0.1]))):
            ring[num_forgotten % size] = rng.integers(1, 24)  # few digests: many repeats
            num_forgotten += 1
        for digest in range(1, 25):
            expected = bool((ring == digest).any())
            assert index.contains(ring, num_forgotten, digest) is expected, (digest, ring)
        index.prune()


def test_a_claim_is_refused_for_an_id_in_the_ring_only(tables) -> None:
    """Forgotten ids are refused until MAX_TOMBSTONES later forgets push them out of the ring
    (written straight into it here, as `forget` would)."""
    receiver, writer = tables
    slot, generation = writer.claim("old")
    writer.finish_claim(slot, generation, TransferStatus.DONE)
    assert receiver.forget("old")
    assert "forgotten" in str(writer.claim("old"))
    tombs = receiver._tombs
    at = int(receiver._words[_H_NEXT_TOMB])
    tombs[:] = np.arange(1, MAX_TOMBSTONES + 1, dtype=np.uint64)  # other ids' digests
    receiver._words[_H_NEXT_TOMB] = at + MAX_TOMBSTONES
    assert isinstance(writer.claim("old"), tuple)
