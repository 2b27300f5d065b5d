"""KV transfer bandwidth and per-transfer latency between two processes on this host.

    python benchmarks/kv_transfer.py [--transports ucx shm] [--sizes-mib 1 4 16 64 256] [--rounds 3]

A receiver process registers zeroed KV memory; this process pushes pages of one block of one
layer of the `small` model (16 tokens x 4 KV heads x 64 x 2 bytes = 8 KiB) into it, laid out three
ways: `contiguous` (blocks allocated in order on both sides, so pages coalesce into long runs),
`dst-scattered` (in order on the writer, random block ids on the receiver) and `scattered`
(random block ids on both sides: every page is its own run). A transfer's time runs from
`write()` to its handle reading DONE, which needs the receiver's acknowledgement that every byte
landed. Then it runs UCX's own `ucx_perftest -t tag_bw` between two processes at the same sizes,
the ceiling to compare with, and times a plain contiguous memcpy (numpy `copyto`) of each size in
this process right before each transfer: every transport's rate is also given as a share of that,
the median over the (memcpy, transfer) pairs, so a load change mid-case hits both sides of a
ratio. With several transports the cases are interleaved (each size and layout runs on every
transport in turn), so a shared machine's load changes hit them alike; `--rounds` repeats the
whole sweep, and each row also gives its fastest transfer, which a loaded host disturbs least,
and that as a share of the fastest memcpy (`best/best`).
`--transports shm-numpy` is the shm transport with its writer on the numpy copy. The `small 2k
tok` case (24 MiB) always runs; `--sizes-mib` with no sizes runs only it.

`--transports cuda_ipc` (GPU, runs alone) pushes device memory into the receiver's device memory
on GPU 0; its memcpy ceiling is then a device-to-device copy of the same size (CuPy, timed after
a device synchronize), counted like the host one: bytes moved once over the time.

A second table splits each row's transfers into phases (medians, microseconds): the `write()`
call (planning, mapping the peer), its return until the handle went IN_PROGRESS (the hand-off
to a copy thread and, for shm and cuda_ipc, the claim of a slot in the peer's table; negative
when the copy thread got there first), IN_PROGRESS until the handle was finished (the copies
and their fence checks, the end of the claim), and from then until `wait()` returned (waking
the waiter).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

# This script's own name shadows the kv_transfer package: import the package, not the script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import numpy as np  # noqa: E402

from kv_transfer import PageTable, PeerAddress, TransferStatus, make_transport  # noqa: E402

PAGE = 16 * 4 * 64 * 2  # bytes of one block of one layer of the small model
SMALL_2K_BYTES = 12 * 2 * 2048 * 4 * 64 * 2  # the small model's KV for 2048 tokens (24 MiB)


# `--transports shm-numpy`: the shm transport with its writer on the numpy copy, not the native one.
VARIANTS = {"shm-numpy": ("shm", {"native_copy": False})}
# Transports whose regions are device memory: they run alone, against a device memcpy.
DEVICE_TRANSPORTS = {"cuda_ipc"}


def receiver_main(transport_name: str, num_bytes: int, conn: Connection) -> None:
    transport = make_transport(transport_name)
    # Memory the transport receives into (shared memory for shm).
    transport.register("dst", transport.allocate(num_bytes))
    conn.send(transport.address().to_bytes())
    conn.recv()  # until told to stop
    transport.close()


def make_pages(num_bytes: int, num_slots: int, layout: str, seed: int) -> PageTable:
    """Pages of one KV region, as a KV cache hands them over (block ids → a PageTable)."""
    num_pages = num_bytes // PAGE
    if layout == "contiguous":
        blocks = np.arange(num_pages)
        return PageTable.from_blocks("src", blocks, "dst", blocks, PAGE)
    rng = np.random.default_rng(seed)
    dst = rng.choice(num_slots, num_pages, replace=False)
    if layout == "dst-scattered":  # fresh prefill blocks in order, decode blocks from a free list
        return PageTable.from_blocks("src", np.arange(num_pages), "dst", dst, PAGE)
    src = rng.choice(num_slots, num_pages, replace=False)
    return PageTable.from_blocks("src", src, "dst", dst, PAGE)


# The phases of one transfer (seconds): the write() call, write() return -> IN_PROGRESS,
# IN_PROGRESS -> finished, finished -> wait() return.
PHASES = ("write()", "->in progress", "->finished", "->woken")


@dataclass
class CaseTimes:
    """One case's transfers, in seconds, each after the contiguous memcpy timed right before it."""

    seconds: list[float] = field(default_factory=list)
    memcpy_seconds: list[float] = field(default_factory=list)
    # phases: [num_transfers] of one value per PHASES
    phases: list[tuple[float, float, float, float]] = field(default_factory=list)

    def phase_medians(self) -> list[float]:
        return [statistics.median(column) for column in zip(*self.phases, strict=True)]


