"""The ucx transport between two real processes: the prefill → decode use case."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kv_transfer import PageCopy, TransferStatus, make_transport
from support.receiver_process import (
    DST_BYTES,
    push_scattered_pages_and_check,
    read_address,
    receiver_script,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]

# The receiver's KV memory is plain process memory; argv[1] turns UCX error handling on.
RECEIVER = receiver_script(
    'make_transport("ucx", error_handling=sys.argv[1] == "1")', "np.zeros(size, np.uint8)"
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


def test_scattered_pages_cross_processes(
    receiver_process: subprocess.Popen[str], error_handling: bool
) -> None:
    writer = make_transport("ucx", error_handling=error_handling)
    push_scattered_pages_and_check(writer, receiver_process)


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
