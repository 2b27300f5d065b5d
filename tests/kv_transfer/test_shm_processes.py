"""The shm transport between real processes: pushes, SIGKILL of either side, and the fence."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kv_transfer import PageCopy, TransferStatus, make_transport
from kv_transfer.shared_memory import MEMFD_NAME, ProcessWatch
from support.receiver_process import (
    DST_BYTES,
    PAGE,
    push_scattered_pages_and_check,
    read_address,
    receiver_script,
)

pytestmark = pytest.mark.timeout(60)

# The receiver keeps its KV memory in shared memory (``allocate``).
RECEIVER = receiver_script('make_transport("shm")', "transport.allocate(size)")

# A writer that pushes 12 MiB (three 4 MiB messages) into the peer given on stdin, holding the
# last message back for a minute: it is killed while the receiver holds part of the transfer.
PAUSED_WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from kv_transfer import PageCopy, PeerAddress, make_transport
    writer = make_transport("shm", pause_before_last_s=60)
    writer.register("src", np.full(12 << 20, 7, np.uint8))
    peer = PeerAddress.from_bytes(bytes.fromhex(sys.stdin.readline().strip()))
    order = np.random.default_rng(3).permutation(1536)  # scattered: three staged messages
    pages = [PageCopy("src", int(i) * 8192, "dst", int(i) * 8192, 8192) for i in order]
    handle = writer.write(peer, pages, transfer_id="doomed", deadline=time.monotonic() + 120)
    print("writing", flush=True)
    handle.wait(120)
    """
)

