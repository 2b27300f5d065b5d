"""Fault injection and fencing, driven through the loopback transport's hooks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kv_transfer import (
    InboundTransfers,
    LoopbackFaults,
    PageTable,
    TransferStatus,
    make_transport,
)
from support.fake_clock import FakeClock

pytestmark = pytest.mark.timeout(30)

PAGE = 8192


def make_pair(faults: LoopbackFaults, clock: Callable[[], float] = time.monotonic):
    writer = make_transport("loopback", faults=faults, clock=clock)
    receiver = make_transport("loopback")
    writer.register("src", np.ones(64 * PAGE, np.uint8))
    dst = np.zeros(64 * PAGE, np.uint8)
    receiver.register("dst", dst)
    # 64 scattered pages → one staged message per 4 MiB; use small messages via many regions.
    pages = PageTable.from_blocks("src", np.arange(64), "dst", np.arange(64)[::-1], PAGE)
    return writer, receiver, dst, pages


def test_failure_after_some_bytes_is_reported_on_both_sides() -> None:
    writer, receiver, dst, pages = make_pair(LoopbackFaults(fail_after_bytes=0))
    handle = writer.write(receiver.address(), pages, transfer_id="f", deadline=time.monotonic() + 5)
    assert handle.wait(5) is TransferStatus.FAILED
    assert handle.error == "injected failure"
    assert receiver.wait_inbound("f", 5) is TransferStatus.FAILED
    assert not dst.any()
    writer.close()
    receiver.close()


def test_a_slow_transfer_times_out_and_the_receiver_hears_of_it() -> None:
    # Started at the real time: a transport that read time.monotonic() instead would finish.
    clock = FakeClock(now=time.monotonic())
    writer, receiver, _, pages = make_pair(LoopbackFaults(delay_per_message_s=0.01), clock)
    handle = writer.write(receiver.address(), pages, transfer_id="s", deadline=clock.now + 5)
    clock.now += 10  # the copy is slower than its deadline
    assert handle.wait(5) is TransferStatus.TIMED_OUT
    assert handle.error == "the deadline passed"
    assert receiver.wait_inbound("s", 5) is TransferStatus.TIMED_OUT
    writer.close()
    receiver.close()


def test_closing_the_writer_fails_its_transfers() -> None:
    writer, receiver, _, pages = make_pair(LoopbackFaults(stall=True))
    handle = writer.write(receiver.address(), pages, transfer_id="w", deadline=time.monotonic() + 5)
    writer.close()
    assert handle.wait(30) is TransferStatus.FAILED
    receiver.close()


def test_fence_waits_for_a_write_under_way() -> None:
    book = InboundTransfers()
    assert book.begin("t") is None
    assert book.begin_write("t")
    fenced = threading.Event()
    threading.Thread(target=lambda: book.fence("t", 5) and fenced.set()).start()
    time.sleep(0.05)
    assert not fenced.is_set()  # a copy into the blocks is still running
    book.end_write("t", 10)
    assert fenced.wait(30)
    assert not book.begin_write("t")  # nothing more may land
    assert book.status("t") is TransferStatus.CANCELLED


def test_fence_times_out_while_a_write_hangs() -> None:
    book = InboundTransfers()
    book.begin("t")
    book.begin_write("t")
    assert not book.fence("t", 0.05)


def test_a_running_transfer_cannot_be_forgotten() -> None:
    book = InboundTransfers()
    book.begin("t")
    assert not book.forget("t")
    assert book.fence("t", 1)
    assert book.forget("t")
    assert book.begin("t") is not None
