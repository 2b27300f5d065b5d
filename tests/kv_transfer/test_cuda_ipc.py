"""The cuda_ipc transport: device-to-device pushes between processes (``gpu`` tests), and what
can be checked without a GPU (its batching, its refusal on a CPU host)."""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kv_transfer import PageTable, TransferStatus, make_transport
from kv_transfer.cuda_ipc import (
    BATCH_BYTES,
    MIN_KERNEL_ARG_WORDS,
    CudaIpcTransport,
    stage_kernel_args,
)
from kv_transfer.shm import copy_runs_numpy
from kv_transfer.transfer_plan import DST_OFF, LEN, SRC_OFF, make_plan
from support.receiver_process import inbound_report, read_address, receiver_script

pytestmark = pytest.mark.timeout(120)

PAGE = 8192
DST_BYTES = 64 << 20

# The receiver on GPU argv[1]: zeroed device KV memory, its address on stdout, then "wait <id>"
# answers the inbound status and a digest of the memory.
RECEIVER = receiver_script(
    'make_transport("cuda_ipc")',
    "transport.allocate(size)",
    size=DST_BYTES,
    setup="import cupy; cupy.cuda.Device(int(sys.argv[1])).use()",
    host_bytes="dst.get()",
    wait_s=30,
)


def test_batches_cover_every_run_in_order_and_bound_the_fence_wait() -> None:
    rng = np.random.default_rng(0)
    slots = 3 * BATCH_BYTES // PAGE
    pages = PageTable.from_blocks(
        "src", rng.permutation(slots), "dst", rng.permutation(slots), PAGE
    )
    plan = make_plan(pages, {"src": slots * PAGE}, {"dst": slots * PAGE})
    batches = CudaIpcTransport._batches(None, plan)  # type: ignore[arg-type]
    assert np.array_equal(np.concatenate([runs for runs, _ in batches]), plan.runs)
    assert [n for _, n in batches] == [int(r[:, LEN].sum()) for r, _ in batches]
    assert all(n <= BATCH_BYTES for _, n in batches) and len(batches) == 3