# A writer that enters a copy of transfer "held" (holding its slot mutex) and stays inside.
INSIDE_COPY = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from kv_transfer import PeerAddress
    from kv_transfer.shm_table import ShmTable
    from kv_transfer import shared_memory
    from kv_transfer.shared_memory import SharedHandle
    import json
    peer = PeerAddress.from_bytes(bytes.fromhex(sys.stdin.readline().strip()))
    control = SharedHandle.from_json(json.loads(peer.endpoint)["control"])
    table = ShmTable(np.frombuffer(shared_memory.map_peer(control), np.uint8), owner=False)
    slot, generation = table.claim("held")
    assert table.begin_copy(slot, generation, 5)
    print("inside", flush=True)
    time.sleep(120)
    """
)


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def receiver_process() -> Iterator[subprocess.Popen[str]]:
    proc = spawn(RECEIVER)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def memfd_mappings(pid: int | str = "self") -> list[str]:
    """Lines of /proc/<pid>/maps that map a pdserve shared-memory allocation."""
    return [
        line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if MEMFD_NAME in line
    ]


def test_scattered_pages_cross_processes(receiver_process: subprocess.Popen[str]) -> None:
    push_scattered_pages_and_check(make_transport("shm"), receiver_process)


def test_sigkill_of_the_owner_leaves_no_shared_memory(
    receiver_process: subprocess.Popen[str],
) -> None:
    """memfd memory has no name anywhere: the owner's death closes its fds and mappings, and the
    writer drops its own mapping once it sees the owner gone, so the memory is freed."""
    dev_shm_before = set(os.listdir("/dev/shm"))
    peer = read_address(receiver_process)
    pid = receiver_process.pid
    assert memfd_mappings(pid)  # the receiver's KV memory and control table are memfd mappings
    writer = make_transport("shm")
    try:
        writer.register("src", np.ones(DST_BYTES, np.uint8))
        writer.connect(peer)
        assert len(memfd_mappings()) >= 2  # the writer mapped the peer: control + KV region
        receiver_process.kill()
        receiver_process.wait(timeout=10)
        handle = writer.write(
            peer,
            [PageCopy("src", 0, "dst", 0, PAGE)],
            transfer_id="k",
            deadline=time.monotonic() + 5,
        )
        assert handle.wait(5) is TransferStatus.FAILED, handle
        assert "died" in (handle.error or "") or "gone" in (handle.error or "")
        del handle
        gc.collect()
        # The writer dropped its mappings of the dead peer: only its own control table is left.
        assert len(memfd_mappings()) == 1, memfd_mappings()
        with pytest.raises(ConnectionError):  # the dead owner's memory cannot be found again
            writer.connect(peer)
    finally:
        writer.close()
    assert set(os.listdir("/dev/shm")) <= dev_shm_before


def test_receiver_killed_mid_copy_ends_the_push_failed(
    receiver_process: subprocess.Popen[str],
) -> None:
    peer = read_address(receiver_process)
    writer = make_transport("shm", pause_before_last_s=30)
    try:
        writer.register("src", np.ones(DST_BYTES, np.uint8))
        # Scattered pages: two staged messages of 4 MiB, the second held back.
        order = np.random.default_rng(2).permutation(DST_BYTES // PAGE)
        pages = [PageCopy("src", int(i) * PAGE, "dst", int(i) * PAGE, PAGE) for i in order]
        handle = writer.write(peer, pages, transfer_id="mid", deadline=time.monotonic() + 60)
        while handle.bytes_moved == 0:  # the first message landed; the last is held back
            assert handle.wait(0.01) is not TransferStatus.FAILED, handle
        receiver_process.send_signal(signal.SIGKILL)
        receiver_process.wait(timeout=10)
        assert handle.wait(5) is TransferStatus.FAILED, handle
        assert "died" in (handle.error or "")
        # No reconnect needed: the writer let go of the dead peer's memory by itself.
        limit = time.monotonic() + 10
        while len(memfd_mappings()) > 1:
            assert time.monotonic() < limit, memfd_mappings()
            gc.collect()
            time.sleep(0.01)
    finally:
        writer.close()


def test_writer_killed_mid_push_is_reported_failed_and_fenced() -> None:
    receiver = make_transport("shm")
    dst = receiver.allocate(12 << 20)
    receiver.register("dst", dst)
    writer = spawn(PAUSED_WRITER)
    try:
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write(receiver.address().to_bytes().hex() + "\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "writing"
        limit = time.monotonic() + 20
        while receiver.inbound.bytes_received("doomed") < 8 << 20:  # two of three messages
            assert time.monotonic() < limit, "the writer never copied"
            time.sleep(0.01)
        assert receiver.inbound_status("doomed") is TransferStatus.IN_PROGRESS
        writer.kill()
        writer.wait(timeout=10)
        # Nothing runs on the receiver: it reads the dead writer's pid from the table.
        assert receiver.inbound_status("doomed") is TransferStatus.FAILED
        assert "died" in (receiver.inbound.error("doomed") or "")
        assert receiver.fence("doomed", timeout=5)
        assert receiver.forget_inbound("doomed")
        assert np.count_nonzero(dst) == 8 << 20  # the held-back third never landed
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait(timeout=10)
        receiver.close()


def test_fence_waits_out_a_writer_killed_inside_a_copy() -> None:
    """The writer dies holding the slot mutex: the robust mutex hands it to the fence."""
    receiver = make_transport("shm")
    receiver.register("dst", receiver.allocate(1 << 20))
    writer = spawn(INSIDE_COPY)
    try:
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write(receiver.address().to_bytes().hex() + "\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "inside"
        assert not receiver.fence("held", timeout=0.2)  # a copy is inside the blocks
        writer.kill()
        writer.wait(timeout=10)
        assert receiver.fence("held", timeout=5)
        assert receiver.inbound_status("held") is TransferStatus.CANCELLED
        assert receiver.forget_inbound("held")
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.wait(timeout=10)
        receiver.close()


def test_a_process_watch_sees_an_exit_from_any_thread_zombie_or_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = ProcessWatch(child.pid)
        answers: list[bool] = []

        def check() -> None:  # threads check at once, as copy threads do
            answers.extend(watch.is_alive() for _ in range(200))

        threads = [threading.Thread(target=check) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert answers == [True] * 1600
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while watch.is_alive():  # a zombie until reaped below: it counts as gone
            assert time.monotonic() < deadline, "the watch never saw the exit"
            time.sleep(0.01)
        assert child.poll() is not None or child.wait(5) is not None
        assert not watch.is_alive()
    finally:
        child.kill()
        child.wait()
    assert not ProcessWatch(child.pid).is_alive()  # reaped: gone from the start
