"""What a KV push costs besides moving bytes: the shm (and cuda_ipc) protocol's host side.

    python benchmarks/kv_transfer_overhead.py [--transport shm] [--pages 8192] [--repeats 40]

Pushes `--pages` pages of 16 bytes each (so the copy itself takes microseconds) from this process
into a receiver process, laid out `contiguous` (one run after coalescing) and `scattered`
(random block ids on both sides: every page its own run), and prints the median over the
repeats of the time `write()` takes to return (planning: checking and coalescing the pages)
and from `write()` until the handle reads DONE (plus the copy thread's claim, copy, release and
the handle's wake-up). On a GPU the same protocol runs under cuda_ipc's copy kernel, so these
times are the floor of a cuda_ipc push of that many pages too.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

# This script's own name starts like the kv_transfer package: import the package, not a script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import numpy as np  # noqa: E402

from kv_transfer import PageTable, PeerAddress, TransferStatus, make_transport  # noqa: E402

PAGE = 16


def receiver_main(transport_name: str, num_bytes: int, conn: Connection) -> None:
    transport = make_transport(transport_name)
    transport.register("dst", transport.allocate(num_bytes))
    conn.send(transport.address().to_bytes())
    conn.recv()  # until told to stop
    transport.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--pages", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    num_bytes = args.pages * PAGE
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    receiver = ctx.Process(target=receiver_main, args=(args.transport, num_bytes, child))
    receiver.start()
    peer = PeerAddress.from_bytes(parent.recv())
    writer = make_transport(args.transport)
    source = writer.allocate(num_bytes)
    writer.register("src", source)
    writer.connect(peer)
    rng = np.random.default_rng(0)
    layouts = {
        "contiguous": PageTable.from_blocks(
            "src", np.arange(args.pages), "dst", np.arange(args.pages), PAGE
        ),
        "scattered": PageTable.from_blocks(
            "src", rng.permutation(args.pages), "dst", rng.permutation(args.pages), PAGE
        ),
    }
    print(f"{args.transport}: {args.pages} pages of {PAGE} B, median of {args.repeats}")
    print(f"{'layout':>11} {'write() µs':>11} {'until DONE µs':>14}")
    try:
        for layout, pages in layouts.items():
            returned, done = [], []
            for i in range(args.repeats + 5):  # 5 warm-ups
                start = time.perf_counter()
                handle = writer.write(
                    peer, pages, transfer_id=f"{layout}-{i}", deadline=time.monotonic() + 10
                )
                back = time.perf_counter()
                if handle.wait(10) is not TransferStatus.DONE:
                    raise RuntimeError(f"transfer ended {handle.status.name}: {handle.error}")
                end = time.perf_counter()
                if i >= 5:
                    returned.append(back - start)
                    done.append(end - start)
            print(
                f"{layout:>11} {statistics.median(returned) * 1e6:11.0f} "
                f"{statistics.median(done) * 1e6:14.0f}"
            )
    finally:
        writer.close()
        parent.send("stop")
        receiver.join(timeout=10)


if __name__ == "__main__":
    main()
