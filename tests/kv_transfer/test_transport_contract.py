"""The contract every KV transport keeps, run against each of them (loopback, ucx and shm)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from kv_transfer import KvTransport, PageCopy, PageTable, TransferStatus, run_self_test

pytestmark = pytest.mark.timeout(60)

PAGE = 8192  # one block of one layer of the small model: 16 tokens x 4 heads x 64 x 2 bytes


def view(transport: KvTransport, name: str) -> np.ndarray:
    return transport._regions[name].view


def scattered_pages(num_pages: int, num_slots: int, seed: int = 0) -> list[PageCopy]:
    rng = np.random.default_rng(seed)
    src = rng.choice(num_slots, num_pages, replace=False)
    dst = rng.choice(num_slots, num_pages, replace=False)
    return [
        PageCopy("src", int(s) * PAGE, "dst", int(d) * PAGE, PAGE)
        for s, d in zip(src, dst, strict=True)
    ]


def assert_landed(writer: KvTransport, receiver: KvTransport, pages: list[PageCopy]) -> None:
    src, dst = view(writer, "src"), view(receiver, "dst")
    for p in pages:
        assert np.array_equal(
            dst[p.dst_offset : p.dst_offset + p.length], src[p.src_offset : p.src_offset + p.length]
        ), p


def deadline(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


def test_scattered_pages_land_byte_exact(make_pair) -> None:
    writer, receiver = make_pair()
    pages = scattered_pages(64, num_slots=128)
    handle = writer.write(receiver.address(), pages, transfer_id="t1", deadline=deadline())
    assert handle.wait(10) is TransferStatus.DONE, handle
    assert handle.bytes_moved == 64 * PAGE
    assert receiver.wait_inbound("t1", 5) is TransferStatus.DONE
    assert_landed(writer, receiver, pages)
    untouched = np.ones(128, bool)
    untouched[[p.dst_offset // PAGE for p in pages]] = False
    assert not view(receiver, "dst").reshape(128, PAGE)[untouched].any()


def test_many_small_pages_of_mixed_sizes(make_pair) -> None:
    writer, receiver = make_pair()
    # 2000 pages of 100..500 bytes: no uniform-page fast path, many staged runs.
    rng = np.random.default_rng(1)
    lengths = rng.integers(100, 500, 2000)
    offsets = np.concatenate(([0], np.cumsum(lengths + 3)[:-1]))
    pages = [
        PageCopy("src", int(o), "dst", int(o) + 7, int(n))
        for o, n in zip(offsets[::-1], lengths[::-1], strict=True)
    ]
    handle = writer.write(receiver.address(), pages, transfer_id="small", deadline=deadline())
    assert handle.wait(10) is TransferStatus.DONE, handle
    assert_landed(writer, receiver, pages)


def test_large_transfer(make_pair) -> None:
    size = 64 << 20
    writer, receiver = make_pair(src_bytes=size, dst_bytes=size)
    contiguous = [PageCopy("src", i * PAGE, "dst", i * PAGE, PAGE) for i in range(size // PAGE)]
    handle = writer.write(receiver.address(), contiguous, transfer_id="big", deadline=deadline())
    assert handle.wait(20) is TransferStatus.DONE, handle
    assert np.array_equal(view(receiver, "dst"), view(writer, "src"))


@pytest.mark.parametrize("cancel", [False, True], ids=["resumed", "cancelled"])
def test_a_paused_push_holds_its_last_message_back(make_pair, cancel: bool) -> None:
    """The test hook behind killing a node mid-push: the receiver sees the transfer begin and
    holds part of it; the push then resumes to DONE, or a cancel ends it on both sides."""
    size = 12 << 20  # three 4 MiB messages
    writer, receiver = make_pair(src_bytes=size, dst_bytes=size, pause_before_last_s=0.5)
    pages = [PageCopy("src", i * PAGE, "dst", i * PAGE, PAGE) for i in range(size // PAGE)]
    handle = writer.write(receiver.address(), pages, transfer_id="p", deadline=deadline())
    time.sleep(0.2)
    assert not handle.status.is_terminal
    assert receiver.inbound_status("p") is TransferStatus.IN_PROGRESS
    if cancel:
        assert handle.cancel()
        assert receiver.wait_inbound("p", 5) is TransferStatus.CANCELLED
        return
    assert handle.wait(10) is TransferStatus.DONE, handle
    assert np.array_equal(view(receiver, "dst"), view(writer, "src"))


def test_status_goes_pending_to_done(make_pair) -> None:
    writer, receiver = make_pair()
    handle = writer.write(
        receiver.address(), scattered_pages(8, 128), transfer_id="s", deadline=deadline()
    )
    assert handle.status in (
        TransferStatus.PENDING,
        TransferStatus.IN_PROGRESS,
        TransferStatus.DONE,
    )
    assert handle.wait(10) is TransferStatus.DONE
    assert handle.error is None and handle.seconds is not None
    assert handle.status.is_terminal and not TransferStatus.IN_PROGRESS.is_terminal
    # Each status change is stamped, in order (the benchmark's phases).
    assert handle.in_progress_at is not None and handle.finished_at is not None
    assert handle.started_at <= handle.in_progress_at <= handle.finished_at


def test_wait_async(make_pair) -> None:
    writer, receiver = make_pair()
    handle = writer.write(
        receiver.address(), scattered_pages(8, 128), transfer_id="a", deadline=deadline()
    )
    assert asyncio.run(handle.wait_async(10)) is TransferStatus.DONE


def test_cancel_stops_the_transfer(make_pair) -> None:
    writer, receiver = make_pair(stalled=True)
    handle = writer.write(
        receiver.address(), scattered_pages(8, 128), transfer_id="c", deadline=deadline()
    )
    time.sleep(0.05)
    assert handle.cancel()
    assert handle.wait(30) is TransferStatus.CANCELLED
    assert not handle.cancel()  # already ended


def test_a_peer_that_never_completes_times_out(make_pair) -> None:
    writer, receiver = make_pair(stalled=True)
    # The deadline, not the wait, ends it: a stalled peer is never waited on past the deadline.
    handle = writer.write(
        receiver.address(), scattered_pages(8, 128), transfer_id="slow", deadline=deadline(0.3)
    )
    assert handle.wait(30) is TransferStatus.TIMED_OUT, handle
    assert "deadline" in (handle.error or "")


def test_closed_peer_fails_without_hanging(make_pair) -> None:
    writer, receiver = make_pair()
    peer = receiver.address()
    receiver.close()
    time.sleep(0.05)  # the BYE travels
    # Fails well before its 10 s deadline: a closed peer is a failure, not a wait.
    handle = writer.write(peer, scattered_pages(8, 128), transfer_id="gone", deadline=deadline())
    assert handle.wait(5) is TransferStatus.FAILED, handle
    assert "closed" in (handle.error or "")


@pytest.mark.parametrize(
    ("page", "message"),
    [
        (PageCopy("src", 0, "nope", 0, PAGE), "not registered"),
        (PageCopy("nope", 0, "dst", 0, PAGE), "not registered"),
        (PageCopy("src", 0, "dst", (1 << 20) - 100, PAGE), "outside"),
        (PageCopy("src", -8, "dst", 0, PAGE), "outside"),
        (PageCopy("src", 0, "dst", 0, 0), "empty"),
    ],
)
def test_bad_pages_raise_before_any_byte_moves(make_pair, page: PageCopy, message: str) -> None:
    writer, receiver = make_pair()
    good = PageCopy("src", 0, "dst", 0, PAGE)
    with pytest.raises(ValueError, match=message):
        writer.write(receiver.address(), [good, page], transfer_id="bad", deadline=deadline())
    time.sleep(0.02)
    assert not view(receiver, "dst").any()
    assert receiver.inbound_status("bad") is None


def test_concurrent_transfers(make_pair) -> None:
    writer, receiver = make_pair(src_bytes=4 << 20, dst_bytes=4 << 20)
    num_slots = (4 << 20) // PAGE
    slots = np.random.default_rng(2).permutation(num_slots).reshape(8, -1)
    peer = receiver.address()
    handles, pages_by_thread = [None] * 8, [None] * 8

    def push(i: int) -> None:
        pages = [PageCopy("src", int(s) * PAGE, "dst", int(s) * PAGE, PAGE) for s in slots[i]]
        pages_by_thread[i] = pages
        handles[i] = writer.write(peer, pages, transfer_id=f"c{i}", deadline=deadline())

    threads = [threading.Thread(target=push, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, handle in enumerate(handles):
        assert handle.wait(10) is TransferStatus.DONE, handle
        assert receiver.wait_inbound(f"c{i}", 5) is TransferStatus.DONE
    assert np.array_equal(view(receiver, "dst"), view(writer, "src"))


def test_fence_before_arrival_refuses_the_transfer(make_pair) -> None:
    writer, receiver = make_pair()
    assert receiver.fence("late", timeout=1)
    handle = writer.write(
        receiver.address(), scattered_pages(8, 128), transfer_id="late", deadline=deadline()
    )
    assert handle.wait(5) is TransferStatus.FAILED, handle
    assert "fenced" in (handle.error or "")
    time.sleep(0.05)
    assert not view(receiver, "dst").any()


def test_reused_transfer_id_is_refused(make_pair) -> None:
    writer, receiver = make_pair()
    peer = receiver.address()
    first = writer.write(peer, scattered_pages(4, 128), transfer_id="once", deadline=deadline())
    assert first.wait(5) is TransferStatus.DONE
    again = writer.write(peer, scattered_pages(4, 128), transfer_id="once", deadline=deadline())
    assert again.wait(5) is TransferStatus.FAILED
    assert "already used" in (again.error or "")


def test_self_test_reports_lanes_and_succeeds(transport_name: str) -> None:
    from kv_transfer import make_transport

    transport = make_transport(transport_name)
    try:
        report = run_self_test(transport, num_probe_bytes=4 << 20)
    finally:
        transport.close()
    assert report.is_ok, report
    assert transport.region_lengths() == {}  # the self-test cleans up after itself
    assert report.transport == transport_name and report.lanes and report.probe_gbps > 0
    assert transport_name in report.summary()


def test_page_table_across_several_regions(make_pair) -> None:
    writer, receiver = make_pair()
    v_cache = receiver.allocate(1 << 20)
    receiver.register("dst_v", v_cache)
    peer = receiver.address()
    k = PageTable.from_blocks("src", [5, 1, 2], "dst", [0, 9, 3], PAGE)
    v = PageTable.from_blocks("src", [7, 8], "dst_v", [4, 5], PAGE)
    handle = writer.write(peer, PageTable.concat([k, v]), transfer_id="kv", deadline=deadline())
    assert handle.wait(10) is TransferStatus.DONE, handle
    src = view(writer, "src").reshape(-1, PAGE)
    assert np.array_equal(view(receiver, "dst").reshape(-1, PAGE)[[0, 9, 3]], src[[5, 1, 2]])
    assert np.array_equal(v_cache.reshape(-1, PAGE)[[4, 5]], src[[7, 8]])


def test_a_forgotten_transfer_id_stays_refused(make_pair) -> None:
    writer, receiver = make_pair()
    peer = receiver.address()
    first = writer.write(peer, scattered_pages(4, 128), transfer_id="f", deadline=deadline())
    assert first.wait(5) is TransferStatus.DONE
    assert receiver.wait_inbound("f", 5) is TransferStatus.DONE
    assert receiver.forget_inbound("f")
    assert receiver.inbound_status("f") is None
    late = writer.write(peer, scattered_pages(4, 128), transfer_id="f", deadline=deadline())
    assert late.wait(5) is TransferStatus.FAILED


@pytest.mark.parametrize("in_order", ["src", "dst"])
def test_pages_in_order_on_one_side_only(make_pair, in_order: str) -> None:
    writer, receiver = make_pair()
    shuffled = np.random.default_rng(3).permutation(128)
    ordered = np.arange(128)
    src, dst = (ordered, shuffled) if in_order == "src" else (shuffled, ordered)
    pages = PageTable.from_blocks("src", src, "dst", dst, PAGE)
    handle = writer.write(receiver.address(), pages, transfer_id="half", deadline=deadline())
    assert handle.wait(10) is TransferStatus.DONE, handle
    expected = np.empty((128, PAGE), np.uint8)
    expected[dst] = view(writer, "src").reshape(-1, PAGE)[src]
    assert np.array_equal(view(receiver, "dst").reshape(-1, PAGE), expected)