def time_transfers(
    transport, peer: PeerAddress, pages: PageTable, iters: int, memcpy: Callable[[], None]
) -> CaseTimes:
    """`iters` (memcpy, transfer) pairs: a contiguous `memcpy` of the same size right before
    each transfer. Transfers are timed on time.monotonic(), the clock of the handle's stamps."""
    times = CaseTimes()
    for i in range(iters + 1):  # the first one warms up
        start = time.perf_counter()
        memcpy()
        memcpy_elapsed = time.perf_counter() - start
        start = time.monotonic()
        handle = transport.write(
            peer, pages, transfer_id=f"bench-{time.time_ns()}-{i}", deadline=time.monotonic() + 30
        )
        returned = time.monotonic()
        status = handle.wait(35)
        woken = time.monotonic()
        if status is not TransferStatus.DONE:
            raise RuntimeError(f"transfer ended {status.name}: {handle.error}")
        if i:
            assert handle.in_progress_at is not None and handle.finished_at is not None
            times.seconds.append(woken - start)
            times.memcpy_seconds.append(memcpy_elapsed)
            times.phases.append(
                (
                    returned - start,
                    handle.in_progress_at - returned,
                    handle.finished_at - handle.in_progress_at,
                    woken - handle.finished_at,
                )
            )
    return times


