"""The ucx transport between two real processes: the prefill → decode use case."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kv_transfer import PageCopy, PeerAddress, TransferStatus, make_transport

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]

PAGE = 8192
DST_BYTES = 8 << 20

# The receiver: registers zeroed KV memory, publishes its address, then answers
# "wait <transfer id>" with the inbound status and a digest of its memory.
RECEIVER = textwrap.dedent(
    f"""
    import hashlib, sys
    import numpy as np
    from kv_transfer import make_transport
    transport = make_transport("ucx", error_handling=sys.argv[1] == "1")
    dst = np.zeros({DST_BYTES}, np.uint8)
    transport.register("dst", dst)
    print(transport.address().to_bytes().hex(), flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "wait":
            status = transport.wait_inbound(arg, 10)
            print(status.name if status else "NONE", hashlib.sha256(dst).hexdigest(), flush=True)
        else:
            break
    transport.close()
    """
)


@pytest.fixture(params=[False, True], ids=["shm", "error-handling"])
def error_handling(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture
def receiver_process(error_handling: bool) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, "1" if error_handling else "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def read_address(proc: subprocess.Popen[str]) -> PeerAddress:
    assert proc.stdout is not None
    return PeerAddress.from_bytes(bytes.fromhex(proc.stdout.readline().strip()))


def test_scattered_pages_cross_processes(
    receiver_process: subprocess.Popen[str], error_handling: bool
) -> None:
    peer = read_address(receiver_process)
    writer = make_transport("ucx", error_handling=error_handling)
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
        assert receiver_process.stdin is not None and receiver_process.stdout is not None
        receiver_process.stdin.write("wait x1\n")
        receiver_process.stdin.flush()
        status, digest = receiver_process.stdout.readline().split()
        assert status == "DONE"
        assert digest == hashlib.sha256(expected).hexdigest()
    finally:
        writer.close()


def test_killed_receiver_ends_the_transfer_without_hanging(
    receiver_process: subprocess.Popen[str], error_handling: bool
) -> None:
    peer = read_address(receiver_process)
    writer = make_transport("ucx", error_handling=error_handling)
    try:
        writer.register("src", np.ones(DST_BYTES, np.uint8))
        writer.connect(peer)
        receiver_process.kill()
        receiver_process.wait(timeout=10)
        start = time.monotonic()
        pages = [PageCopy("src", 0, "dst", 0, DST_BYTES)]
        handle = writer.write(peer, pages, transfer_id="k", deadline=time.monotonic() + 0.5)
        status = handle.wait(5)
        assert time.monotonic() - start < 3.0
        # Shared-memory lanes cannot see a killed peer: the deadline ends the transfer. With
        # error handling UCX reports the dead endpoint, unless the deadline comes first.
        expected = {TransferStatus.TIMED_OUT}
        if error_handling:
            expected.add(TransferStatus.FAILED)
        assert status in expected, handle
    finally:
        writer.close()