def test_batches_of_uneven_runs_cut_near_each_multiple_of_the_batch_size() -> None:
    # A long run (two batches' worth), then many small pages of two sizes.
    lengths = [2 * BATCH_BYTES + 3, *([PAGE, 3 * PAGE] * (BATCH_BYTES // PAGE // 2))]
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    runs = np.zeros((len(lengths), 5), dtype=np.int64)
    runs[:, LEN] = lengths
    runs[:, SRC_OFF] = runs[:, DST_OFF] = offsets[:-1]  # back to back
    plan = SimpleNamespace(runs=runs, num_bytes=int(runs[:, LEN].sum()))
    batches = CudaIpcTransport._batches(None, plan)  # type: ignore[arg-type]
    assert np.array_equal(np.concatenate([r for r, _ in batches]), runs)
    assert [n for _, n in batches] == [int(r[:, LEN].sum()) for r, _ in batches]
    # The long run is a batch of its own; the rest stop within one run past a multiple.
    assert batches[0][1] == lengths[0]
    assert all(n < BATCH_BYTES + 3 * PAGE for _, n in batches[1:])
    empty = SimpleNamespace(runs=runs[:0], num_bytes=0)
    assert CudaIpcTransport._batches(None, empty) == []  # type: ignore[arg-type]
    # Up to BATCH_BYTES in all (here exactly): one batch of every run.
    few = runs[1 : 1 + BATCH_BYTES // PAGE // 2]
    small = SimpleNamespace(runs=few, num_bytes=int(few[:, LEN].sum()))
    assert small.num_bytes == BATCH_BYTES
    ((only, num_bytes),) = CudaIpcTransport._batches(None, small)  # type: ignore[arg-type]
    assert only is small.runs and num_bytes == small.num_bytes <= BATCH_BYTES


@pytest.mark.parametrize("layout", ["scattered", "in-order", "two-regions-mixed-lengths"])
def test_staged_kernel_args_move_the_same_bytes_as_the_host_copy(layout: str) -> None:
    """The copy kernel's arguments, staged batch by batch in one reused buffer, then read the
    way each thread block reads them (run i: its row of the runs, its regions' bases) and
    applied on host memory, land what the shm writer's copy of the same runs lands."""
    rng = np.random.default_rng(7)
    slots = 96
    src = [rng.integers(0, 256, slots * PAGE, np.uint8) for _ in range(2)]
    got = [np.zeros(slots * PAGE, np.uint8) for _ in range(2)]
    expected = [np.zeros(slots * PAGE, np.uint8) for _ in range(2)]
    if layout == "in-order":
        pages = PageTable.from_blocks("a", np.arange(40), "c", rng.permutation(slots)[:40], PAGE)
    else:
        ab = [PageTable.from_blocks(n, rng.permutation(slots)[:30], m, rng.permutation(slots)[:30],
                                    PAGE) for n, m in (("a", "c"), ("b", "d"))]  # fmt: skip
        pages = ab[0] if layout == "scattered" else PageTable.concat(ab)
    table = pages.table.copy()
    if layout == "two-regions-mixed-lengths":
        table[::4, LEN] = 100  # runs of another length, and ends not 16-byte aligned
    pages = PageTable(pages.src_regions, pages.dst_regions, table)
    lengths = {n: slots * PAGE for n in "abcd"}
    plan = make_plan(pages, lengths, lengths)
    src_bases = np.array([a.ctypes.data for a in src[: len(plan.src_regions)]], np.int64)
    dst_bases = np.array([a.ctypes.data for a in got[: len(plan.dst_regions)]], np.int64)
    buffer = np.zeros(MIN_KERNEL_ARG_WORDS, np.int64)  # a lane's, reused by every batch
    for a, b in [(0, 5), (5, len(plan.runs))]:  # two batches of one transfer
        runs = plan.runs[a:b]
        words = buffer[: runs.size + len(src_bases) + len(dst_bases)]
        at_runs, at_src, at_dst = stage_kernel_args(runs, src_bases, dst_bases, words)
        for block in range(len(runs)):  # what thread block `block` reads
            run = words[at_runs + 5 * block : at_runs + 5 * block + 5].tolist()
            source = int(words[at_src + run[0]]) + run[1]
            ctypes.memmove(int(words[at_dst + run[2]]) + run[3], source, run[4])
    host_dst_bases = np.array([a.ctypes.data for a in expected[: len(plan.dst_regions)]], np.int64)
    copy_runs_numpy(plan.runs, src_bases, host_dst_bases)
    assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))
    assert any(g.any() for g in got)


def has_cuda() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


def test_without_a_gpu_the_transport_refuses_to_start() -> None:
    if has_cuda():
        pytest.skip("this host has a CUDA device")
    with pytest.raises(RuntimeError, match="cuda_ipc KV transport needs"):
        make_transport("cuda_ipc")


def push_scattered(receiver_device: int, writer_device: int) -> None:
    import cupy

    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(receiver_device)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        peer = read_address(proc)
        with cupy.cuda.Device(writer_device):
            writer = make_transport("cuda_ipc")
            host = np.random.default_rng(0).integers(0, 256, DST_BYTES, np.uint8)
            src = writer.allocate(DST_BYTES)
            src.set(host)
        try:
            writer.register("src", src)
            writer.connect(peer)
            num_slots = DST_BYTES // PAGE
            rng = np.random.default_rng(1)
            s, d = rng.permutation(num_slots), rng.permutation(num_slots)
            pages = PageTable.from_blocks("src", s, "dst", d, PAGE)
            handle = writer.write(peer, pages, transfer_id="g1", deadline=time.monotonic() + 30)
            assert handle.wait(40) is TransferStatus.DONE, handle
            expected = np.zeros((num_slots, PAGE), np.uint8)
            expected[d] = host.reshape(-1, PAGE)[s]
            assert inbound_report(proc, "g1") == ("DONE", hashlib.sha256(expected).hexdigest())
        finally:
            writer.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.gpu
def test_two_processes_on_one_gpu() -> None:
    push_scattered(receiver_device=0, writer_device=0)


@pytest.mark.gpu
def test_two_gpus_with_peer_access() -> None:
    import cupy

    runtime = cupy.cuda.runtime
    if runtime.getDeviceCount() < 2 or not runtime.deviceCanAccessPeer(0, 1):
        pytest.skip("needs two GPUs with peer access")
    push_scattered(receiver_device=1, writer_device=0)


@pytest.mark.gpu
def test_self_test_moves_device_memory() -> None:
    from kv_transfer import run_self_test

    transport = make_transport("cuda_ipc")
    try:
        report = run_self_test(transport, num_probe_bytes=4 << 20)
    finally:
        transport.close()
    assert report.is_ok, report
    assert report.lanes[0] == "cuda_ipc/kernel"