def run_perftest(num_bytes: int, iters: int) -> float | None:
    """GB/s that `ucx_perftest -t tag_bw` reaches between two processes, or None."""
    try:
        import libucx
    except ImportError:
        return None
    # Here, not at the top: `deploy` imports the rest of pdserve, which a bare CUDA image
    # running `--transports cuda_ipc --no-perftest` lacks.
    from deploy.local_ports import free_ports

    root = Path(libucx.__file__).parent
    binary = root / "bin" / "ucx_perftest"
    if not binary.exists():
        return None
    env = {**os.environ, "LD_LIBRARY_PATH": str(root / "lib"), "UCX_WARN_UNUSED_ENV_VARS": "n"}
    port = str(free_ports(1)[0])
    args = ["-t", "tag_bw", "-s", str(num_bytes), "-n", str(iters), "-p", port]
    server = subprocess.Popen(
        [str(binary), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)
        client = subprocess.run(
            [str(binary), "127.0.0.1", *args], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        server.wait(timeout=30) if server.poll() is None else None
    match = re.search(r"Final:\s+\d+\s+\S+\s+\S+\s+\S+\s+(\S+)\s+(\S+)", client.stdout)
    # ucx_perftest's "MB/s" are MiB/s.
    return float(match.group(2)) * 2**20 / 1e9 if match else None


def memcpy_of(num_bytes: int, on_device: bool) -> Callable[[], None]:
    """A contiguous copy of `num_bytes` between two buffers allocated (and touched) once: host
    memory, or device memory with the copy waited for."""
    if on_device:
        import cupy

        src, dst = cupy.ones(num_bytes, cupy.uint8), cupy.zeros(num_bytes, cupy.uint8)

        def device_copy() -> None:
            cupy.copyto(dst, src)
            cupy.cuda.Device().synchronize()

        device_copy()
        return device_copy
    host_src, host_dst = np.ones(num_bytes, np.uint8), np.zeros(num_bytes, np.uint8)
    np.copyto(host_dst, host_src)
    return lambda: np.copyto(host_dst, host_src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", nargs="+", default=["ucx"])
    parser.add_argument("--transport", help="one transport (the same as --transports NAME)")
    parser.add_argument("--sizes-mib", type=int, nargs="*", default=[1, 4, 16, 64, 256])
    parser.add_argument(
        "--layouts", nargs="+", default=["contiguous", "dst-scattered", "scattered"]
    )
    parser.add_argument("--no-perftest", action="store_true")
    parser.add_argument("--rounds", type=int, default=1, help="times to run the whole sweep")
    args = parser.parse_args()
    names = [args.transport] if args.transport else args.transports
    if "loopback" in names:
        parser.error("loopback moves bytes within one process; this benchmark needs two")
    on_device = bool(DEVICE_TRANSPORTS & set(names))
    if on_device and len(names) > 1:
        parser.error(f"{sorted(DEVICE_TRANSPORTS & set(names))} runs alone (device memory)")

    max_bytes = max(max(args.sizes_mib, default=0) << 20, SMALL_2K_BYTES)
    ctx = mp.get_context("spawn")
    src = np.random.default_rng(0).integers(0, 256, max_bytes, np.uint8)
    pairs = {}  # name -> (writer, peer, pipe, receiver process)
    for name in names:
        parent, child = ctx.Pipe()
        transport, options = VARIANTS.get(name, (name, {}))
        proc = ctx.Process(target=receiver_main, args=(transport, max_bytes, child))
        proc.start()
        peer = PeerAddress.from_bytes(parent.recv())
        writer = make_transport(transport, **options)
        if on_device:
            device_src = writer.allocate(max_bytes)
            device_src.set(src)
            writer.register("src", device_src)
        else:
            writer.register("src", src)
        writer.connect(peer)
        pairs[name] = (writer, peer, parent, proc)
        print(f"transport: {writer.info()}")
    print(f"page: {PAGE} B; time = write() until DONE (receiver acknowledged every byte)")
    header = (
        f"{'round':>5} {'size':>12} {'layout':>13} {'transport':>9} {'pages':>6} "
        f"{'median ms':>10} {'p90 ms':>8} {'min ms':>7} {'GB/s':>6} {'memcpy GB/s':>12} "
        f"{'/memcpy':>8} {'best/best':>9} {'perftest GB/s':>14} {'/perftest':>9}"
    )
    print(header)
    print("-" * len(header))
    cases = [(size << 20, f"{size} MiB") for size in args.sizes_mib]
    cases.append((SMALL_2K_BYTES, "small 2k tok"))
    perftest: dict[int, float | None] = {}
    phase_rows: list[str] = []  # the second table, printed after the sweep
    try:
        for round_index, (num_bytes, label) in (
            (r, case) for r in range(1, args.rounds + 1) for case in cases
        ):
            iters = 5 if num_bytes >= 128 << 20 else 20
            if not args.no_perftest and "ucx" in names and num_bytes not in perftest:
                perftest[num_bytes] = run_perftest(num_bytes, iters)
            memcpy = memcpy_of(num_bytes, on_device)
            for layout in args.layouts:
                pages = make_pages(num_bytes, max_bytes // PAGE, layout, seed=num_bytes)
                for name, (writer, peer, _, _) in pairs.items():
                    times = time_transfers(writer, peer, pages, iters, memcpy)
                    seconds, memcpy_seconds = times.seconds, times.memcpy_seconds
                    memcpy_gbps = num_bytes / statistics.median(memcpy_seconds) / 1e9
                    # Bandwidth share = memcpy time / transfer time, pair by pair.
                    share = statistics.median(
                        m / t for m, t in zip(memcpy_seconds, seconds, strict=True)
                    )
                    # The fastest transfer against the fastest memcpy: what a quiet moment of a
                    # shared host allows each.
                    best_share = min(memcpy_seconds) / min(seconds)
                    median = statistics.median(seconds)
                    p90 = sorted(seconds)[int(0.9 * (len(seconds) - 1))]
                    gbps = num_bytes / median / 1e9
                    ref = perftest.get(num_bytes)
                    ref_text = f"{ref:14.2f}" if ref else f"{'n/a':>14}"
                    ratio = f"{gbps / ref:9.0%}" if ref else f"{'':>9}"
                    print(
                        f"{round_index:>5} {label:>12} {layout:>13} {name:>9} {len(pages):>6} "
                        f"{median * 1e3:10.2f} {p90 * 1e3:8.2f} {min(seconds) * 1e3:7.2f} "
                        f"{gbps:6.2f} {memcpy_gbps:12.2f} {share:8.0%} {best_share:9.0%} "
                        f"{ref_text} {ratio}",
                        flush=True,
                    )
                    phases = " ".join(f"{p * 1e6:>13.0f}" for p in times.phase_medians())
                    phase_rows.append(
                        f"{round_index:>5} {label:>12} {layout:>13} {name:>9} {len(pages):>6} "
                        f"{phases} {median * 1e6:>9.0f}"
                    )
        print("\nphases of each row's transfers (median us; they add up to about the total)")
        header = (
            f"{'round':>5} {'size':>12} {'layout':>13} {'transport':>9} {'pages':>6} "
            + " ".join(f"{p:>13}" for p in PHASES)
            + f" {'total':>9}"
        )
        print(header)
        print("-" * len(header))
        print("\n".join(phase_rows), flush=True)
    finally:
        for writer, _, parent, proc in pairs.values():
            writer.close()
            parent.send("stop")
            proc.join(timeout=10)


if __name__ == "__main__":
    main()
