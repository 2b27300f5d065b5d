"""A KV receiver in a child process, and a scattered push into it checked byte for byte: the
scaffolding the shm and ucx two-process tests share.

The receiver registers ``DST_BYTES`` of zeroed KV memory as ``dst``, prints its address on
stdout (hex), then answers each ``wait <transfer id>`` line on stdin with the inbound status and
a SHA-256 of its memory; any other line ends it.
"""

from __future__ import annotations

import hashlib
import subprocess
import textwrap
import time

import numpy as np

from kv_transfer import KvTransport, PageCopy, PeerAddress, TransferStatus

PAGE = 8192
DST_BYTES = 8 << 20


def receiver_script(
    make_transport_call: str,
    allocate_call: str,
    *,
    size: int = DST_BYTES,
    setup: str = "",
    host_bytes: str = "dst",
    wait_s: float = 10,
) -> str:
    """The receiver's ``python -c`` source. ``setup`` runs first (one line, e.g. choosing a GPU);
    ``make_transport_call`` builds its transport (it may read ``sys.argv``); ``allocate_call``
    returns its ``size`` bytes of zeroed memory and may use ``transport``, ``np`` and ``size``;
    ``host_bytes`` is that memory as bytes on the host, for the digest (``dst.get()`` for a GPU
    array); each ``wait`` waits up to ``wait_s`` seconds."""
    return textwrap.dedent(
        f"""
        import hashlib, sys
        import numpy as np
        from kv_transfer import make_transport
        {setup}
        transport = {make_transport_call}
        size = {size}
        dst = {allocate_call}
        transport.register("dst", dst)
        print(transport.address().to_bytes().hex(), flush=True)
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            if command == "wait":
                status = transport.wait_inbound(arg, {wait_s})
                digest = hashlib.sha256({host_bytes}).hexdigest()
                print(status.name if status else "NONE", digest, flush=True)
            else:
                break
        transport.close()
        """
    )


def read_address(proc: subprocess.Popen[str]) -> PeerAddress:
    """The address the receiver printed first."""
    assert proc.stdout is not None
    return PeerAddress.from_bytes(bytes.fromhex(proc.stdout.readline().strip()))


def inbound_report(receiver: subprocess.Popen[str], transfer_id: str) -> tuple[str, str]:
    """Asks the receiver to wait for ``transfer_id``; returns (status name, SHA-256 hex of its
    memory)."""
    assert receiver.stdin is not None and receiver.stdout is not None
    receiver.stdin.write(f"wait {transfer_id}\n")
    receiver.stdin.flush()
    status, digest = receiver.stdout.readline().split()
    return status, digest


def push_scattered_pages_and_check(writer: KvTransport, receiver: subprocess.Popen[str]) -> None:
    """Pushes half the receiver's pages, each to a page elsewhere, as transfer ``x1``, and checks
    that the receiver saw it done and holds exactly those bytes. Closes ``writer``."""
    peer = read_address(receiver)
    try:
        src = np.random.default_rng(0).integers(0, 256, DST_BYTES, np.uint8)
        writer.register("src", src)
        writer.connect(peer)
        num_slots = DST_BYTES // PAGE
        order = np.random.default_rng(1).permutation(num_slots)[: num_slots // 2]
        pages = [
            PageCopy("src", int(s) * PAGE, "dst", int(d) * PAGE, PAGE)
            for s, d in zip(order, order[::-1], strict=True)
        ]
        handle = writer.write(peer, pages, transfer_id="x1", deadline=time.monotonic() + 10)
        assert handle.wait(15) is TransferStatus.DONE, handle

        expected = np.zeros(DST_BYTES, np.uint8)
        for p in pages:
            expected[p.dst_offset : p.dst_offset + PAGE] = src[p.src_offset : p.src_offset + PAGE]
        assert inbound_report(receiver, "x1") == ("DONE", hashlib.sha256(expected).hexdigest())
    finally:
        writer.close()
