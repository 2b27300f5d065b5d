"""The start-up self-test: which transport and lanes are in use, and does a transfer work.

A node runs it once at start-up, logs the one-line summary and exports the report as metric
labels, so a silent fall-back (say, from shared memory to TCP) is visible: which path a transfer
takes is always counted and exported, never chosen quietly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from kv_transfer.page_copy import PageCopy
from kv_transfer.peer_address import PeerAddress
from kv_transfer.transfer_status import TransferStatus
from kv_transfer.transport import KvTransport, make_transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SelfTestReport:
    transport: str
    lanes: list[str]
    version: str
    # True if the round trip landed every byte intact.
    is_ok: bool
    # Bytes moved by the bandwidth probe, and its rate in GB/s (1e9 B/s).
    num_probe_bytes: int
    probe_gbps: float
    error: str | None = None

    def summary(self) -> str:
        state = "ok" if self.is_ok else f"FAILED ({self.error})"
        return (
            f"KV transport {self.transport} {state}: lanes={','.join(self.lanes)} "
            f"version={self.version} probe={self.num_probe_bytes >> 20} MiB "
            f"at {self.probe_gbps:.2f} GB/s"
        )


def run_self_test(
    transport: KvTransport, num_probe_bytes: int = 8 << 20, page_bytes: int = 8192
) -> SelfTestReport:
    """Pushes scattered pages from `transport` into a second transport of the same kind in this
    process and checks them byte for byte; then times a contiguous push of `num_probe_bytes`."""
    info = transport.info()
    receiver = make_transport(transport.name)
    tag = f"self-test-{id(transport):x}"
    try:
        num_pages = num_probe_bytes // page_bytes
        host_src = np.random.default_rng(0).integers(0, 256, num_probe_bytes, dtype=np.uint8)
        # Memory of the kind each side moves (shared memory for shm, device memory for cuda_ipc).
        src = _filled(transport.allocate(num_probe_bytes), host_src)
        dst = receiver.allocate(num_probe_bytes)
        transport.register(f"{tag}-src", src)
        receiver.register(f"{tag}-dst", dst)
        peer = receiver.address()
        transport.connect(peer)
        order = np.random.default_rng(1).permutation(num_pages)[:64]
        pages = [
            PageCopy(
                f"{tag}-src", int(i) * page_bytes, f"{tag}-dst", int(j) * page_bytes, page_bytes
            )
            for i, j in zip(order, order[::-1], strict=True)
        ]
        status = _push(transport, peer, pages, f"{tag}-pages")
        expect = host_src.reshape(num_pages, page_bytes)[order]
        is_ok = status is TransferStatus.DONE and np.array_equal(
            _to_host(dst).reshape(num_pages, page_bytes)[order[::-1]], expect
        )
        whole = [PageCopy(f"{tag}-src", 0, f"{tag}-dst", 0, num_probe_bytes)]
        _push(transport, peer, whole, f"{tag}-warm")
        start = time.perf_counter()
        status = _push(transport, peer, whole, f"{tag}-probe")
        seconds = time.perf_counter() - start
        is_ok = is_ok and status is TransferStatus.DONE
        report = SelfTestReport(
            info.transport,
            info.lanes,
            info.version,
            is_ok,
            num_probe_bytes,
            num_probe_bytes / seconds / 1e9,
            None if is_ok else f"probe ended {status.name}",
        )
    except Exception as exc:
        report = SelfTestReport(info.transport, info.lanes, info.version, False, 0, 0.0, repr(exc))
    finally:
        receiver.close()
        transport.unregister(f"{tag}-src")
    (logger.info if report.is_ok else logger.error)("%s", report.summary())
    return report


def _filled(memory: object, data: np.ndarray) -> object:
    if isinstance(memory, np.ndarray):
        memory[:] = data
    else:  # a device array (CuPy)
        memory.set(data)  # type: ignore[attr-defined]
    return memory


def _to_host(memory: object) -> np.ndarray:
    return memory if isinstance(memory, np.ndarray) else memory.get()  # type: ignore[attr-defined]


def _push(
    transport: KvTransport, peer: PeerAddress, pages: list[PageCopy], transfer_id: str
) -> TransferStatus:
    handle = transport.write(peer, pages, transfer_id=transfer_id, deadline=time.monotonic() + 10)
    return handle.wait(timeout=11)
